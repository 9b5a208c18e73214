"""CUDA checks; they skip on machines without a GPU (CI has none)."""

import pytest
import torch

from conftest import TOY
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

    from conftest import ROOT, child_env
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, TOY), "--max-sentences", "8",
           "--max-update", "3", "--no-save", "--no-progress-bar", "--distributed-world-size", "1"]
    result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "updates=3" in result.stderr


def _run(*args, timeout=600):
    import subprocess
    import sys

    from conftest import ROOT, child_env
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


def test_zero3_on_a_gpu_and_a_cpu_rank(tmp_path):
    """A GPU rank and a CPU rank in one job (gloo), uneven batches, --zero 3."""
    from conftest import assert_ok, run_job
    common = [*TOY, "--max-update", 3, "--save-dir", tmp_path, "--zero", 3,
              "--distributed-backend", "gloo"]
    assert_ok(run_job(common, [["--max-sentences", 24], ["--max-sentences", 8, "--cpu"]]))
