"""The update must equal large-batch single-process training, whatever the split."""

import pytest

from conftest import TOY, assert_ok, final_params, free_port, max_diff, run_nodes

COMMON = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--clip-norm",
          "0", "--max-update", "7", "--disable-validation", "--toy-size", "100"]


def reference(tmp, *extra):
    """One process with the whole global batch of 32."""
    out = tmp / "reference"
    assert_ok(run_nodes([[*COMMON, *extra, "--max-sentences", 32, "--save-dir", out]]))
    return final_params(out)


def nodes(tmp, name, layout, *extra):
    """One command per node; ``layout`` lists (processes, batch per process)."""
    out, world = tmp / name, sum(procs for procs, _ in layout)
    url, first, commands = f"tcp://127.0.0.1:{free_port()}", 0, []
    for procs, batch in layout:
        commands.append([*COMMON, *extra, "--max-sentences", batch, "--save-dir", out,
                         "--distributed-world-size", world, "--distributed-rank", first,
                         "--distributed-gpus", procs, "--distributed-init-method", url])
        first += procs
    assert_ok(run_nodes(commands))
    return final_params(out)


def test_two_ranks_24_plus_8_match_one_process_32(tmp):
    diff = max_diff(reference(tmp), nodes(tmp, "split", [(1, 24), (1, 8)]))
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


def test_stats_ride_in_the_gradient_all_reduce(monkeypatch):
    """The stats vector travels inside DDP's first gradient bucket: a training
    step makes exactly one collective besides the buckets (none of its own)."""
    import torch
    from hetseq.controller import SumHook
    from hetseq.stats import StatsExchange
    hook = SumHook()
    sent = []
    monkeypatch.setattr(hook, "carry", lambda vec: sent.append(vec) or SumHook.carry(hook, vec))

    class Ctx:
        device, world_size, rank, distributed = torch.device("cpu"), 2, 0, True
    stats = StatsExchange(Ctx(), carrier=hook)
    stats.add(torch.tensor(3.0), 5, {"correct": 2})
    stats.launch(before_backward=True)
    assert stats._carried and len(sent) == 1 and stats._work is None
    big = StatsExchange(Ctx(), carrier=hook)
    big.add(torch.tensor(1.0), 2**24, {})
    big.totals["sample_size"] = 2**24        # too large to stay exact in float32
    assert not big._counts_fit_float32()
