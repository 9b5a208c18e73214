"""CUDA checks; they skip on machines without a GPU (CI has none)."""

import pytest
import torch

from machinery.settings import TOY
from hetseq.plan.capacity import cuda_memory_cap

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_memory_probe_finds_the_largest_micro_batch():
    layer = torch.nn.Linear(4096, 4096).cuda()
    free, _ = torch.cuda.mem_get_info()
    per_sample = 4096 * 4 * 8            # activations and gradients, roughly

    def run(size):
        x = torch.randn(size, 4096, device="cuda", requires_grad=True)
        layer(x).square().sum().backward()
        layer.zero_grad(set_to_none=True)
    limit = 4 * free // per_sample       # beyond what fits
    cap = cuda_memory_cap(run, 1024, limit)
    assert 0 < cap < limit
    run(cap)                             # the cap itself fits


def test_trains_on_one_gpu():
    import subprocess
    import sys

    from machinery.settings import ROOT, child_env
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, TOY), "--max-sentences", "8",
           "--max-update", "3", "--no-save", "--no-progress-bar", "--distributed-world-size", "1"]
    result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "updates=3" in result.stderr


def _run(*args, timeout=600):
    import subprocess
    import sys

    from machinery.settings import ROOT, child_env
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_bert_trains_in_mixed_precision_on_one_gpu(tmp_path, precision):
    result = _run("--task", "bert", "--max-update", 8, "--max-sentences", 16, precision,
                  "--save-dir", tmp_path, "--no-progress-bar", "--disable-validation",
                  "--distributed-world-size", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert {v.dtype for v in state["controller"]["model"].values()
            if v.is_floating_point()} == {torch.float32}        # fp32 master weights
    if precision == "--fp16":
        assert "loss_scaler" in state["controller"]


def test_zero3_cpu_offload_on_one_gpu(tmp_path):
    """One GPU, the sharded state on the host: FSDP2 in a group of one."""
    result = _run("--task", "bert", "--max-update", 4, "--max-sentences", 16, "--bf16",
                  "--zero", 3, "--cpu-offload", "--save-dir", tmp_path, "--no-progress-bar",
                  "--disable-validation", "--distributed-world-size", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--zero 3 (parameters, gradients and optimizer state sharded, on the host" in \
        result.stderr


def _node(command, gpu, env=None):
    """A started train.py node (machinery.commands.train_cmd would add --cpu)."""
    import subprocess
    import sys

    from machinery.commands import RUN_DIR
    from machinery.settings import QUIET, ROOT, child_env
    quiet = [flag for flag in QUIET if flag != "--cpu" or not gpu]
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *quiet, *map(str, command)],
                            cwd=RUN_DIR, env=child_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _gpu_and_cpu_job(common, gpu_node, cpu_node):
    """A job of a GPU node (rank 0) and a CPU node (rank 1) over gloo:
    [(exit code, output)] per node."""
    from machinery.commands import finish, node_commands
    procs = [_node(node, gpu=index == 0) for index, node in enumerate(
        node_commands([*common, "--distributed-backend", "gloo"], [gpu_node, cpu_node]))]
    results = finish(procs, timeout=300)
    for code, out in results:
        assert code == 0, out[-3000:]
    assert "cuda:0" in results[0][1], results[0][1][-3000:]     # rank 0 really took the GPU
    return results


def test_zero3_on_a_gpu_and_a_cpu_rank(tmp_path):
    """A GPU rank and a CPU rank in one job (gloo), uneven batches, --zero 3."""
    _gpu_and_cpu_job([*TOY, "--max-update", 3, "--save-dir", tmp_path, "--zero", 3],
                     ["--max-sentences", 24], ["--max-sentences", 8])


@pytest.mark.parametrize("split", ["manual 24+8", "auto"])
def test_a_gpu_rank_and_a_cpu_rank_match_one_process(tmp_path, split):
    """The float64 toy with SGD: a GPU rank and a CPU rank, split by hand or
    by measured speed (--capacity auto), make the update of one CPU process
    on the global batch of 32."""
    from machinery.commands import final_params
    from machinery.in_process import alone, max_diff
    from machinery.settings import EXACT, EXACT_SGD
    common = [*EXACT_SGD, "--max-update", 7, "--save-dir", tmp_path]
    if split == "auto":
        _gpu_and_cpu_job([*common, "--capacity", "auto", "--global-batch-size", 32], [], [])
    else:
        _gpu_and_cpu_job(common, ["--max-sentences", 24], ["--max-sentences", 8])
    reference = alone(*EXACT_SGD, "--max-update", 7, "--max-sentences", 32)["model"]
    trained = {name: value.cpu() for name, value in final_params(tmp_path).items()}
    assert max_diff(reference, trained) < EXACT


def test_an_elastic_gpu_node_hands_its_state_to_a_cpu_joiner_exactly(tmp_path):
    """--elastic over gloo: a GPU node (rank 0) and a CPU node train; a
    second CPU node joins and receives the state from the GPU rank. The
    weights equal one CPU process's (the float64 toy, SGD)."""
    # An elastic job needs a secret, and a secret the cipher (the [secret]
    # extra), which a GPU machine without the package lacks.
    pytest.importorskip("cryptography")
    import socket
    import time

    from machinery.commands import final_params
    from machinery.in_process import max_diff
    from machinery.settings import UPDATE_LINE, EXACT, free_port
    from machinery.watched import Watched
    from machinery.elastic_jobs import ELASTIC, reference
    from machinery.parity import COMMON
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    env = {"HETSEQ_JOB_SECRET": "5f0c1d2e3b4a69788796a5b4c3d2e1f0"}

    def start(name, gpu):
        # ELASTIC's 100 updates: at 40 a fast machine finished before the joiner came.
        command = [*COMMON, *ELASTIC, "--distributed-backend", "gloo",
                   "--distributed-init-method", url, "--save-dir", tmp_path / name]
        return Watched(_node(command, gpu, env))
    first = start("a", gpu=True)
    deadline = time.monotonic() + 120
    while True:           # the GPU node serves the URL's port, so it leads: rank 0
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and first.proc.poll() is None, first.output()
            time.sleep(0.1)
    second = start("b", gpu=False)
    first.wait_for(UPDATE_LINE, 5, timeout=120)
    joiner = start("c", gpu=False)
    first.wait_for(r"generation 2: 3 nodes", timeout=120)
    for watched in (first, second, joiner):
        code, out = watched.finish(240)
        assert code == 0, out[-4000:]
    assert "cuda:0" in first.output(), first.output()[-3000:]
    trained = {k: v.cpu() for k, v in final_params(tmp_path / "a").items()}
    assert max_diff(reference(), trained) < EXACT


from system.test_randomness import models  # noqa: E402,F401  (the BERT with dropout, and its data)


def test_a_gpu_rank_drawing_in_kernels_and_a_cpu_rank_train_one_bert(tmp_path, models):  # noqa: F811
    """BERT with hidden and attention dropout, SGD: a GPU rank (its masks
    drawn inside the Triton kernels, attention flash-style) and a CPU rank
    (the torch path) of one job, 6+2, make the update of one CPU process of
    8. Both devices draw the same masks; the tolerance is the GPU's float32
    sums in another order (without dropout the run lands 1e-3 away)."""
    from machinery.commands import final_params
    from machinery.in_process import max_diff
    from unit.keyed.test_randomness import alone
    _gpu_and_cpu_job([*models["bert"], "--save-dir", tmp_path],
                     ["--max-sentences", 6], ["--max-sentences", 2])
    trained = {name: value.cpu() for name, value in final_params(tmp_path).items()}
    assert max_diff(alone(models["bert"]), trained) < 1e-4
