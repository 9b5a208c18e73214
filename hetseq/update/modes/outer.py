"""The pieces of --local-steps around its rounds (update/modes/local_steps.py):
the sharding view under which every rank trains its own replica, and the
sum of the ranks' changes through the --outer-dtype codec, at once or, with
--outer-overlap, in a thread of its own."""

import concurrent.futures
import datetime

import torch.distributed as dist

from hetseq.update.modes.compress import CODECS
from hetseq.update.zero.sharding import Sharding

# A rank that stops on its own error waits this long at most for the round it
# sent (--outer-overlap) when the job sets no --distributed-timeout.
DRAIN_S = 60


class LocalReplicas(Sharding):
    """The sharding view of --local-steps: every rank trains its own replica
    with its own optimizer (no gradient crosses the network); ``outer`` is the
    --zero mode that holds the outer step's optimizer (--zero 1 shards its
    momentum)."""

    def __init__(self, outer, cfg):
        super().__init__(outer.cfg, outer.precision, outer.ctx)
        self.outer, self.exchange = outer, cfg

    def describe(self):
        cfg = self.exchange
        overlap = ", overlapped" if cfg.outer_overlap else ""
        outer = "the weighted average" if (cfg.outer_lr, cfg.outer_momentum) == (1, 0) else \
            f"Nesterov lr {cfg.outer_lr} momentum {cfg.outer_momentum}"
        return (f"--local-steps {cfg.local_steps} (outer step: {outer}, exchanged in "
                f"{cfg.outer_dtype}{overlap}; outer optimizer under {self.outer.describe()})")

    def replicated_state(self, params, optimizer):
        return []   # inside a round the replicas differ by design: LocalSteps.replicated


class OuterSum:
    """sum over ranks of flat tensors, through the --outer-dtype codec.
    ``overlap``: ``later`` sums in a thread, on a process group of its own,
    whose collectives never pair with the main thread's (the stats,
    validation, checkpoints). Built at the same point on every rank (a new
    group is a collective)."""

    def __init__(self, dtype, ctx, overlap):
        self.codec, self.ctx = CODECS.get(dtype), ctx
        self._group = self._pool = None
        if overlap and ctx.distributed:
            # The job's --distributed-timeout, not the library's 30 minutes: an
            # exchange blocked on a member no heartbeat cut (one sharing this
            # host's address) fails when the job's collectives would.
            timeout = datetime.timedelta(seconds=ctx.timeout_s) if ctx.timeout_s else None
            self._group = dist.new_group(backend=dist.get_backend(), timeout=timeout)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "hetseq-outer")

    def __call__(self, flats):
        if not self.ctx.distributed:
            return flats
        return [self.codec(flat, self._group) for flat in flats]

    def later(self, flats):
        """The sum as a future (in the thread, or done at once without one)."""
        return self._pool.submit(self, flats) if self._pool else _Done(self(flats))


def first_line(err):
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__


class _Done:
    """A finished 'future' (one process: nothing to wait for)."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value
