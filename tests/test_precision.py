"""--bf16 and --fp16: master weights stay fp32, loss scaling is exact, an
overflow skips on every rank, and the scaler state is checkpointed."""

import re

import pytest
import torch

from conftest import MNIST, TOY, assert_ok, max_diff, run_job, run_train

FP16_ON_CPU = {"HETSEQ_TEST_FP16_ON_CPU": "1"}
TOY_RUN = [*TOY, "--optimizer", "adamw", "--lr", "0.05", "--lr-scheduler", "fixed",
           "--clip-norm", "0", "--disable-validation", "--toy-size", "100"]


def two_ranks(save_dir, updates, *extra, env=None, batches=(24, 8)):
    common = [*TOY_RUN, "--max-update", updates, "--save-dir", save_dir, "--log-all-ranks",
              "--no-progress-bar", *extra]
    return run_job(common, [["--max-sentences", batch] for batch in batches], envs=[env, env])


def mnist_losses(data, save_dir, *extra):
    result = run_train(*MNIST, "--data", data, "--optimizer", "adam", "--lr", 0.001,
                       "--max-sentences", 32, "--max-update", 12, "--distributed-world-size", 2,
                       "--save-dir", save_dir, "--disable-validation", "--no-progress-bar",
                       *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return [float(x) for x in re.findall(r"\| loss=([\d.]+)", result.stderr)]


def test_bf16_trains_close_to_fp32_with_fp32_master_weights(mnist_data, tmp_path):
    fp32 = mnist_losses(mnist_data, tmp_path / "fp32")
    for zero in ("0", "3"):
        bf16 = mnist_losses(mnist_data, tmp_path / f"bf16-{zero}", "--bf16", "--zero", zero)
        assert len(fp32) == len(bf16) == 12
        assert fp32 != bf16                       # autocast did run in bfloat16
        assert all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (zero, fp32, bf16)
        assert bf16[-1] < bf16[0]
        state = torch.load(tmp_path / f"bf16-{zero}" / "checkpoint_last.pt", weights_only=True)
        assert {v.dtype for v in state["controller"]["model"].values()} == {torch.float32}


def test_fp16_loss_scaling_is_exact(tmp_path):
    """The loss scale (a power of two) is divided out in the weighting pass: the
    float64 toy model gives the fp32 result bit for bit."""
    assert_ok(two_ranks(tmp_path / "fp32", 5))
    assert_ok(two_ranks(tmp_path / "fp16", 5, "--fp16", "--fp16-scale-window", 2, env=FP16_ON_CPU))
    plain = torch.load(tmp_path / "fp32" / "checkpoint_last.pt", weights_only=True)
    scaled = torch.load(tmp_path / "fp16" / "checkpoint_last.pt", weights_only=True)
    assert max_diff(plain["controller"]["model"], scaled["controller"]["model"]) == 0
    # 5 clean updates with a window of 2: the scale doubled twice, and is saved.
    assert scaled["controller"]["loss_scaler"] == {"scale": 512.0, "clean_updates": 5}


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


@pytest.mark.parametrize("zero", ["0", "3"])
def test_gradients_summed_in_bfloat16_when_asked(tmp_path, zero):
    """--reduce-dtype bfloat16 (DDP's compress hook, FSDP's reduce dtype): the
    update is the fp32 one up to bfloat16 rounding of the sums, not equal."""
    assert_ok(two_ranks(tmp_path / "fp32", 3, "--zero", zero))
    assert_ok(two_ranks(tmp_path / "bf16", 3, "--zero", zero, "--reduce-dtype", "bfloat16"))
    plain = torch.load(tmp_path / "fp32" / "checkpoint_last.pt", weights_only=True)
    reduced = torch.load(tmp_path / "bf16" / "checkpoint_last.pt", weights_only=True)
    diff = max_diff(plain["controller"]["model"], reduced["controller"]["model"])
    assert 0 < diff < 0.05
