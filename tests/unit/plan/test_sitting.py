"""A rank that cannot pay for its place sits out (plan/links.py,
update/members.py): no samples, no gradient exchange; the update stays one
process's, and the rank comes back when a re-plan finds it pays."""


import pytest

from hetseq.plan.capacity import Plan, fastest_split
from hetseq.plan.links import Links, best_plan, who_pays, why_sitting
from hetseq.plan.rebalance import Rebalancer


MS, GBIT, MBIT10 = 1e-3, 8 / 1e9, 8 / 1e7      # a millisecond; seconds per byte at 1 Gbit/s, 10 Mbit/s


def links(*fits, gradient=1_000_000):
    """Links of ranks 1.. to rank 0: (latency, seconds per byte) each."""
    return Links(((0.0, 0.0), *fits), gradient)


def test_the_exchange_is_a_ring_paced_by_the_slowest_link():
    three = links((1 * MS, GBIT), (2 * MS, 10 * GBIT), gradient=3_000_000)
    # n = 3: 2 (n-1) / n = 4/3 of the gradient through each link, 4 messages.
    assert three.seconds([0, 1, 2]) == pytest.approx(4 * 2 * MS + 4 / 3 * 3e6 * 10 * GBIT)
    assert three.seconds([0, 1]) == pytest.approx(2 * 1 * MS + 3e6 * GBIT)
    assert three.seconds([0]) == 0.0


@pytest.mark.parametrize("rates, link, sitting", [
    ([2000.0, 1.0], (MS, GBIT / 10), [1]),          # 2000x slower: its 1/2001 is not worth 1 ms
    ([1000.0, 100.0], (0.1 * MS, GBIT / 10), []),   # 10x slower, a fast link: 9% more samples/s
    ([1000.0, 100.0], (MS, MBIT10), [1]),           # the same behind 10 Mbit/s: 0.8 s per update
    ([1000.0, 1000.0], (MS, GBIT), []),             # two equal ranks both train
])
def test_the_plan_leaves_out_a_rank_that_costs_more_than_it_adds(rates, link, sitting):
    choice = best_plan(128, rates, [0, 0], links(link), can_sit=True)
    assert choice.plan.sitting == sitting
    assert choice.plan.batch_sizes == ([128, 0] if sitting else fastest_split(128, rates))
    assert choice.compute + choice.exchange <= sum(choice.everyone) + 1e-12


def test_local_steps_amortise_a_slow_link_and_a_mode_that_cannot_sit_keeps_everyone():
    slow = links((MS, MBIT10))
    assert best_plan(128, [1000.0, 100.0], [0, 0], slow, True, per_update=32).plan.sitting == [1]
    # One exchange per 128 updates: 6 ms of each, less than its 11 ms of compute saved.
    amortised = best_plan(128, [1000.0, 100.0], [0, 0], slow, True, per_update=128)
    assert amortised.plan.sitting == [] and amortised.plan.batch_sizes == [117, 11]
    kept = best_plan(128, [2000.0, 1.0], [0, 0], slow, can_sit=False)
    assert kept.plan.sitting == [] and kept.plan.batch_sizes == [128, 0]


def test_with_local_steps_the_log_says_which_rank_pays_through_the_outer_exchange():
    """--local-steps keeps every rank in the (outer) exchange: the log says
    whether each pays for its place, once per round of H updates."""
    slow = links((MS, MBIT10))
    pays, = who_pays(128, [1000.0, 100.0], [0, 0], slow, ["cuda", "cpu"], per_update=128)
    assert pays.startswith("rank 1 cpu pays for its place: 100.0 samples/s would save 0.011 s"), \
        pays
    assert "(0.802 s per exchange of 128 updates)" in pays, pays
    costs, = who_pays(128, [1000.0, 100.0], [0, 0], slow, ["cuda", "cpu"], per_update=32)
    assert costs.startswith("rank 1 cpu does not pay for its place") and \
        costs.endswith("leave it out of the job or raise --local-steps"), costs


def test_the_log_line_gives_the_figures_of_the_decision():
    choice = best_plan(128, [1000.0, 100.0], [0, 0], links((MS, MBIT10)), True)
    line, = why_sitting(choice.plan, links((MS, MBIT10)), ["cuda", "cpu (hostB)"])
    # Alone 0.128 s; with it 117/11: 0.117 s; the exchange of 1 MB at 10 Mbit/s 0.802 s.
    assert line == ("rank 1 cpu (hostB) sits out: 100.0 samples/s would save 0.011 s of "
                    "0.128 s of compute per update; the exchange with it costs 0.802 s"), line


def test_a_fixed_plan_with_a_rank_never_measured_is_judged_without_it():
    """Weights 2000:1 give rank 1 no sample: its rate is never measured (0).
    The advisory rebalancer predicts with the ranks it knows (no division
    by that 0) and does not advise leaving out a rank it knows nothing of."""
    plan = Plan([128, 0], [0, 0], [0.0, 0.0])
    advisor = Rebalancer(plan, links((MS, GBIT)), can_sit=True, advisory=True)
    for _ in range(40):
        assert advisor.observe([128 / 2000, 0.0], [128, 0]) is None


def test_an_overhead_the_links_do_not_show_is_measured_and_the_rank_sits_out():
    """The links' model says the exchange costs 1 ms, but updates with rank
    1 take 40 ms beyond the slowest compute: measured, the job is faster
    without it (0.234 + 0.04 s against 0.256 s), so it sits out, and the
    overhead measured with it is kept: it does not come straight back."""
    cheap = links((0.5 * MS, 0.0))
    plan = best_plan(128, [500.0, 50.0], [0, 0], cheap, True).plan
    assert plan.batch_sizes == [117, 11] and plan.sitting == []
    balancer = Rebalancer(plan, cheap, can_sit=True)
    new = None
    for _ in range(20):
        new = new or balancer.observe([117 / 500, 11 / 50], [117, 11], [117 / 500 + 0.04, 0])
    assert new is not None and new.sitting == [1], new
    assert "ms a step measured beyond the exchange" in balancer.reason
    for _ in range(60):
        assert balancer.observe([128 / 500, 0.0], [128, 0], [128 / 500 + 0.008, 0]) is None


def test_a_rank_comes_back_when_the_members_slow_down():
    """The rank that sits out measures nothing: its level stays the last
    known. When rank 0 slows 4000x, the re-plan brings it back."""
    fast = links((MS, GBIT / 10))
    plan = best_plan(128, [2000.0, 1.0], [0, 0], fast, True).plan
    balancer = Rebalancer(plan, fast, can_sit=True)
    for _ in range(20):
        assert balancer.observe([128 / 2000, 0.0], [128, 0]) is None
    new = None
    for _ in range(10):
        new = new or balancer.observe([128 / 0.5, 0.0], [128, 0])
    assert new is not None and new.sitting == [] and new.batch_sizes == [43, 85], new
    assert "predicted" in balancer.reason


def test_the_sitting_plan_survives_a_checkpoint():
    plan = Plan([32, 0], [0, 0], [100.0, 1.0], [1])
    assert Plan.from_state_dict(plan.state_dict()) == plan
    old = {"batch_sizes": [32, 0], "micro_caps": [0, 0], "rates": [1.0, 1.0]}
    assert Plan.from_state_dict(old).sitting == []        # saved before plans had it


def test_a_saved_plan_sits_ranks_out_only_where_this_run_can():
    """Resuming a plan with a rank sitting out under a mode where none can
    (--zero 1-3, PowerSGD, --local-steps): it takes part without samples
    (else it would wait for rank 0 while rank 0 waits for it in the
    mode's collectives). A plan saying rank 0 sits out is not adopted."""
    import types
    from hetseq.plan.rebalance import Balance
    saved = Plan([32, 0], [0, 0], [100.0, 1.0], [1]).state_dict()
    for can_sit, sitting in ((True, [1]), (False, [])):
        shares = []
        iterator = types.SimpleNamespace(set_shares=lambda s, m: shares.append(s))
        ctx = types.SimpleNamespace(is_main=False)
        balance = Balance(Plan([16, 16], [0, 0], [100.0, 100.0]), ["a", "b"], iterator, ctx,
                          False, can_sit=can_sit)
        balance.load_state_dict(saved)
        assert (balance.plan.batch_sizes, balance.plan.sitting) == ([32, 0], sitting)
    wrong = Balance(Plan([16, 16], [0, 0], [1.0, 1.0]), ["a", "b"], iterator,
                    types.SimpleNamespace(is_main=False, rank=0), False, can_sit=True)
    wrong.iterator = types.SimpleNamespace(epoch=1, samples_in_epoch=0)
    wrong.load_state_dict(Plan([0, 32], [0, 0], [1.0, 1.0], [0]).state_dict())
    assert wrong.plan.batch_sizes == [16, 16] and wrong.plan.sitting == []


@pytest.mark.parametrize("message", [[1.0, float("nan"), 0.0], [2.0, 3.0, 0.0],
                                     [1.0, 1e300, 0.0], [1.0, 3.0, 0.5]])
def test_an_outcome_from_rank_0_is_checked_before_it_is_used(monkeypatch, message):
    import types
    import torch
    from hetseq.base.errors import PeerLost
    from hetseq.update import members
    ctx = types.SimpleNamespace(world_size=2, rank=1, backend="gloo", device=torch.device("cpu"))
    monkeypatch.setattr(members.dist, "recv", lambda tensor, src: tensor.copy_(
        torch.tensor(message, dtype=torch.float64)))
    with pytest.raises(PeerLost, match="as an update's outcome"):
        members.Members(ctx).receive_outcome()
