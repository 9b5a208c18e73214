"""Capacity planning: the plan math, rebalancing, and parity while the split changes."""

import re

import pytest

from hetseq.capacity import Plan, Rebalancer, proportional
from hetseq.errors import UserError

from conftest import assert_ok, final_params, free_port, max_diff, run_nodes
from test_parity import COMMON, reference


def test_proportional_split_sums_exactly():
    plan = proportional(97, [3.0, 1.0, 1.0], [0, 0, 0])
    assert plan.batch_sizes == [58, 20, 19] and plan.global_batch == 97   # 58.2, 19.4, 19.4
    assert proportional(32, [2.5, 1.0], [0, 0]).batch_sizes == [23, 9]


def test_memory_caps_set_the_micro_batches():
    plan = proportional(64, [3.0, 1.0], [10, 0])
    assert plan.batch_sizes == [48, 16]
    assert plan.micro_batches(0) == 5 and plan.micro_batches(1) == 1


@pytest.mark.parametrize("rates", [[5.0, 0.0], [5.0, float("nan")], [-1.0, 2.0]])
def test_zero_or_failed_speed_is_a_clear_error(rates):
    with pytest.raises(UserError, match="rank [01] has capacity"):
        proportional(32, rates, [0, 0])


def test_batch_smaller_than_world_is_an_error():
    with pytest.raises(UserError, match="global batch 2 is smaller than the 3 ranks"):
        proportional(2, [1.0, 1.0, 1.0], [0, 0, 0])


def test_rebalancer_ignores_noise_and_follows_a_real_drift():
    balancer = Rebalancer(Plan([16, 16], [0, 0], [100.0, 100.0]), patience=3, cooldown=4)
    for noise in (1.03, 0.97, 1.05, 0.98, 1.04):             # a few percent: no change
        assert balancer.observe([0.16 * noise, 0.16], [16, 16]) is None
    changes = [balancer.observe([0.16, 0.32], [16, 16]) for _ in range(8)]   # rank 1 halves
    new = [c for c in changes if c is not None]
    assert len(new) >= 1 and changes.index(new[0]) <= 4
    assert new[-1].batch_sizes[0] > new[-1].batch_sizes[1] and new[-1].global_batch == 32


def test_rebalancer_closes_a_gap_of_a_few_percent_then_holds():
    # 64/36 at rates 2:1 is 7.5% slower than the best whole-sample split 67/33.
    balancer = Rebalancer(Plan([64, 36], [0, 0], [200.0, 100.0]), patience=3, cooldown=4)
    changes = [balancer.observe([64 / 200, 36 / 100], [64, 36]) for _ in range(3)]
    assert changes[:2] == [None, None] and changes[2].batch_sizes == [67, 33]
    # Now the best split: rounding alone never moves it again.
    assert all(balancer.observe([67 / 200, 33 / 100], [67, 33]) is None for _ in range(20))


def test_plan_state_round_trip():
    plan = proportional(32, [2.0, 1.0], [8, 0], [20.0, 10.0])
    assert Plan.from_state_dict(plan.state_dict()) == plan


def auto_nodes(tmp, name, ranks, *extra):
    out, url = tmp / name, f"tcp://127.0.0.1:{free_port()}"
    results = run_nodes([[*COMMON, "--capacity", "auto", "--global-batch-size", 32,
                          "--save-dir", out, "--distributed-world-size", ranks,
                          "--distributed-rank", r, "--distributed-gpus", 1,
                          "--distributed-init-method", url, *extra] for r in range(ranks)])
    assert_ok(results)
    return final_params(out), results[0][1]


def plan_batches(log, rank):
    return [int(b) for b in re.findall(rf"rank {rank} cpu[^\n]*batch (\d+) in", log)]


@pytest.mark.parametrize("zero", ["0", "3"])
def test_slowed_rank_gets_a_smaller_share_after_profiling(tmp, zero):
    # Under --zero 3 every forward waits for the slowest rank: the probe counts
    # this rank's own compute, not the time it waited in FSDP's collectives.
    _, log = auto_nodes(tmp, "slow", 2, "--toy-slow-rank", 1, "--toy-slow-ms", 3,
                        "--max-update", 2, "--no-rebalance", "--zero", zero)
    assert plan_batches(log, 1)[0] < 12 < 20 < plan_batches(log, 0)[0], log[-2000:]


@pytest.mark.parametrize("ranks, extra", [(2, []), (3, ["--micro-batch-cap", 5]),
                                          (2, ["--zero", 3])])
def test_parity_holds_while_the_split_changes(tmp, ranks, extra):
    ref = reference(tmp, "--max-update", 16)
    # Rank 1 turns slow after a few updates (start-up profiling makes 6 calls):
    # the plan must change mid-run, and the result must not.
    params, log = auto_nodes(tmp, "auto", ranks, "--toy-slow-rank", 1, "--toy-slow-ms", 4,
                             "--toy-slow-after", 12, "--max-update", 16, *extra)
    assert "capacity plan changed" in log, log[-3000:]
    assert max_diff(ref, params) < 1e-5


@pytest.mark.parametrize("per_rank", [[["--capacity", "3,1"]] * 2,
                                      [["--capacity-weight", 3], ["--capacity-weight", 1]]])
def test_weights_split_the_global_batch(tmp, per_rank):
    out, url = tmp / "weights", f"tcp://127.0.0.1:{free_port()}"
    results = run_nodes([[*COMMON, "--global-batch-size", 32, "--save-dir", out,
                          "--distributed-world-size", 2, "--distributed-rank", r,
                          "--distributed-gpus", 1, "--distributed-init-method", url, *flags]
                         for r, flags in enumerate(per_rank)])
    assert_ok(results)
    assert plan_batches(results[0][1], 0) == [24] and plan_batches(results[0][1], 1) == [8]
    assert max_diff(reference(tmp), final_params(out)) < 1e-5


def test_half_the_memory_gives_half_the_micro_batch_and_the_same_update(tmp):
    """--capacity auto on a CPU measures a sample's activations (what autograd
    saves) and divides each rank's memory left after the model state by it.
    Rank 1 has half the activation memory of rank 0: its micro-batch cap is
    about half, accumulation makes up its share, and the update is unchanged."""
    width = ["--toy-width", 65536, "--lr", 0.001, "--max-update", 3]
    state = 2 * 8 * (10 * 65536 + 1)          # float64 params + grads (SGD keeps no state)
    budgets = [(state + 8 * 2**20) / 2**30, (state + 4 * 2**20) / 2**30]
    out, url = tmp / "memory", f"tcp://127.0.0.1:{free_port()}"
    results = run_nodes([[*COMMON, *width, "--capacity", "auto", "--global-batch-size", 32,
                          "--save-dir", out, "--distributed-world-size", 2,
                          "--distributed-rank", r, "--distributed-gpus", 1,
                          "--distributed-init-method", url, "--max-memory-gb", budgets[r]]
                         for r in (0, 1)])
    assert_ok(results)
    caps = [int(c) for c in re.findall(r"memory cap (\d+), batch", results[0][1])]
    micro = [int(m) for m in re.findall(r"in (\d+) micro-batch", results[0][1])]
    assert len(caps) == 2 and 0.4 <= caps[1] / caps[0] <= 0.6, results[0][1][-2000:]
    assert micro[1] > 1, results[0][1][-2000:]     # rank 1 accumulates its share
    assert max_diff(reference(tmp, *width), final_params(out)) < 1e-5
