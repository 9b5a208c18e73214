"""Per-update statistics, summed over micro-batches and ranks in ONE float64
all-reduce of its own: the counts the gradient math needs, the task's logs,
and one slot per rank for each field of ``RankReport`` (speed, samples,
checksum, membership signal, a stop asked), so every rank knows every rank's figures.
It starts before the last backward where the task hands its stats to
``backward`` (the Controller's ``_backward``). ``Gathered`` values are
collected, not summed. The compute seconds a rank reports are its own (``ComputeClock``, below):
not its wall time, since a fast rank waits for slow ones inside
collectives, so the waits inside FSDP's forward and backward are
subtracted (docs/design.md, "Stats and time")."""

import dataclasses
import functools
import time

import torch
import torch.distributed as dist

from hetseq.distributed.collectives import all_gather_object


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What every rank reports in each update's stats vector, one slot per
    rank and field (the fields' order is the vector's). Sent by one rank, a
    field holds its number; summed (``StatsSum.result``), a list of every
    rank's, in rank order."""
    seconds: object = 0.0     # compute seconds of the previous update (--local-steps: round)
    samples: object = 0.0     # samples of the previous update (round)
    wall: object = 0.0        # wall seconds from the end of the update before it to its end
    checksum: object = 0.0    # of the replicated state (agreement.py; 0: none this update)
    signal: object = 0.0      # 1: the members change after this update (--elastic)
    stop: object = 0.0        # the signal that asked this rank's node to stop (base/stopping.py)

    def values(self):
        """The fields' values, in the vector's order."""
        return [getattr(self, field.name) for field in dataclasses.fields(self)]


@dataclasses.dataclass
class StepResult:
    """What one update leaves for the run. ``totals``: the task's logs, loss
    and sample_size, summed over micro-batches and ranks; ``ranks``: every
    rank's RankReport (lists); ``lr``: the rate of the next update."""
    totals: dict
    ranks: RankReport
    lr: float
    updated: bool
    _norm: object = None        # the norm, or a function that measures it locally

    @property
    def sample_size(self):
        return self.totals["sample_size"]

    @property
    def grad_norm(self):
        """Norm of the mean-loss gradient of this update (None once the next
        update has begun). Unsharded and unclipped, it is measured here, on
        demand: a local pass that no other rank has to match."""
        return self._norm() if callable(self._norm) else self._norm



def _readable(value):
    """A Python float for numbers and CPU tensors, which cost nothing to read.
    A tensor on an accelerator stays a tensor: reading it would make every
    micro-batch wait for the device; it is read once, after the all-reduce."""
    if torch.is_tensor(value) and value.device.type != "cpu":
        return value.detach()
    return float(value)


def _to_device(tensor, device):
    # non_blocking: a blocking copy waits for all queued device work (the
    # forward pass) before backward can be queued. From pageable memory the
    # data is staged before the call returns, so the source may be freed.
    return tensor.to(device, non_blocking=True)


class Gathered:
    """A log value of per-sample rows, gathered from every rank instead of
    summed; the task's ``reduce_metrics`` receives all rows of all ranks, in
    rank order. Costs one all-gather: meant for validation."""

    def __init__(self, rows):
        self.rows = rows


class StatsSum:
    """One update's (or validation's) stats: added per micro-batch, summed
    over ranks with ``report`` (this rank's RankReport) in one all-reduce."""

    def __init__(self, ctx, report=RankReport(), local=False):
        self.ctx = ctx
        self.report = report        # this rank's slot values
        self.local = local          # an inner step of --local-steps: nothing travels
        self.totals = {}
        self.gathered = {}          # key -> list of row tensors (see Gathered)
        self._keys = None
        self._vec = None
        self._work = None           # the all-reduce under way, once started
        self._result = None         # (totals, ranks), once summed

    def add(self, loss, sample_size, logs, weight=1.0):
        totals = self.totals
        for key, value in (*logs.items(), ("loss", loss), ("sample_size", sample_size)):
            if isinstance(value, Gathered):
                if weight:   # a padding batch (weight 0) brings no rows
                    self.gathered.setdefault(key, []).append(value.rows.detach().cpu())
                else:
                    self.gathered.setdefault(key, [])
                continue
            totals[key] = totals.get(key, 0.0) + weight * _readable(value)

    def layout(self):
        """What the vector and the gathered rows hold: their keys."""
        return sorted(self.totals), sorted(self.gathered)

    def add_zeros(self, layout):
        """Zero for each key of ``layout`` (``layout()`` of stats of the same
        kind): a rank without samples sends the vector of the same layout as
        the others, and gathers no rows."""
        totals, gathered = layout
        for key in totals:
            self.totals.setdefault(key, 0.0)
        for key in gathered:
            self.gathered.setdefault(key, [])

    def own_samples(self):
        """This rank's samples in these stats (before any sum)."""
        return self.totals.get("sample_size", 0.0)

    def absorb(self, other):
        """Add ``other``'s totals and gathered rows to these (a round of
        --local-steps collects its inner steps' stats this way)."""
        for key, value in other.totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        for key, rows in other.gathered.items():
            self.gathered.setdefault(key, []).extend(rows)

    def clear(self):
        """Zero every value but keep the keys, so that every rank, even one
        without samples, sends a vector of the same layout."""
        self.totals = {key: 0.0 * value for key, value in self.totals.items()}
        self.gathered = {key: [] for key in self.gathered}

    def _build(self):
        """The vector: a list of floats, or a float64 tensor when some values
        are still on an accelerator."""
        W, r = self.ctx.world_size, self.ctx.rank
        self._keys = sorted(self.totals)
        slots = [0.0] * (len(dataclasses.fields(RankReport)) * W)
        slots[r::W] = [_readable(v) for v in self.report.values()]
        values = [self.totals[k] for k in self._keys] + slots
        on_device = [i for i, v in enumerate(values) if torch.is_tensor(v)]
        if on_device:
            with torch.no_grad():   # logs may be tensors still attached to the graph
                vec = _to_device(torch.tensor(
                    [0.0 if i in on_device else v for i, v in enumerate(values)],
                    dtype=torch.float64), self.ctx.device)
                vec[on_device] = torch.stack([values[i].to(torch.float64).reshape(())
                                              for i in on_device])
            values = vec
        self._vec = values

    def start(self):
        """Start summing the vector across ranks (asynchronously); ``result``
        waits for it."""
        self._build()
        if self.ctx.distributed and not self.local:
            self._vec = torch.as_tensor(self._vec, dtype=torch.float64, device=self.ctx.device)
            self._work = dist.all_reduce(self._vec, async_op=True)

    def result(self):
        """(summed totals, every rank's RankReport: a RankReport of lists); the
        sum is made once, later calls return it."""
        if self._result is not None:
            return self._result
        if self._vec is None:
            self.start()
        if self._work is not None:
            self._work.wait()
            self._work = None
        values = self._vec.tolist() if torch.is_tensor(self._vec) else self._vec
        k, W = len(self._keys), self.ctx.world_size
        ranks = RankReport(*(values[k + i * W:k + (i + 1) * W]
                             for i in range(len(dataclasses.fields(RankReport)))))
        totals = dict(zip(self._keys, values[:k]))
        self._result = ({**totals, **self._gather()} if not self.local else totals), ranks
        return self._result

    def _gather(self):
        if not self.gathered:
            return {}
        local = {key: torch.cat(rows) if rows else None for key, rows in self.gathered.items()}
        parts = all_gather_object(local, self.ctx)
        return {key: torch.cat([part[key] for part in parts if part.get(key) is not None])
                if any(part.get(key) is not None for part in parts) else torch.zeros(0)
                for key in sorted(local)}


# This rank's own compute time: what capacity planning and rebalancing
# measure a rank's speed by.
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
