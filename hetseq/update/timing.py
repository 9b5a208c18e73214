"""This rank's own compute time: what capacity planning and rebalancing
measure a rank's speed by. Not its wall time, since a fast rank waits for
slow ones inside collectives: the clock of one update (or probe), and the
waits inside FSDP's forward and backward that it subtracts.
"""

import functools
import time

import torch

_ENGINE = torch.autograd.Variable._execution_engine


class ComputeClock:
    """Seconds of this rank's own work from its creation to the end of its
    backward: wall time minus what ``waited()`` (seconds spent so far in
    collectives inside forward/backward) grew by meanwhile."""

    def __init__(self, waited=lambda: 0.0):
        self.waited = waited
        self.start = (time.perf_counter(), waited())
        self.end = None

    def stamp_at_end_of_backward(self, root):
        """Stamp when the backward from ``root`` has done this rank's work:
        a hook on the root runs first in backward and queues a callback ahead
        of DDP's, which waits for the gradient all-reduce (and so for slower
        ranks). FSDP's waits are read then too: its root reduce-scatter comes
        after."""
        root.register_hook(lambda grad: _ENGINE.queue_callback(self.stamp))

    def stamp(self):
        self.end = (time.perf_counter(), self.waited())

    def seconds(self):
        end = self.end or (time.perf_counter(), self.waited())
        return (end[0] - self.start[0]) - (end[1] - self.start[1])


# Under FSDP every unit's forward and backward starts by waiting for its
# parameters' all-gather and ends (backward) with a reduce-scatter: a rank
# faster than the others waits there. FSDP2 has no public hook around these
# waits, so the three methods of its parameter group that contain them are
# timed (torch 2.6 to 2.13; tests/unit/update/test_timing.py fails if they move).
_WAITED = [0.0]
_DEPTH = [0]     # timed methods under way (one may call another)
FSDP_TIMED = ("unshard", "wait_for_unshard", "post_backward")


def fsdp_waited():
    """Seconds this process has spent so far inside FSDP's collectives."""
    return _WAITED[0]


def time_fsdp_waits():
    """Time FSDP2's waits from now on (idempotent). Returns the names timed."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    cls, timed = group.FSDPParamGroup, []
    for name in FSDP_TIMED:
        method = getattr(cls, name, None)
        if method is None:
            continue
        if not getattr(method, "_hetseq_timed", False):
            setattr(cls, name, _timed(method))
        timed.append(name)
    return timed


def _timed(method):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        if _DEPTH[0]:            # called from another timed method: counted there
            return method(*args, **kwargs)
        _DEPTH[0] += 1
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _WAITED[0] += time.perf_counter() - start
            _DEPTH[0] -= 1
    timed._hetseq_timed = True
    return timed
