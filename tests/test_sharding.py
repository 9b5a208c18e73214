"""--zero modes and mixed precision: checkpoints across modes and world sizes,
padding of micro-batches under FSDP, validation and export, bad input."""

import pytest
import torch

from conftest import TOY, assert_ok, free_port, max_diff, run_nodes, run_train

BASE = [*TOY, "--optimizer", "adamw", "--lr", "0.05", "--weight-decay", "0.01",
        "--lr-scheduler", "fixed", "--clip-norm", "0.5", "--disable-validation",
        "--toy-size", "100"]


def train(save_dir, updates, layout, *extra):
    """``layout``: per-rank batches (one process per node); the global batch is
    their sum. Returns checkpoint_last.pt."""
    url, world = f"tcp://127.0.0.1:{free_port()}", len(layout)
    commands = [[*BASE, "--max-update", updates, "--save-dir", save_dir, "--max-sentences",
                 batch, *extra, *(["--distributed-world-size", world, "--distributed-rank", rank,
                                   "--distributed-gpus", 1, "--distributed-init-method", url]
                                  if world > 1 else [])]
                for rank, batch in enumerate(layout)]
    assert_ok(run_nodes(commands))
    return torch.load(save_dir / "checkpoint_last.pt", weights_only=True)


RESUMES = {
    "zero3 on 2 ranks, then 1 plain process": ([24, 8], ["--zero", 3], [32], []),
    "1 plain process, then zero3 on 2 ranks": ([32], [], [20, 12], ["--zero", 3]),
    "zero1 on 2 ranks, then zero2 on 3 ranks": ([16, 16], ["--zero", 1], [8, 16, 8], ["--zero", 2]),
}


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_under_another_mode_and_world_equals_an_uninterrupted_run(tmp_path, name):
    first, first_flags, second, second_flags = RESUMES[name]
    straight = train(tmp_path / "straight", 6, [32])
    train(tmp_path / "resumed", 3, first, *first_flags)
    resumed = train(tmp_path / "resumed", 6, second, *second_flags)
    assert resumed["controller"]["num_updates"] == 6
    assert max_diff(straight["controller"]["model"], resumed["controller"]["model"]) < 1e-5
    # The checkpoint keeps the plain format: full weights and an index-keyed optimizer.
    assert sorted(resumed["controller"]["optimizer"]["state"]) == [0, 1, 2, 3]
    assert resumed["controller"]["model"]["0.weight"].shape == (16, 8)


@pytest.mark.parametrize("zero", ["1", "3"])
def test_resume_in_the_same_mode_is_bit_exact(tmp_path, zero):
    straight = train(tmp_path / "straight", 6, [24, 8], "--zero", zero)
    train(tmp_path / "resumed", 3, [24, 8], "--zero", zero)
    resumed = train(tmp_path / "resumed", 6, [24, 8], "--zero", zero)
    for key, value in straight["controller"]["model"].items():
        assert torch.equal(value, resumed["controller"]["model"][key]), key
    for index, state in straight["controller"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed["controller"]["optimizer"]["state"][index][key])


def test_micro_batch_caps_differing_between_ranks_are_padded_under_zero3(tmp_path):
    """Rank 0 splits its 24 into 3 micro-batches, rank 1 its 8 into 1: under
    FSDP every forward communicates, so rank 1 pads with zero-weight ones.
    Validation (uneven too) runs the same way; the update still matches."""
    straight = train(tmp_path / "straight", 5, [32])
    url = f"tcp://127.0.0.1:{free_port()}"
    common = [*BASE, "--max-update", 5, "--save-dir", tmp_path / "capped", "--zero", 3,
              "--distributed-world-size", 2, "--distributed-gpus", 1,
              "--distributed-init-method", url]
    common.remove("--disable-validation")
    assert_ok(run_nodes([[*common, "--distributed-rank", 0, "--max-sentences", 24,
                          "--micro-batch-cap", 8, "--max-sentences-valid", 7],
                         [*common, "--distributed-rank", 1, "--max-sentences", 8,
                          "--max-sentences-valid", 2]]))
    capped = torch.load(tmp_path / "capped" / "checkpoint_last.pt", weights_only=True)
    assert max_diff(straight["controller"]["model"], capped["controller"]["model"]) < 1e-5


def test_export_under_zero3_holds_the_full_weights(tmp_path):
    """Exports and checkpoint_last.pt of a sharded run hold full tensors."""
    state = train(tmp_path / "run", 2, [16, 8], "--zero", 3)
    for name, shape in (("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (1, 16))):
        assert tuple(state["controller"]["model"][name].shape) == shape


@pytest.mark.parametrize("flags, message", [
    (["--cpu-offload"], "--cpu-offload needs --zero 3"),
    (["--zero", 2, "--find-unused-parameters"], "--find-unused-parameters is a DDP option"),
    (["--fp16", "--cpu"], "use --bf16 on CPU"),
    (["--bf16", "--fp16"], "pick one"),
    (["--zero", 5], "invalid choice"),
])
def test_bad_flags_are_named_with_exit_2(tmp_path, flags, message):
    result = run_train(*BASE, "--max-update", 1, "--save-dir", tmp_path, *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())      # nothing saved


def test_checkpoint_of_another_shape_is_named_under_zero3(tmp_path):
    train(tmp_path / "run", 1, [16, 8], "--zero", 3)
    state = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)
    state["controller"]["model"]["0.weight"] = torch.zeros(4, 8, dtype=torch.float64)
    torch.save(state, tmp_path / "run" / "checkpoint_last.pt")
    url = f"tcp://127.0.0.1:{free_port()}"
    common = [*BASE, "--max-update", 2, "--save-dir", tmp_path / "run", "--zero", 3,
              "--distributed-world-size", 2, "--distributed-gpus", 1,
              "--distributed-init-method", url, "--max-sentences", 8]
    results = run_nodes([[*common, "--distributed-rank", 0], [*common, "--distributed-rank", 1]])
    assert results[0][0] == 2, results[0][1][-2000:]
    assert "parameter 0.weight has shape (16, 8) but the checkpoint holds (4, 8)" in results[0][1]
