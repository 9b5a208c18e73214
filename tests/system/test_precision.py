"""--bf16 and --fp16: master weights stay fp32, loss scaling is exact, an
overflow skips on every rank, and the scaler state is checkpointed.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_precision.py."""

import re

import pytest
import torch

from machinery.jobs import run_jobs

from machinery.commands import assert_ok, run_job, run_train
from machinery.in_process import max_diff
from machinery.settings import EXACT_SGD, MNIST, TOY


FP16_ON_CPU = {"HETSEQ_TEST_FP16_ON_CPU": "1"}


TOY_RUN = [*TOY, "--optimizer", "adamw", "--lr", "0.05", "--lr-scheduler", "fixed",
           "--clip-norm", "0", "--disable-validation", "--toy-size", "100"]


def two_ranks(save_dir, updates, *extra, env=None, batches=(24, 8)):
    common = [*TOY_RUN, "--max-update", updates, "--save-dir", save_dir, "--log-all-ranks",
              "--no-progress-bar", *extra]
    return run_job(common, [["--max-sentences", batch] for batch in batches], envs=[env, env])


def mnist_losses(data, save_dir, *extra):
    result = run_train(*MNIST, "--data", data, "--optimizer", "adam", "--lr", 0.001,
                       "--max-sentences", 32, "--max-update", 8, "--distributed-world-size", 2,
                       "--save-dir", save_dir, "--disable-validation", "--no-progress-bar",
                       *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return [float(x) for x in re.findall(r"\| loss=([\d.]+)", result.stderr)]


def test_bf16_trains_close_to_fp32_with_fp32_master_weights(mnist_data, tmp_path):
    """Under --zero 3 (FSDP's mixed precision; bf16 under DDP's autocast is
    test_parity.py's: bf16 is emulated on an AVX2 CPU, 12x fp32's cost)."""
    fp32 = mnist_losses(mnist_data, tmp_path / "fp32")
    for zero in ("3",):
        bf16 = mnist_losses(mnist_data, tmp_path / f"bf16-{zero}", "--bf16", "--zero", zero)
        assert len(fp32) == len(bf16) == 8
        assert fp32 != bf16                       # autocast did run in bfloat16
        assert all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (zero, fp32, bf16)
        assert bf16[-1] < bf16[0]
        state = torch.load(tmp_path / f"bf16-{zero}" / "checkpoint_last.pt", weights_only=True)
        assert {v.dtype for v in state["controller"]["model"].values()} == {torch.float32}


F32 = ["--toy-dtype", "float32"]       # what autocast acts on (float64 it leaves alone)


# SGD: its update is linear in the gradient, so fp16's rounding shows at its
# size (AdamW's first steps are sign(g): a gradient within fp16's rounding of
# zero moves a weight by 2 lr whichever way it rounds).
SGD_BASE = [*EXACT_SGD, "--no-save"]


SGD_RUN = [*SGD_BASE, "--max-update", 3]


def job(base, *extra):
    return [[*base, *extra, "--max-sentences", batch] for batch in (24, 8)]


@pytest.fixture(scope="module")
def precision_jobs(tmp_path_factory):
    fp16 = [*F32, "--fp16", "--fp16-scale-window", 2]
    jobs = {"fp32": job(SGD_BASE, "--max-update", 5, *F32),
            "fp16 from 128": job(SGD_BASE, "--max-update", 5, *fp16),
            "fp16 from 1024": job(SGD_BASE, "--max-update", 5, *fp16, "--fp16-init-scale", 1024),
            **{f"zero{zero} {dtype}": job(SGD_RUN, "--zero", zero, "--reduce-dtype", dtype)
               for zero in (0, 3) for dtype in ("float32", "bfloat16")}}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(*next(iter(FP16_ON_CPU.items())))
        return run_jobs(2, list(jobs.items()), tmp_path_factory.mktemp("precision"))


def test_fp16_loss_scaling_is_exact(precision_jobs):
    """The loss scale (a power of two) is divided out in the weighting pass:
    two runs from different scales give the same weights bit for bit, with
    autocast active (a float32 model: the weights differ from fp32's)."""
    low, high = (precision_jobs[f"fp16 from {s}"].state for s in (128, 1024))
    assert max_diff(low["model"], high["model"]) == 0
    # fp16 against fp32: 1.3e-4 after 5 updates (measured; dropout on).
    assert 0 < max_diff(low["model"], precision_jobs["fp32"].state["model"]) < 1e-3
    # 5 clean updates with a window of 2: the scale doubled twice, and is saved.
    assert low["loss_scaler"] == {"scale": 512.0, "clean_updates": 5}
    assert high["loss_scaler"] == {"scale": 4096.0, "clean_updates": 5}


def test_fp16_scaler_state_resumes(tmp_path):
    assert_ok(two_ranks(tmp_path / "run", 3, "--fp16", "--fp16-scale-window", 2, env=FP16_ON_CPU))
    assert_ok(two_ranks(tmp_path / "run", 5, "--fp16", "--fp16-scale-window", 2, env=FP16_ON_CPU))
    state = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)
    assert state["controller"]["loss_scaler"] == {"scale": 512.0, "clean_updates": 5}


@pytest.mark.parametrize("zero", ["0", "3"])
def test_fp16_overflow_on_one_rank_skips_on_all_and_stops_at_the_minimum_scale(tmp_path, zero):
    results = two_ranks(tmp_path / "run", 30, "--fp16", "--min-loss-scale", 16,
                        "--toy-nan-grad-after", 2, "--zero", zero, env=FP16_ON_CPU)
    for code, out in results:
        assert code == 4, out[-3000:]
        # 128 -> 64 -> 32 -> 16 -> 8: the fourth overflow goes below the minimum.
        assert re.findall(r"loss scale now (\d+)", out) == ["64", "32", "16", "8"], out[-3000:]
    assert "fell below --min-loss-scale 16" in results[0][1]


@pytest.mark.parametrize("zero", [0, 3])
def test_gradients_summed_in_bfloat16_when_asked(precision_jobs, zero):
    """--reduce-dtype bfloat16 (DDP's compress hook, FSDP's reduce dtype): the
    sums keep 8 bits, 2**-9 relative; three SGD updates of lr 0.2 then leave
    the float64 weights 6e-4 from the float32 reduction's (rounding to float32
    instead would leave 1e-8; a wrong scale, far more than 2e-3)."""
    plain, reduced = (precision_jobs[f"zero{zero} {dtype}"].state["model"]
                      for dtype in ("float32", "bfloat16"))
    assert 1e-4 < max_diff(plain, reduced) < 2e-3
