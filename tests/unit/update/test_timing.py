"""Each rank's own compute time (hetseq/update/stats.py): what capacity planning and
rebalancing read. A rank that waits for a slower one inside a collective must
not count the wait as its own work."""

import torch

from hetseq.update import stats as timing


def test_fsdp_waits_are_timed_on_this_torch():
    # FSDP2 has no public hook around its waits; the methods timed are its
    # internals. Should torch move them, this fails instead of silently
    # counting every wait as compute.
    assert timing.time_fsdp_waits() == list(timing.FSDP_TIMED)


def test_the_clock_stops_at_the_end_of_backward():
    clock = timing.ComputeClock()
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    clock.stamp_at_end_of_backward(loss)
    loss.backward()
    ended = clock.seconds()
    assert clock.seconds() == ended > 0      # stamped: later reads do not grow
