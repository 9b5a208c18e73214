"""Slow links: --local-steps (DiLoCo rounds), the outer exchange's codecs and
PowerSGD, against one process where the mathematics says they are exact.

The toy model is float64 and the inner optimizer SGD (linear in the
gradient, so a wrong weight or scale shows): EXACT as in test_parity.py.
"""


import pytest
import torch

from hetseq.app import cli
from hetseq.base.errors import UserError

from machinery.in_process import alone, max_diff
from machinery.settings import EXACT, TOY

from machinery.parity import COMMON
def test_overlap_alone_follows_the_local_trajectory():
    """One process, outer step theta_0 - D: whether a round is applied at once
    or one round late, the model after the run is the inner optimizer's own
    trajectory (a change applied twice or lost would show)."""
    plain = alone(*COMMON, "--max-sentences", 32)["model"]
    late = alone(*COMMON, "--local-steps", 3, "--outer-overlap",
                 "--max-sentences", 32)["model"]
    assert max_diff(plain, late) < EXACT


@pytest.mark.parametrize("flags, message", [
    (["--outer-lr", "0.5"], "add --local-steps"),
    (["--local-steps", "-1"], "expected H >= 1"),
    (["--local-steps", "8", "--zero", "2"], "use --zero 0, or --zero 1"),
    (["--local-steps", "8", "--grad-compression", "powersgd"], "use --outer-dtype"),
    (["--local-steps", "8", "--reduce-dtype", "bfloat16"], "use --outer-dtype"),
    (["--local-steps", "8", "--outer-momentum", "1"], "expected 0 <= mu < 1"),
    (["--grad-compression", "powersgd", "--zero", "3"], "use --zero 0 or 1"),
    (["--grad-compression", "powersgd", "--powersgd-start", "1"], "expected N >= 2"),
    (["--powersgd-rank", "2"], "add --grad-compression powersgd"),
])
def test_flags_that_make_no_sense_together_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        cli.parse([*TOY, *flags])


def test_an_elastic_snapshot_inside_a_round_goes_back_to_its_start():
    """--elastic with --local-steps: a round cut short by a lost member is
    trained again by the next generation, so a snapshot taken inside a round
    holds the model, the inner optimizer's state (SGD momentum here) and the
    update count of the round's start, and the outer step's state of the
    round before; one taken at a round's end holds that round."""
    import copy
    from hetseq.distributed.spawn import DistContext
    from hetseq.update.modes.local_steps import OPTIMIZERS, ROUNDS
    from machinery.in_process import build_controller, keyed
    flags = [*COMMON, "--local-steps", 3, "--momentum", 0.9, "--elastic",
             "--global-batch-size", 8, "--distributed-init-method", "tcp://127.0.0.1:1"]
    controller, task = build_controller(flags, DistContext(0, 1, 0, torch.device("cpu")))
    data = task.load_dataset("train")
    batches = [keyed(data, list(range(4 * i, 4 * i + 4))) for i in range(5)]
    results = [controller.train_step([b], b, boundary=False) for b in batches[:3]]
    assert results[:2] == [None, None] and results[2] is not None      # one round of 3
    at_round_end = copy.deepcopy(controller.state_dict(local=True))
    for batch in batches[3:]:                                           # 2 of the next 3
        assert controller.train_step([batch], batch, boundary=False) is None
    assert max_diff(at_round_end["model"], controller.model.state_dict()) > 1e-6
    snapshot = controller.state_dict(local=True)
    assert snapshot["num_updates"] == at_round_end["num_updates"] == 3
    assert max_diff(at_round_end["model"], snapshot["model"]) == 0
    momentum = [s["momentum_buffer"] for s in snapshot["optimizer"]["state"].values()]
    before = [s["momentum_buffer"] for s in at_round_end["optimizer"]["state"].values()]
    assert len(momentum) == 4 and all(torch.equal(a, b) for a, b in zip(momentum, before))
    assert ROUNDS in snapshot and OPTIMIZERS not in snapshot           # no other rank's


def test_an_overlapped_snapshot_goes_back_to_the_last_round_whose_exchange_arrived():
    """--elastic with --outer-overlap: round R's exchange is applied at the
    end of round R+1. A snapshot inside R+1 whose R arrived is the state of
    a run that settled at the end of R (R applied; inner optimizer and
    update count of R+1's start); when R's exchange failed, the state of a
    run that settled at the end of R-1 (two rounds of history)."""
    from concurrent.futures import Future
    from hetseq.distributed.spawn import DistContext
    from hetseq.update.modes.local_steps import ROUNDS
    from machinery.in_process import build_controller, keyed
    flags = [*COMMON, "--local-steps", 2, "--outer-overlap", "--outer-momentum", 0.5,
             "--momentum", 0.9, "--elastic", "--global-batch-size", 8,
             "--distributed-init-method", "tcp://127.0.0.1:1"]

    def trained(steps, settle_at=None):
        controller, task = build_controller(flags, DistContext(0, 1, 0, torch.device("cpu")))
        data = task.load_dataset("train")
        for i in range(steps):
            batch = keyed(data, list(range(4 * i, 4 * i + 4)))
            controller.train_step([batch], batch, boundary=i + 1 == settle_at)
        return controller

    def same(a, b):
        outer = [a[ROUNDS]["outer_optimizer"], b[ROUNDS]["outer_optimizer"]]
        momenta = [[s["momentum_buffer"] for s in o["state"].values()] for o in outer]
        inner = [[s["momentum_buffer"] for s in x["optimizer"]["state"].values()] for x in (a, b)]
        return (a["num_updates"] == b["num_updates"] and max_diff(a["model"], b["model"]) == 0
                and all(torch.equal(x, y) for x, y in zip(*momenta)) and len(momenta[0]) == 4
                and all(torch.equal(x, y) for x, y in zip(*inner)))

    arrived = trained(5).state_dict(local=True)          # inside round 3; round 2 arrived
    assert arrived["num_updates"] == 4
    assert same(arrived, trained(4, settle_at=4).state_dict(local=True))
    failed = trained(5)
    future = Future()
    future.set_exception(RuntimeError("Connection closed by peer"))
    failed.exchange.pending = future                     # round 2's exchange never completed
    lost = failed.state_dict(local=True)
    assert lost["num_updates"] == 2
    assert same(lost, trained(2, settle_at=2).state_dict(local=True))
    at_end = trained(4).state_dict(local=True)           # at round 2's end, round 3 not begun
    assert same(at_end, arrived)


def test_a_rank_stopping_on_its_own_error_lets_the_round_it_sent_complete(caplog):
    """--outer-overlap: round R's all-reduce runs while R+1 trains. A rank
    that stops on an error of its own (its data ends) must not exit before
    its half of R completes, or the members lose R too: Run.train waits for
    it (not applied) and the error goes on. One that failed is only logged."""
    import threading
    import types
    from concurrent.futures import Future
    from hetseq.distributed.spawn import DistContext
    from hetseq.run.loop import Run
    from machinery.in_process import build_controller
    flags = [*COMMON, "--local-steps", 2, "--outer-overlap", "--elastic",
             "--global-batch-size", 8, "--distributed-init-method", "tcp://127.0.0.1:1"]
    controller, _ = build_controller(flags, DistContext(0, 1, 0, torch.device("cpu")))

    def data_ends():
        raise UserError("this node's data ends")
    sent = Future()
    controller.exchange.pending = sent
    threading.Timer(1.0, sent.set_result, [["the sum"]]).start()   # the peers' half, late
    with pytest.raises(UserError, match="data ends"):
        Run.train(types.SimpleNamespace(_train=data_ends, controller=controller,
                                        report=types.SimpleNamespace(close=lambda: None)))
    assert sent.done(), "the rank exited with its round in flight"
    caplog.set_level("INFO", logger="hetseq")
    lost = Future()
    lost.set_exception(RuntimeError("Connection closed by peer"))
    controller.exchange.pending = lost
    with pytest.raises(UserError, match="data ends"):
        Run.train(types.SimpleNamespace(_train=data_ends, controller=controller,
                                        report=types.SimpleNamespace(close=lambda: None)))
    assert "did not complete before this rank stopped (Connection closed" in caplog.text


def test_a_snapshot_takes_the_data_position_of_the_update_it_went_back_to():
    """Elastic.snapshot (elastic/hooks.py): the position at the update the
    controller went back to, one of the last two completed (--outer-overlap
    may go back two rounds); an update this rank completed and the others
    did not: the position after the batch it drew."""
    import types
    from hetseq.elastic.hooks import Elastic
    seam = Elastic(types.SimpleNamespace(join_waiting=lambda: False), held=None)
    controller = types.SimpleNamespace(num_updates=2, members=types.SimpleNamespace(sitting=False))
    controller.state_dict = lambda local: {"num_updates": controller.num_updates}
    data = types.SimpleNamespace(position="after 2")
    data.state_dict = lambda: data.position
    seam.attach(controller, data, lambda position, state: {"train_iterator": position})
    data.position = "after 4"           # the round of updates 3 and 4, completed
    seam.begin_update()
    controller.num_updates = 4
    seam.completed(types.SimpleNamespace(ranks=types.SimpleNamespace(signal=[0.0])))
    data.position = "after 5"           # update 5, drawn (completed by this rank alone)
    seam.begin_update()
    for updates, position in ((2, "after 2"), (4, "after 4"), (5, "after 5")):
        controller.num_updates = updates
        assert seam.snapshot()["train_iterator"] == position
