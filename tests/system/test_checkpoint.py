"""Checkpoints: bit-exact resume, safe writes, retention; and failure handling.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/run/test_checkpoint.py."""

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from machinery.commands import (assert_ok, final_params, node_commands, ranks_of, run_job,
                                run_train, start_nodes, train_cmd)
from machinery.settings import EXACT, EXACT_SGD, MNIST, ROOT, TOY, UPDATE_LINE, child_env
from machinery.watched import Watched
from hetseq.base.errors import UserError
from hetseq.checkpoints import files as checkpoint_files
from unit.run.test_checkpoint import PREVIOUS, PREVIOUS_FLAGS


def test_resume_mid_epoch_is_bit_exact(mnist_data, tmp_path):
    """The MNIST CNN (dropout on) on 2 ranks of 16 + 8: 9 updates in one go,
    or 5 and then the same command again, which resumes: the same bits.
    768 samples / 24 per update: 32 updates an epoch, so update 5 is
    mid-epoch. The three jobs run in turn in one process group."""
    from machinery.jobs import run_jobs

    def job(folder, updates):
        common = [*MNIST, "--data", mnist_data, "--optimizer", "adam", "--lr", 0.001,
                  "--lr-scheduler", "fixed", "--max-update", updates, "--save-dir",
                  tmp_path / folder, "--disable-validation", "--distributed-world-size", 2]
        return [[*common, "--max-sentences", batch] for batch in (16, 8)]
    run_jobs(2, [("straight", job("straight", 9)), ("first part", job("resumed", 5)),
                 ("resumed", job("resumed", 9))], tmp_path / "group")
    straight, resumed = (torch.load(tmp_path / folder / "checkpoint_last.pt", weights_only=True)
                         for folder in ("straight", "resumed"))
    assert resumed["train_iterator"] == straight["train_iterator"]
    assert resumed["controller"]["num_updates"] == 9
    for key, value in straight["controller"]["model"].items():
        assert torch.equal(value, resumed["controller"]["model"][key]), key
    assert len(straight["rng"]) == 2


def _save_forever(path):
    big = {"format": checkpoint_files.FORMAT, "weights": torch.randn(64, 1024, 1024)}
    while True:
        checkpoint_files.save(path, big)


def test_kill_while_saving_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    checkpoint_files.save(str(path), {"format": checkpoint_files.FORMAT, "value": torch.arange(5)})
    # daemon, and killed whatever happens: a writer left running would keep
    # pytest from exiting when the wait below fails.
    writer = multiprocessing.get_context("spawn").Process(target=_save_forever, args=(str(path),),
                                                          daemon=True)
    writer.start()
    try:
        deadline = time.time() + 60
        # A file of over 1 MB is a save half done (whichever file it writes to).
        while not any(p.stat().st_size > 1 << 20 for p in tmp_path.iterdir()):
            assert time.time() < deadline, "no save of over 1 MB began in 60 s"
            time.sleep(0.01)
    finally:
        os.kill(writer.pid, signal.SIGKILL)                    # mid-write
        writer.join()
    try:
        kept = checkpoint_files.load(str(path))
    except UserError as err:
        pytest.fail(f"the previous checkpoint did not survive the kill: {err}")
    assert torch.equal(kept["value"], torch.arange(5))
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    checkpoint_files.remove_stale_temporaries(str(tmp_path))        # what the next run does
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]


def test_interval_checkpoints_retention_and_best(tmp_path):
    result = run_train(*TOY, "--max-sentences", 16, "--max-update", 9, "--lr", 0.1,
                       "--save-interval-updates", 2, "--keep-interval-updates", 2,
                       "--keep-last-epochs", 1, "--save-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    # 7 updates an epoch: updates 6 and 8 are the last two interval saves.
    assert [n for n in names if n.count("_") == 2] == ["checkpoint_1_6.pt", "checkpoint_2_8.pt"]
    assert "checkpoint1.pt" in names and "checkpoint_best.pt" in names
    # Validated at the end of epoch 1 (update 7) and at the stop (update 9):
    # the best is the lower loss, and its checkpoint holds that moment.
    losses = [float(x) for x in re.findall(r"valid on 'valid' \| epoch \d+ \| loss=([\d.]+)",
                                           result.stderr)]
    assert len(losses) == 2, result.stderr[-3000:]
    best = torch.load(tmp_path / "checkpoint_best.pt", weights_only=True)
    assert best["best"] == pytest.approx(min(losses), rel=1e-3) and best["args"]["max_update"] == 9
    assert best["controller"]["num_updates"] == (7, 9)[losses.index(min(losses))]


def test_validations_between_epoch_ends_count_for_the_best_checkpoint(tmp_path):
    """--validate-interval-updates 2 with saves every 2 updates (epochs of 7):
    validated once at each of updates 2, 4, 6, 7 (the epoch's end), 8 and 9
    (the stop); the best checkpoint is the lowest of all of them (update 4
    with seed 4: a validation between epoch ends)."""
    result = run_train(*TOY, "--max-sentences", 16, "--max-update", 9, "--lr", 1.0, "--seed", 4,
                       "--validate-interval-updates", 2, "--save-interval-updates", 2,
                       "--save-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    validated = [(int(u), float(loss)) for loss, u in re.findall(
        r"valid on 'valid' \| epoch \d+ \| loss=([\d.]+).*\| update (\d+)", result.stderr)]
    assert [u for u, _ in validated] == [2, 4, 6, 7, 8, 9], result.stderr[-3000:]
    lowest = min(validated, key=lambda v: v[1])[0]
    assert lowest not in (7, 9), validated      # else this test could not fail
    best = torch.load(tmp_path / "checkpoint_best.pt", weights_only=True)
    assert best["controller"]["num_updates"] == lowest


@pytest.mark.parametrize("reset", [True, False])
def test_reset_flags_keep_the_model_only(tmp_path, reset):
    """3 updates of 16, then 1 more: with the --reset-* flags the optimizer
    starts afresh (Adam has stepped once), the data from the epoch's start
    (16 samples in), the running averages from nothing (16 samples in them);
    without them all three go on (4 steps, 64 samples)."""
    run = [*TOY, "--max-sentences", 16, "--optimizer", "adam", "--save-dir", tmp_path,
           "--disable-validation"]
    assert run_train(*run, "--max-update", 3).returncode == 0
    before = final_params(tmp_path)
    resets = ["--reset-dataloader", "--reset-optimizer", "--reset-meters"] if reset else []
    result = run_train(*run, "--max-update", 4, *resets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    after = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert after["controller"]["num_updates"] == 4
    assert any(not torch.equal(before[k], after["controller"]["model"][k]) for k in before)
    steps = {float(state["step"]) for state in after["controller"]["optimizer"]["state"].values()}
    samples = 16 if reset else 64
    assert steps == {1.0 if reset else 4.0}
    assert after["train_iterator"]["samples_in_epoch"] == samples
    assert after["meters"]["loss"]["count"] == samples


def endless_pair(timeout):
    """Two ranks training 'forever' (rank 0 a little slow), as separate nodes,
    once 10 updates are done (rank 0 logged them)."""
    common = [*TOY, "--max-sentences", 8, "--max-update", 100000, "--no-save",
              "--disable-validation", "--toy-slow-rank", 0, "--toy-slow-ms", 2,
              "--distributed-timeout", timeout]
    nodes = [Watched(proc) for proc in start_nodes(node_commands(common, [[], []]))]
    nodes[0].wait_for(UPDATE_LINE, count=10)
    return nodes


def test_sigkill_of_one_rank_names_it(tmp_path):
    # A killed peer resets its connections: the survivor's next collective
    # fails at once (about a second here), not after --distributed-timeout.
    timeout = 60
    nodes = endless_pair(timeout)
    nodes[1].proc.send_signal(signal.SIGKILL)
    start = time.time()
    code, out = nodes[0].finish(timeout=2 * timeout)
    nodes[1].finish()
    assert code == 3, out[-3000:]
    assert time.time() - start < timeout / 3
    assert "lost rank 1 (" in out and "heartbeat stopped" in out, out[-3000:]


def test_ranks_with_different_parameters_are_detected(tmp_path):
    common = [*TOY, "--max-sentences", 8, "--max-update", 5, "--no-save", "--disable-validation",
              "--divergence-check-interval", 1]
    results = run_job(common, [[], ["--toy-perturb-after", 2]])
    for code, out in results:
        assert code == 4, out[-3000:]
    assert "parameters differ between ranks" in results[0][1]


@pytest.mark.parametrize("clip", ["25", "0"])   # grad-norm pass / fused scale-and-check pass
@pytest.mark.parametrize("zero", ["0", "3"])
def test_non_finite_gradient_on_one_rank_skips_on_all(tmp_path, clip, zero):
    # Rank 1's gradients turn NaN while every loss stays finite: the NaN reaches
    # every rank through the all-reduce, so all skip the same updates and stop.
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 50, "--no-save",
                       "--distributed-world-size", 2, "--toy-nan-grad-after", 3,
                       "--max-nan-updates", 3, "--disable-validation", "--clip-norm", clip,
                       "--log-interval", 1000, "--zero", zero)
    assert result.returncode == 4, result.stderr[-3000:]
    for rank in (0, 1):
        lines = [line for line in result.stderr.splitlines() if f"| rank {rank} |" in line]
        assert sum("update skipped" in line for line in lines) == 3, result.stderr[-3000:]


@pytest.mark.parametrize("clip", ["25", "0"])
def test_overflow_in_one_shard_skips_on_every_rank(tmp_path, clip):
    """--zero 3: rank 1's NaN reaches only the shard of rank 0 that holds the
    output bias; the overflow flag (or norm) is summed, so both ranks skip."""
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 50, "--no-save",
                       "--distributed-world-size", 2, "--toy-nan-bias-grad-after", 3,
                       "--max-nan-updates", 3, "--disable-validation", "--clip-norm", clip,
                       "--log-interval", 1000, "--zero", 3)
    assert result.returncode == 4, result.stderr[-3000:]
    for rank in (0, 1):
        lines = [line for line in result.stderr.splitlines() if f"| rank {rank} |" in line]
        assert sum("update skipped" in line for line in lines) == 3, result.stderr[-3000:]


def test_non_finite_losses_skip_then_stop(tmp_path):
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 50, "--no-save",
                       "--toy-nan-after", 3, "--max-nan-updates", 4, "--disable-validation")
    assert result.returncode == 4, result.stderr[-3000:]
    assert result.stderr.count("update skipped") == 4
    assert "4 updates in a row had a non-finite loss" in result.stderr


# A frozen rank is seen only when --distributed-timeout passes. It also bounds
# the start-up of both nodes (2-3 s here): 7 s leaves room for a slow start,
# and a collective of the toy that took that long is a frozen rank, even on CI.
FROZEN_TIMEOUT = 7


def test_frozen_rank_is_named_after_the_timeout(tmp_path):
    nodes = endless_pair(FROZEN_TIMEOUT)
    try:
        nodes[1].proc.send_signal(signal.SIGSTOP)       # hung, not dead
        start = time.time()
        code, out = nodes[0].finish(timeout=60)
        assert code == 3, out[-3000:]
        # The timeout, then the watch that names the rank (a few seconds).
        assert time.time() - start < FROZEN_TIMEOUT + 10
        assert "lost rank 1 (" in out, out[-3000:]
    finally:
        nodes[1].proc.kill()
        nodes[1].finish()


def test_frozen_rank_zero_is_named_by_the_others(tmp_path):
    # Rank 0 serves the store: when it hangs, the watch that names the lost
    # rank must not block on the store (TCPStore.add has no deadline).
    nodes = endless_pair(FROZEN_TIMEOUT)
    try:
        nodes[0].proc.send_signal(signal.SIGSTOP)
        start = time.time()
        code, out = nodes[1].finish(timeout=60)
        assert code == 3, out[-3000:]
        assert time.time() - start < FROZEN_TIMEOUT + 10
        assert "lost rank 0 (" in out and "rendezvous store" in out, out[-3000:]
    finally:
        nodes[0].proc.kill()
        nodes[0].finish()


def trained_indices(prefix):
    return sorted(int(i) for path in prefix.parent.glob(prefix.name + ".*")
                  for i in path.read_text().split())


def toy_nodes(layout, save_dir, log, *extra):
    """One command per rank; ``layout`` lists each rank's batch."""
    common = [*TOY, "--save-dir", save_dir, "--disable-validation", "--toy-log-indices", log,
              *extra]
    results = run_job(common, [["--max-sentences", batch] for batch in layout])
    assert_ok(results)
    return results


@pytest.mark.parametrize("resumed", [[4, 4], [4, 4, 4]], ids=["batch-halved", "three-ranks"])
def test_resume_with_another_global_batch_uses_every_sample_once(tmp_path, resumed):
    # 100 samples; 3 updates of 8 + 8 = 48 samples, then the rest of epoch 1
    # with another global batch or world size: every sample exactly once.
    save, log = tmp_path / "ckpt", tmp_path / "seen"
    toy_nodes([8, 8], save, log, "--max-update", 3)
    results = toy_nodes(resumed, save, log, "--max-epoch", 1)
    assert trained_indices(log) == list(range(100))
    assert f"resuming epoch 1 at sample 48 of 100 with a global batch of {sum(resumed)} " \
           f"on {len(resumed)} ranks (saved: 16 on 2 ranks)" in results[0][1], results[0][1][-3000:]


def test_checkpoints_take_the_users_umask(tmp_path):
    result = subprocess.run(train_cmd(*TOY, "--max-sentences", 8, "--max-update", 1,
                                      "--disable-validation", "--save-dir", tmp_path),
                            cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=120, preexec_fn=lambda: os.umask(0o027))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "checkpoint_last.pt").stat().st_mode & 0o777 == 0o640


def test_full_disk_is_named_and_keeps_the_previous_checkpoint(small_disk):
    run = [*TOY, "--max-sentences", 8, "--disable-validation", "--save-dir", small_disk]
    assert run_train(*run, "--max-update", 2).returncode == 0
    with open(small_disk / "filler", "wb", buffering=0) as filler:   # every byte left
        try:
            while filler.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    result = run_train(*run, "--max-update", 4)
    last = small_disk / "checkpoint_last.pt"
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"no space left on device while writing {last}; the previous checkpoint {last} " \
           "is intact" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # TensorBoard (on by default, in the same folder) hit the full disk first: one warning.
    assert result.stderr.count(f"TensorBoard: cannot write to {small_disk}/tensorboard") == 1
    assert torch.load(last, weights_only=True)["controller"]["num_updates"] == 2
    assert not [p for p in small_disk.iterdir() if p.name.startswith(".tmp-")]


def test_rank_killed_by_a_signal_gives_exit_3_not_the_signal_number():
    # One command spawning both ranks; the OOM killer takes one child.
    node = Watched(start_nodes([[*TOY, "--max-sentences", 8, "--max-update", 100000,
                                 "--no-save", "--disable-validation",
                                 "--distributed-world-size", 2]])[0])
    node.wait_for(UPDATE_LINE, count=10)                # both ranks are training
    children = ranks_of(node.proc.pid)
    assert len(children) == 2, children
    os.kill(int(children[1]), signal.SIGKILL)
    code, out = node.finish(timeout=60)
    assert code == 3, out[-3000:]
    assert "was killed by signal SIGKILL" in out, out[-3000:]


def test_killed_rank_zero_is_named_without_a_cpp_stack_dump():
    nodes = endless_pair(60)
    nodes[0].proc.send_signal(signal.SIGKILL)
    code, out = nodes[1].finish(timeout=60)
    nodes[0].finish()
    assert code == 3, out[-3000:]
    assert "lost rank 0 (" in out, out[-3000:]
    assert "frame #" not in out and "Exception raised from" not in out, out[-3000:]


def test_node_that_stops_on_its_own_error_ends_the_job_at_once():
    # Node 1 stops with a user error (exit 2) mid-run; node 0 must not wait
    # for --distributed-timeout (60 s here) to notice.
    common = [*TOY, "--max-sentences", 8, "--max-update", 100000, "--no-save",
              "--disable-validation", "--distributed-timeout", 60]
    start = time.time()
    (code0, out0), (code1, out1) = run_job(common, [[], ["--toy-fail-after", 20]])
    assert code1 == 2 and "this node's data ends" in out1, out1[-3000:]
    assert code0 == 3 and "lost rank 1 (" in out0, out0[-3000:]
    assert time.time() - start < 60 / 2, (out0 + out1)[-3000:]   # not the 60 s timeout


def test_resume_with_the_same_plan_does_not_log_a_change(tmp_path):
    run = [*TOY, "--max-sentences", 8, "--disable-validation", "--save-dir", tmp_path,
           "--distributed-world-size", 2]
    assert run_train(*run, "--max-update", 2).returncode == 0
    result = run_train(*run, "--max-update", 4)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-3000:]
    assert "capacity plan changed" not in result.stderr, result.stderr[-3000:]


SGD = ["--optimizer", "sgd", "--lr", 0.05, "--lr-scheduler", "fixed", "--clip-norm", 0,
       "--disable-validation"]


def test_resume_on_another_world_size_is_exact_with_dropout(mnist_data, tmp_path):
    """MNIST's CNN draws its two dropouts per sample (hetseq/keyed/randomness.py):
    2 ranks of 16 + 8 for 3 updates, resumed on 3 ranks of 8 each up to
    update 6, end where 2 ranks that never stopped end, to float32's
    summation order. No RNG state of the first world size is needed for
    that. (The float64 toy, dropout on, resumes across modes and world sizes
    to 1e-10: test_sharding.py.)"""
    common = [*MNIST, "--data", mnist_data, *SGD]

    def job(save, updates, layout):
        assert_ok(run_job([*common, "--max-update", updates, "--save-dir", save],
                          [["--max-sentences", batch] for batch in layout]))
        return final_params(save)
    straight = job(tmp_path / "straight", 6, [16, 8])
    job(tmp_path / "resumed", 3, [16, 8])
    resumed = job(tmp_path / "resumed", 6, [8, 8, 8])
    assert max((straight[k] - resumed[k]).abs().max().item() for k in straight) < 1e-5


def test_checkpoints_of_the_previous_release_resume_exactly(tmp_path):
    """Each saved state (model, optimizer, schedule, data position, the
    rounds' outer optimizer and every rank's own optimizer) loads and goes
    on from update 5: 4 more updates equal 2, saved by this release, then 2
    more; without its optimizer state (--reset-optimizer) they do not, so
    that state was read. Release 0.2.0's own first 4 updates cannot be
    replayed: issue 57 drew every dropout mask anew (Philox, docs/gpu.md)."""
    from machinery.jobs import run_jobs
    jobs = []
    for name, flags in PREVIOUS_FLAGS.items():
        common = [*EXACT_SGD, *flags, "--seed", 3]
        ranks = [[*common, "--max-sentences", size, "--distributed-world-size", 2]
                 for size in (7, 3)]
        for run in ("resumed", "in two", "reset"):
            (tmp_path / name / run).mkdir(parents=True)
            saved = (PREVIOUS / name).read_bytes()
            (tmp_path / name / run / "checkpoint_last.pt").write_bytes(saved)
        jobs += [(f"{name} resumed", [[*argv, "--max-update", 8, "--save-dir",
                                       tmp_path / name / "resumed"] for argv in ranks]),
                 (f"{name} reset", [[*argv, "--max-update", 8, "--reset-optimizer",
                                     "--save-dir", tmp_path / name / "reset"] for argv in ranks])]
        jobs += [(f"{name} in two {stop}", [[*argv, "--max-update", stop, "--save-dir",
                                             tmp_path / name / "in two"] for argv in ranks])
                 for stop in (6, 8)]
    try:
        results = run_jobs(2, jobs, tmp_path / "group")
    except Exception as err:     # a rank that could not load the state ends its process
        pytest.fail(f"a checkpoint of the previous release did not resume: {err}"[:3000])
    for name in PREVIOUS_FLAGS:
        resumed, in_two = results[f"{name} resumed"], results[f"{name} in two 8"]
        assert resumed.state["num_updates"] == in_two.state["num_updates"] == 8, name
        ran = sorted(resumed.updates(), key=lambda u: int(u.split()[1]))
        assert ran == [f"update {n}" for n in range(5, 9)], (name, ran)   # it went on from 4
        assert sorted(in_two.updates()) == ["update 7", "update 8"], name
        for key, value in resumed.state["model"].items():
            assert torch.allclose(value, in_two.state["model"][key], rtol=0, atol=EXACT), \
                (name, key)
        reset = results[f"{name} reset"].state["model"]
        assert max((reset[k] - v).abs().max().item()
                   for k, v in resumed.state["model"].items()) > 1e3 * EXACT, name


_KILLED_SAVE = """
import os, signal, sys
import torch
from hetseq.checkpoints import files as checkpoint_files
path, step = sys.argv[1], sys.argv[2]
checkpoint_files.save(path, {"format": checkpoint_files.FORMAT, "which": "old"})
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if step == "while writing":
    def write(f):
        f.write(b"half a checkpoint")
        f.flush()
        die()
    checkpoint_files._atomic_write(path, write)
if step == "before the rename":
    os.replace = die
if step == "after the rename":
    checkpoint_files._sync_folder = die
checkpoint_files.save(path, {"format": checkpoint_files.FORMAT, "which": "new"})
die()
"""


@pytest.mark.parametrize("step, left", [("while writing", "old"), ("before the rename", "old"),
                                        ("after the rename", "new"), ("after the save", "new")])
def test_a_save_killed_at_any_step_leaves_a_checkpoint_that_resumes(tmp_path, step, left):
    """A process killed (SIGKILL) in the middle of a save: the next start
    removes the half-written temporary and resumes from a whole checkpoint,
    the old one until the rename, the new one after it."""
    path = tmp_path / "checkpoint_last.pt"
    child = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path), step],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    checkpoint_files.remove_stale_temporaries(tmp_path)
    assert os.listdir(tmp_path) == ["checkpoint_last.pt"]
    assert checkpoint_files.load(str(path))["which"] == left
