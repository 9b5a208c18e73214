"""--zero modes and mixed precision: checkpoints across modes and world sizes,
padding of micro-batches under FSDP, validation and export, bad input."""

import math
import re

import pytest
import torch

from machinery.jobs import run_jobs

from machinery.settings import EXACT
from machinery.commands import assert_ok, run_job, run_nodes, run_train
from machinery.in_process import (build_controller, keyed, leave_process_group, max_diff, portable,
                                  rank_queue, start_ranks, unpack)
from machinery.settings import EXACT_SGD, GROUP_TIMEOUT, TOY

BASE = [*TOY, "--optimizer", "adamw", "--lr", "0.05", "--weight-decay", "0.01",
        "--lr-scheduler", "fixed", "--clip-norm", "0.5", "--disable-validation",
        "--toy-size", "100"]


_STRAIGHT = {}


def straight_run(tmp_path, updates, base=BASE):
    """One process, batch 32, never interrupted (once per session per length)."""
    key = (updates, tuple(map(str, base)))
    if key not in _STRAIGHT:
        _STRAIGHT[key] = train(tmp_path / "straight", updates, [32], base=base)
    return _STRAIGHT[key]


def train(save_dir, updates, layout, *extra, base=BASE):
    """``layout``: per-rank batches (one process per node); the global batch is
    their sum. Returns checkpoint_last.pt."""
    common = [*base, "--max-update", updates, "--save-dir", save_dir, *extra]
    # An entry is a batch, or (batch, memory in GB) for shares by memory.
    nodes = [["--max-sentences", batch] if isinstance(batch, int) else
             ["--max-sentences", batch[0], "--max-memory-gb", batch[1]] for batch in layout]
    assert_ok(run_job(common, nodes) if len(layout) > 1 else run_nodes([common + nodes[0]]))
    return torch.load(save_dir / "checkpoint_last.pt", weights_only=True)


RESUMES = {
    "zero3 on 2 ranks, then 1 plain process": ([24, 8], ["--zero", 3], [32], []),
    "1 plain process, then zero3 on 2 ranks": ([32], [], [20, 12], ["--zero", 3]),
    "zero1 on 2 ranks, then zero2 on 3 ranks": ([16, 16], ["--zero", 1], [8, 16, 8], ["--zero", 2]),
    # State shares by memory (update/zero/uneven.py) write the one format too.
    "zero3 by memory 1:3, then zero3 even on 3 ranks":
        ([(24, 0.001), (8, 0.003)], ["--zero", 3], [8, 16, 8], ["--zero", 3]),
    "zero2 even on 2 ranks, then zero1 by memory 1:1:6":
        ([16, 16], ["--zero", 2], [(8, 0.001), (16, 0.001), (8, 0.006)], ["--zero", 1]),
    "zero1 by memory 1:3, then 1 plain process, then zero2 by memory 3:1": None,
}


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_under_another_mode_and_world_equals_an_uninterrupted_run(tmp_path, name):
    straight = straight_run(tmp_path, 6)
    if RESUMES[name] is None:      # three legs: by memory, alone, by memory the other way
        train(tmp_path / "resumed", 2, [(24, 0.001), (8, 0.003)], "--zero", 1)
        train(tmp_path / "resumed", 4, [32])
        resumed = train(tmp_path / "resumed", 6, [(20, 0.003), (12, 0.001)], "--zero", 2)
    else:
        first, first_flags, second, second_flags = RESUMES[name]
        train(tmp_path / "resumed", 3, first, *first_flags)
        resumed = train(tmp_path / "resumed", 6, second, *second_flags)
    assert resumed["controller"]["num_updates"] == 6
    assert max_diff(straight["controller"]["model"], resumed["controller"]["model"]) < EXACT
    # The checkpoint keeps the plain format: full weights and an index-keyed optimizer.
    assert sorted(resumed["controller"]["optimizer"]["state"]) == [0, 1, 2, 3]
    assert resumed["controller"]["model"]["0.weight"].shape == (16, 8)


# SGD without momentum keeps no optimizer state at all (the plain update also
# shows a wrong gradient scale, which Adam would hide).
SGD = EXACT_SGD
# Saved from sharded modes, into another sharded mode and into one process
# (an empty state loaded into each mode from one process:
# test_an_optimizer_saved_before_its_first_step_resumes_in_every_mode).
STATELESS_RESUMES = {
    "zero1 on 2 ranks, then zero3 on 2 ranks": ([16, 16], ["--zero", 1], [20, 12], ["--zero", 3]),
    "zero3 on 2 ranks, then zero1 on 1 process": ([24, 8], ["--zero", 3], [32], ["--zero", 1]),
}


@pytest.mark.parametrize("name", sorted(STATELESS_RESUMES))
def test_resume_of_a_stateless_optimizer_under_another_mode_and_world(tmp_path, name):
    first, first_flags, second, second_flags = STATELESS_RESUMES[name]
    straight = straight_run(tmp_path, 6, SGD)
    train(tmp_path / "resumed", 3, first, *first_flags, base=SGD)
    resumed = train(tmp_path / "resumed", 6, second, *second_flags, base=SGD)
    assert resumed["controller"]["optimizer"]["state"] == {}
    # float64 toy model: only the order of summation differs.
    assert max_diff(straight["controller"]["model"], resumed["controller"]["model"]) < 1e-10


def _load_fresh_state(rank, world, init, zero, state, out):
    """Rank ``rank``: load ``state`` (an optimizer that never stepped) under
    --zero ``zero``, then three updates of a 3 + 1 split."""
    import torch.distributed as dist
    from hetseq.distributed.spawn import DistContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    controller, task = build_controller([*ADADELTA, "--zero", zero], ctx)
    controller.load_state_dict(state)
    data = task.load_dataset("train")
    for step in range(3):
        rows = list(range(4 * step, 4 * step + 3)) if rank == 0 else [4 * step + 3]
        batch = keyed(data, rows)
        controller.train_step([batch], batch)
    weights = controller.sharding.model_state(controller.model)
    if rank == 0:
        out.put(portable(weights))
    del controller
    leave_process_group()


ADADELTA = [*TOY, "--optimizer", "adadelta", "--lr", "1.0", "--lr-scheduler", "fixed",
            "--clip-norm", "0"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_an_optimizer_saved_before_its_first_step_resumes_in_every_mode(tmp_path, zero):
    """Adadelta holds no state until it steps: a checkpoint made then loads
    under --zero 1/2/3 on 2 ranks and trains as one process would."""
    from hetseq.distributed.spawn import DistContext
    alone, task = build_controller(ADADELTA, DistContext(0, 1, 0, torch.device("cpu")))
    state = unpack(portable(alone.state_dict()))     # a copy, as a checkpoint file holds
    assert state["optimizer"]["state"] == {}
    data = task.load_dataset("train")
    for step in range(3):
        batch = keyed(data, list(range(4 * step, 4 * step + 4)))
        alone.train_step([batch], batch)
    queue = rank_queue()
    start_ranks(_load_fresh_state, 2, 2, f"file://{tmp_path / 'meet'}", zero, state, queue)
    assert max_diff(alone.model.state_dict(), unpack(queue.get())) < 1e-10


@pytest.mark.parametrize("zero", ["1", "3"])
def test_resume_in_the_same_mode_is_bit_exact(tmp_path, zero):
    """6 updates in one go; 3, then 3 more resumed from its checkpoint: the
    same bits (the three jobs run in turn in one process group)."""
    def job(folder, updates):
        return [[*BASE, "--max-update", updates, "--save-dir", tmp_path / folder, "--zero", zero,
                 "--max-sentences", batch, "--distributed-world-size", 2] for batch in (24, 8)]
    run_jobs(2, [("straight", job("straight", 6)), ("first part", job("resumed", 3)),
                 ("resumed", job("resumed", 6))], tmp_path / "group")
    straight, resumed = (torch.load(tmp_path / folder / "checkpoint_last.pt", weights_only=True)
                         for folder in ("straight", "resumed"))
    assert resumed["controller"]["num_updates"] == 6
    for key, value in straight["controller"]["model"].items():
        assert torch.equal(value, resumed["controller"]["model"][key]), key
    for index, state in straight["controller"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed["controller"]["optimizer"]["state"][index][key])


def test_micro_batch_caps_differing_between_ranks_are_padded_under_zero3(tmp_path):
    """Rank 0 splits its 24 into 3 micro-batches, rank 1 its 8 into 1: under
    FSDP every forward communicates, so rank 1 pads with zero-weight ones.
    Validation (uneven too) runs the same way; the update still matches."""
    straight = straight_run(tmp_path, 5)
    common = [*BASE, "--max-update", 5, "--save-dir", tmp_path / "capped", "--zero", 3]
    common.remove("--disable-validation")
    assert_ok(run_job(common, [["--max-sentences", 24, "--micro-batch-cap", 8,
                                "--max-sentences-valid", 7],
                               ["--max-sentences", 8, "--max-sentences-valid", 2]]))
    capped = torch.load(tmp_path / "capped" / "checkpoint_last.pt", weights_only=True)
    assert max_diff(straight["controller"]["model"], capped["controller"]["model"]) < EXACT


def test_checkpoint_of_a_sharded_run_holds_the_full_weights(tmp_path):
    """checkpoint_last.pt of a --zero 3 run holds full tensors (the export
    under --zero 3: tests/system/test_bert.py)."""
    state = train(tmp_path / "run", 2, [16, 8], "--zero", 3)
    for name, shape in (("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (1, 16))):
        assert tuple(state["controller"]["model"][name].shape) == shape


def _full_state_both_ways(rank, world, init, out):
    """Rank ``rank`` of 3 under --zero 3 after two AdamW updates: the full
    model and optimizer state as HetSeq gathers it over gloo (host tensors)
    and as torch's own full-state gather does."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    from hetseq.distributed.spawn import DistContext
    from hetseq.update.zero.full_state import full_options as _full, gather as _full_state
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    # Width 17 over 3 ranks: rows split 6 + 6 + 5; the (1, 17) output weight
    # has one row, held by rank 0 alone.
    controller, task = build_controller([*BASE, "--toy-width", 17, "--zero", 3], ctx)
    data = task.load_dataset("train")
    for step in range(2):
        batch = keyed(data, [4 * step + rank])
        controller.train_step([batch], batch)
    model, optimizer = controller.model, controller.optimizer
    ours = (_full_state(get_model_state_dict, model),
            _full_state(get_optimizer_state_dict, model, optimizer))
    theirs = (get_model_state_dict(model, options=_full(cpu_offload=True)),
              get_optimizer_state_dict(model, optimizer, options=_full(cpu_offload=True)))
    if rank == 0:
        out.put(portable((ours, theirs)))
    else:
        out.put(portable(ours))
    del controller
    leave_process_group()


def _same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def test_the_full_state_gathered_over_gloo_equals_torchs_own_gather(tmp_path):
    """Over gloo HetSeq gathers a --zero 3 state itself (full_state.gather:
    torch's gather crashed with a GPU and a CPU rank); on uneven shards it
    must give exactly what torch's gives, on rank 0 only."""
    queue = rank_queue()
    start_ranks(_full_state_both_ways, 3, 3, f"file://{tmp_path / 'meet'}", queue)
    results = [unpack(queue.get()) for _ in range(3)]
    (ours, theirs), = [r for r in results if isinstance(r, tuple) and len(r) == 2
                       and isinstance(r[0], tuple)]
    assert tuple(ours[0]["0.weight"].shape) == (17, 8) and ours[1]["state"]
    assert _same(ours, theirs)
    assert sum(r == ({}, {}) for r in results) == 2          # the other ranks: nothing


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
    common = [*BASE, "--max-update", 2, "--save-dir", tmp_path / "run", "--zero", 3,
              "--max-sentences", 8]
    results = run_job(common, [[], []])
    assert results[0][0] == 2, results[0][1][-2000:]
    # Counted as in every mode, before FSDP's own check (hetseq/checkpoints/state.py's ModelState).
    assert "1 tensor(s) of another shape, e.g. 0.weight: [4, 8] saved, [16, 8] here" \
        in results[0][1]


# ---- memory: what each mode holds, and what is left for activations ----

WIDE = ["--toy-width", 65536]     # 655k float64 parameters: 5.2 MB, 21 MB with grads and Adam


def _state_bytes(rank, world, init, out):
    """Rank ``rank``: the state its Controller holds under each mode, estimated
    before the first step (no optimizer state yet) and counted after it."""
    import torch.distributed as dist
    from hetseq.distributed.spawn import DistContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    held = {}
    for zero in ("0", "1", "2", "3"):
        controller, task = build_controller([*BASE, *WIDE, "--zero", zero], ctx)
        before = controller.state_bytes()
        batch = task.load_dataset("train")[list(range(4))]
        controller.train_step([batch], batch)
        held[zero] = (before, controller.state_bytes())
        del controller
    out.put((rank, held))
    leave_process_group()


def test_each_mode_holds_exactly_its_share_of_the_model_state(tmp_path):
    """Counted from the tensors each rank holds (float64: 8 bytes), after one
    AdamW update: parameters, gradients and two moments. The estimate made
    before the first step (capacity planning uses it) is exact too."""
    shapes = {"0.weight": (65536, 8), "0.bias": (65536,), "2.weight": (1, 65536), "2.bias": (1,)}
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    params = sum(sizes.values())
    # --zero 1: ZeroRedundancyOptimizer gives each parameter, largest first, to
    # the rank holding the least so far: 0.weight to rank 0, the rest to rank 1.
    owned = [sizes["0.weight"], params - sizes["0.weight"]]
    # --zero 2/3: FSDP splits each parameter along a dimension the world
    # divides (2.weight along its 65536 columns); 2.bias (one number) stays whole
    # on rank 0.
    shards = [params // 2 + 1, params // 2]
    expected = {"0": [4 * 8 * params] * 2,
                "1": [8 * (2 * params + 2 * owned[rank]) for rank in (0, 1)],
                "2": [4 * 8 * shard for shard in shards],
                "3": [4 * 8 * shard for shard in shards]}
    queue = rank_queue()
    start_ranks(_state_bytes, 2, 2, f"file://{tmp_path / 'meet'}", queue)
    for _ in range(2):
        rank, held = queue.get()
        for zero, (estimated, counted) in held.items():
            assert estimated == counted == expected[zero][rank], (zero, rank, held)


def test_a_small_memory_budget_fits_under_zero3_and_is_named_under_zero0(tmp_path):
    """15 MB per rank: the 21 MB of state under --zero 0 leave nothing for
    activations (a clear error); under --zero 3 each rank holds half of it
    and gathers one of its 40 blocks at a time (a model of one unit would
    gather all of it: state_shares.StateSize counts that), so it trains."""
    def run(zero):
        return run_job([*BASE, "--toy-width", 128, "--toy-blocks", 40, "--max-update", 2,
                        "--no-save", "--capacity", "auto", "--global-batch-size", 32,
                        "--max-memory-gb", 0.015, "--zero", zero], [[], []])
    refused = run(0)
    assert refused[0][0] == 2 and "no memory left for activations" in refused[0][1], \
        refused[0][1][-2000:]
    fits = run(3)
    assert_ok(fits)
    held = [float(mb) for mb in re.findall(r"state ([\d.]+) MB \(50%\)", fits[0][1])]
    assert len(held) == 2 and all(mb < 15 for mb in held), fits[0][1][-2000:]


def test_one_process_has_nothing_to_shard(tmp_path):
    result = run_train(*BASE, "--max-update", 2, "--max-sentences", 8, "--save-dir", tmp_path,
                       "--zero", 3, "--distributed-world-size", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "one process: nothing to shard, --zero 3 trains as --zero 0" in result.stderr
