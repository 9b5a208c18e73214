"""State shares (hetseq/plan/state_shares.py): each rank's share of the
sharded model state by its memory, the --state-shares auto rule, the
refusals before the first update, and the plan that names each rank's state
(capacity.describe, startup.make_plan). One process, no process group: the
one collective is stood in for."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hetseq.base.errors import UserError
from hetseq.plan import capacity, startup, state_shares
from hetseq.plan.capacity import Plan, ShareConfig
from hetseq.plan.state_shares import GB, StateShares, StateSize, agree, choose, state_size

CPU = torch.device("cpu")


def sharding(zero=3, shares="auto", cpu_offload=False):
    return SimpleNamespace(zero=zero, state_shares=shares, cpu_offload=cpu_offload)


def ctx(world=1, rank=0, device=CPU):
    return SimpleNamespace(rank=rank, world_size=world, distributed=world > 1, device=device,
                           is_main=rank == 0)


def gb(*values):
    return [v * GB for v in values]


@pytest.mark.parametrize("memories, whole, expected", [
    ((1, 3), 0, (0.25, 0.75)),
    ((1, 1, 6), 0, (0.125, 0.125, 0.75)),
    # Beyond the 1 GB every rank holds whole: 1 and 3 GB left, then 1, 1 and 6.
    ((2, 4), 1, (0.25, 0.75)),
    ((2, 2, 7), 1, (0.125, 0.125, 0.75)),
])
def test_memory_shares_split_what_is_left_beyond_the_whole_part(memories, whole, expected):
    shares = choose(sharding(shares="memory"), gb(*memories), StateSize(GB // 2, whole * GB))
    assert shares.kind == "memory"
    assert shares.fractions == pytest.approx(expected)
    assert sum(shares.fractions) == pytest.approx(1.0, abs=1e-12)
    assert shares.memories == tuple(gb(*memories))


def test_even_shares_are_one_over_the_world_size():
    shares = choose(sharding(shares="even"), gb(1, 3, 8), StateSize(GB, 0))
    assert shares.kind == "even" and shares.fractions == pytest.approx((1 / 3,) * 3)


@pytest.mark.parametrize("spread, kind", [(1.1, "even"), (1.0, "even"), (1.12, "memory"),
                                          (4.0, "memory")])
def test_auto_takes_memory_shares_only_past_a_tenth_apart(spread, kind):
    shares = choose(sharding(), gb(1.0, spread), StateSize(GB // 4, 0))
    assert shares.kind == kind
    assert (shares.fractions[0] < 0.5) == (kind == "memory")


@pytest.mark.parametrize("zero, world", [(0, 2), (3, 1)])
def test_nothing_split_is_even_whatever_the_flag(zero, world):
    """--zero 0 holds everything everywhere; one process has nothing to split."""
    shares = choose(sharding(zero, "memory"), gb(*[1, 3][:world]),
                    StateSize(0, GB // 2), distributed=world > 1)
    assert shares.kind == "even" and shares.fractions == pytest.approx((1 / world,) * world)


def test_even_shares_that_do_not_fit_name_the_rank_and_suggest_memory_shares():
    # 3 GB split: 1.5 GB each does not fit rank 0's 1 GB; 0.75 + 2.25 fit 1 + 3.
    with pytest.raises(UserError) as refused:
        choose(sharding(shares="even"), gb(1, 3), StateSize(3 * GB, 0))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("rank 0 has 1.0 GB") and "needs 1.5 GB" in message
    assert "--state-shares memory would fit (25%, 75%)" in message


def test_even_refusal_says_when_memory_shares_would_not_fit_either():
    with pytest.raises(UserError, match=r"rank 1 has 1.0 GB .* needs 2.5 GB .*"
                                        r"--state-shares memory would not fit either"):
        choose(sharding(shares="even"), gb(3, 1), StateSize(5 * GB, 0))


def test_even_refusal_under_zero_0_counts_the_whole_state():
    with pytest.raises(UserError, match=r"rank 1 has 1.0 GB .* needs 1.5 GB .*shard it"):
        choose(sharding(zero=0, shares="memory"), gb(2, 1), StateSize(0, 3 * GB // 2))


def test_memory_shares_refuse_when_the_ranks_together_are_too_small():
    # 1 + 3 GB beyond nothing whole, for 5 GB: both overflow by 5/4; the smaller is named.
    with pytest.raises(UserError) as refused:
        choose(sharding(), gb(3, 1), StateSize(5 * GB, 0))
    message = str(refused.value)
    assert message.startswith("rank 1 has 1.0 GB") and "needs 1.25 GB" in message
    assert "\n" not in message and "--max-memory-gb" in message


def test_memory_shares_refuse_a_rank_without_room_for_the_whole_part():
    # Together 9 GB beyond the whole part would do, but rank 2 cannot hold 2 GB whole.
    with pytest.raises(UserError, match=r"^rank 2 has 2.0 GB .* holds 2.0 GB whole"):
        choose(sharding(zero=2), gb(8, 5, 2), StateSize(GB, 2 * GB))


def test_estimated_memories_are_still_checked_and_say_how_to_give_them():
    with pytest.raises(UserError, match=r"\(estimated: give --max-memory-gb"):
        choose(sharding(), gb(3, 1), StateSize(5 * GB, 0), given=False)
    assert choose(sharding(), gb(1, 3), StateSize(GB, 0), given=False).kind == "memory"


def test_describe_gives_each_ranks_state_in_bytes():
    size = StateSize(4000, 100)
    assert state_shares.describe(StateShares((0.25, 0.75), (1, 3), "memory"), size) == \
        [1100, 3100]
    assert state_shares.describe(StateShares((0.5, 0.5), (1, 1), "even"), size) == [2100, 2100]


class Layers(nn.Module):
    """Two units (the ModuleList's) and the root's head: 80, 160 and 72 bytes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8)])
        self.head = nn.Linear(8, 2)
        self.frozen = nn.Parameter(torch.zeros(100), requires_grad=False)


@pytest.mark.parametrize("zero, offload, device, expected", [
    (0, False, "cpu", StateSize(0, 4 * 312)),
    (1, False, "cpu", StateSize(2 * 312, 2 * 312)),
    (2, False, "cpu", StateSize(4 * 312, 312)),
    (3, False, "cpu", StateSize(4 * 312, 2 * 160)),
    (3, True, "cpu", StateSize(4 * 312, 2 * 160)),
    (3, True, "cuda", StateSize(0, 2 * 160)),
])
def test_state_size_counts_what_each_mode_splits_and_holds_whole(zero, offload, device,
                                                                 expected):
    assert state_size(zero, offload, device, Layers(), slots=2) == expected


def test_state_size_with_an_optimizer_without_state():
    assert state_size(1, False, "cpu", Layers(), slots=0) == StateSize(0, 2 * 312)


def test_agree_gathers_the_memories_and_says_why(monkeypatch, caplog):
    import hetseq.distributed
    gathered = []

    def gather(obj, ctx):
        gathered.append(obj)
        return [{"memory": GB, "activation": 0, "given": True}, obj]
    monkeypatch.setattr(hetseq.distributed, "all_gather_object", gather)
    with caplog.at_level(logging.INFO, logger="hetseq.plan.state_shares"):
        shares = agree(sharding(), 3 * GB, StateSize(GB, 0), ctx(world=2), given=True)
    assert gathered == [{"memory": 3 * GB, "activation": 0, "given": True}]
    assert shares.kind == "memory" and shares.fractions == pytest.approx((0.25, 0.75))
    assert "state shares by memory (ranks' memories 1.0, 3.0 GB differ by more than 10%): " \
           "25%, 75%" in caplog.text


def test_agree_takes_each_ranks_activations_off_its_memory(monkeypatch, caplog):
    """After the plan: memory less activations at the micro-batch (the
    other rank: 2 GB less 1 GB of activations, this one 3.5 GB less 0.5)."""
    import hetseq.distributed
    monkeypatch.setattr(hetseq.distributed, "all_gather_object",
                        lambda obj, ctx: [{"memory": GB, "activation": GB, "given": True}, obj])
    with caplog.at_level(logging.INFO, logger="hetseq.plan.state_shares"):
        shares = agree(sharding(shares="memory"), 3.5 * GB, StateSize(GB, 0),
                       ctx(world=2), given=True, activation=0.5 * GB)
    assert shares.fractions == pytest.approx((0.25, 0.75))
    assert "ranks' memories 2.0, 3.5 GB less their activations at their micro-batches, " \
           "1.0, 0.5 GB): 25%, 75%" in caplog.text


def test_agree_alone_is_even_and_checks_the_fit():
    assert agree(sharding(), GB, StateSize(GB // 2, 0), ctx()).fractions == (1.0,)
    with pytest.raises(UserError, match="rank 0 has 1.0 GB"):
        agree(sharding(), GB, StateSize(GB, GB // 2), ctx())


def test_memory_bytes_is_the_flag_else_the_hosts_available_share(monkeypatch):
    node = ShareConfig(max_memory_gb=1.5)
    assert state_shares.memory_bytes(node, ctx(), 4) == 1.5 * GB
    monkeypatch.setattr(state_shares, "available_memory_bytes", lambda: 10 * GB)
    assert state_shares.memory_bytes(ShareConfig(), ctx(), 4) == pytest.approx(2 * GB)
    controller = SimpleNamespace(state_bytes=lambda on_device=False: GB // 2)
    # The activations' budget is what is left of that after the state.
    assert startup._memory_budget(ShareConfig(), ctx(), controller, 4) == \
        pytest.approx(1.5 * GB)


def test_the_plan_names_each_ranks_state_beside_its_batch():
    plan = Plan([24, 8], [0, 4], [3.0, 1.0])
    lines = capacity.describe(plan, ["gpu", "cpu"], [(12.3 * 2**20, 0.25), (3 * GB, 0.75)])
    assert lines.splitlines()[0].endswith("batch 24 in 1 micro-batch(es), state 12.3 MB (25%)")
    assert lines.splitlines()[1].endswith("in 2 micro-batch(es), state 3.0 GB (75%)")
    assert "state" not in capacity.describe(plan, ["gpu", "cpu"])
    assert [capacity.readable_bytes(n) for n in (512, 2048, 5 * 2**20)] == \
        ["512 B", "2.0 KB", "5.0 MB"]


class Counted:
    """A Controller as make_plan sees it: its own count of the state it holds."""

    def __init__(self, nbytes, offloaded=False):
        self.nbytes, self.offloaded = nbytes, offloaded

    def state_bytes(self, on_device=False):
        return 0 if on_device and self.offloaded else self.nbytes

    def can_sit_out(self):
        return False

    def gradient_bytes(self):
        return self.nbytes // 4


def _plan(controller, memory_gb):
    cfg = capacity.CapacityConfig(capacity="manual", global_batch_size=None)
    node = ShareConfig(max_sentences=8, max_memory_gb=memory_gb)
    return startup.make_plan(cfg, node, ctx(), controller, None, None)


def test_make_plan_returns_each_ranks_counted_state():
    plan, devices, links, state = _plan(Counted(GB // 4), 1.0)
    assert plan.batch_sizes == [8] and links is None and state == [GB // 4]
    # Offloaded to the host: nothing on the device, the state still counted.
    assert _plan(Counted(2 * GB, offloaded=True), 1.0)[3] == [2 * GB]


def test_make_plan_refuses_a_rank_whose_own_count_exceeds_its_memory():
    with pytest.raises(UserError) as refused:
        _plan(Counted(3 * GB // 2), 1.0)
    message = str(refused.value)
    assert message.startswith("rank 0 has 1.0 GB of memory and holds 1.5 GB of model state")
    assert "no memory left for activations" in message and "\n" not in message


def test_every_rank_refuses_alike_from_the_gathered_counts():
    peers = [{"memory": GB, "held": GB // 2}, {"memory": GB, "held": 2 * GB}]
    with pytest.raises(UserError, match="^rank 1 has 1.0 GB of memory and holds 2.0 GB"):
        startup._check_state(peers)
    startup._check_state(peers[:1])
