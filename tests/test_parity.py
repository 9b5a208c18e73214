"""The update must equal large-batch single-process training, whatever the split."""

import pytest

from conftest import (TOY, assert_ok, build_controller, final_params, leave_process_group,
                      max_diff, run_job, run_nodes)

COMMON = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--clip-norm",
          "0", "--max-update", "7", "--disable-validation", "--toy-size", "100"]


_REFERENCES = {}


def reference(tmp, *extra):
    """One process with the whole global batch of 32 (run once per set of flags
    in a test session: it is deterministic, and many tests compare with it)."""
    key = tuple(map(str, extra))
    if key not in _REFERENCES:
        out = tmp / "reference"
        assert_ok(run_nodes([[*COMMON, *extra, "--max-sentences", 32, "--save-dir", out]]))
        _REFERENCES[key] = final_params(out)
    return _REFERENCES[key]


def nodes(tmp, name, layout, *extra):
    """One command per node; ``layout`` lists (processes, batch per process)."""
    out = tmp / name
    assert_ok(run_job([*COMMON, *extra, "--save-dir", out],
                      [(procs, ["--max-sentences", batch]) for procs, batch in layout]))
    return final_params(out)


# --find-unused-parameters: DDP's search for unreached parameters each backward.
@pytest.mark.parametrize("extra", [[], ["--find-unused-parameters"]])
def test_two_ranks_24_plus_8_match_one_process_32(tmp, extra):
    diff = max_diff(reference(tmp), nodes(tmp, "split", [(1, 24), (1, 8)], *extra))
    assert diff < 1e-5


def test_three_ranks_20_8_4_with_accumulation_match(tmp):
    # 100 samples in batches of 32: the last global batch has 4 samples and
    # splits 3 + 1 + 0, so rank 2 takes part with a zero-weight batch.
    ref = reference(tmp, "--update-freq", 2)
    diff = max_diff(ref, nodes(tmp, "split", [(1, 20), (1, 8), (1, 4)], "--update-freq", 2))
    assert diff < 1e-5


def test_task_overriding_train_step_without_stats_matches(tmp):
    # backward(loss) alone: the stats travel after backward instead of during it.
    ref = reference(tmp, "--update-freq", 2)
    diff = max_diff(ref, nodes(tmp, "plain", [(1, 24), (1, 8)], "--update-freq", 2,
                               "--toy-plain-backward"))
    assert diff < 1e-5


def test_nodes_with_different_process_counts_match(tmp):
    # A node spawning 2 processes (8 each) and a node with 1 process (16).
    diff = max_diff(reference(tmp), nodes(tmp, "split", [(2, 8), (1, 16)]))
    assert diff < 1e-5


def test_plain_mean_averaging_does_not_match(tmp):
    """Equal-weight averaging of per-rank means (plain DDP) is wrong when batches
    differ: the same run with the toy task's mean loss must NOT match."""
    ref = reference(tmp)
    same_math_one_rank = reference(tmp / "mean", "--toy-mean-loss")
    assert max_diff(ref, same_math_one_rank) < 1e-5   # one rank: mean == global mean
    wrong = nodes(tmp, "mean", [(1, 24), (1, 8)], "--toy-mean-loss")
    assert max_diff(ref, wrong) > 1e-3


@pytest.mark.parametrize("layout", [[(1, 16), (1, 16)]])
def test_equal_split_matches_too(tmp, layout):
    assert max_diff(reference(tmp), nodes(tmp, "equal", layout)) < 1e-5


def _count_collectives(rank, world, init, plain, out):
    """One rank: three updates of a 3 + 1 split, counting Python-level collectives."""
    import torch
    import torch.distributed as dist
    from hetseq.distributed import DistContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    controller, task = build_controller([*COMMON, *(["--toy-plain-backward"] if plain else [])],
                                        DistContext(rank, world, rank, torch.device("cpu"), "gloo"))
    data = task.load_dataset("train")
    calls = []

    def record(name, real):
        def call(*a, **k):
            # Whether the collective starts before this update's backward has
            # produced any gradient.
            before = all(p.grad is None for p in controller.model.parameters())
            calls.append((name, "before backward" if before else "after backward"))
            return real(*a, **k)
        return call
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object"):
        setattr(dist, name, record(name, getattr(dist, name)))
    sizes = []
    for step in range(3):
        rows = list(range(4 * step, 4 * step + 4))[:3] if rank == 0 else [4 * step + 3]
        batch = {"x": data.x[rows], "y": data.y[rows]}
        sizes.append(controller.train_step([batch], batch).sample_size)
    out.put((rank, calls, sizes))
    del controller
    leave_process_group()


@pytest.mark.parametrize("plain", [False, True])
def test_stats_travel_in_one_all_reduce_started_before_backward(tmp, plain):
    """An update makes exactly one collective of its own: the stats all-reduce.
    With the stats passed to backward it starts before backward (and runs
    during it); a task calling backward(loss) alone starts it afterwards."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init = f"file://{tmp / 'rendezvous'}"
    mp.start_processes(_count_collectives, args=(2, init, plain, out), nprocs=2, start_method="spawn")
    when = "after backward" if plain else "before backward"
    for _ in range(2):
        rank, calls, sizes = out.get()
        assert sizes == [4, 4, 4]     # summed counts arrive exactly
        assert calls == [("all_reduce", when)] * 3, (rank, calls)


# ---- memory sharding (--zero) keeps the same mathematics ----

ADAM = ["--optimizer", "adamw", "--lr", "0.05", "--weight-decay", "0.01"]
ZERO = {"zero1": ["--zero", 1], "zero2": ["--zero", 2], "zero3": ["--zero", 3],
        "zero3-offload": ["--zero", 3, "--cpu-offload"]}


@pytest.mark.parametrize("mode", sorted(ZERO))
def test_zero_two_ranks_uneven_match_one_process(tmp, mode):
    """AdamW (its state is what --zero 1 shards), 24 + 8 samples."""
    ref = reference(tmp, *ADAM)
    assert max_diff(ref, nodes(tmp, mode, [(1, 24), (1, 8)], *ADAM, *ZERO[mode])) < 1e-5


@pytest.mark.parametrize("mode", sorted(ZERO))
def test_zero_three_ranks_uneven_with_clipping_and_accumulation_match(tmp, mode):
    """20 + 8 + 4 with --update-freq 2 (rank 2 pads the last global batch) and
    a clip norm that binds: the norm is that of the whole sharded gradient."""
    extra = [*ADAM, "--update-freq", 2, "--clip-norm", 0.3]
    ref = reference(tmp, *extra)
    diff = max_diff(ref, nodes(tmp, mode, [(1, 20), (1, 8), (1, 4)], *extra, *ZERO[mode]))
    assert diff < 1e-5
