"""Per-update statistics, summed over micro-batches and ranks in ONE all-reduce.

The vector holds the summed values (loss, sample_size and the task's logs, by
sorted key) followed by three world-size slots: each rank writes its compute
time and sample count of the PREVIOUS update and a checksum of its parameters
into its own slot, so after the SUM every rank knows every rank's speed
(capacity planning reads it) and can check that no rank diverged.

How the vector travels. When the task hands its stats to ``backward`` (the
base ``Task.train_step`` does), they are complete before the last backward of
an update and ride inside DDP's own gradient all-reduce, through a
``Carrier``: no collective of their own, no Python communication hook, no
copy. Otherwise (a task calling ``backward(loss)``, validation, one process,
``--find-unused-parameters``) they are all-reduced on their own afterwards, in
float64. The numbers are the same either way, up to float32 rounding.

A log value wrapped in ``Gathered`` is not summed: its rows are collected
from every micro-batch and rank (one all-gather after the sum), for metrics
that no sum carries, such as a rank correlation over the whole dev set.
"""

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetseq.distributed.collectives import all_gather_object

_ENGINE = torch.autograd.Variable._execution_engine


class Carrier(nn.Module):
    """What DDP wraps: the task's model plus ``slot``, a parameter the model
    never uses. The last backward of an update adds ``slot . v`` to the loss,
    so slot's gradient is the stats vector ``v``, and DDP all-reduces it with
    the model's gradients.

    DDP averages (it divides the sum by W), so ``v`` is sent multiplied by W.
    For integer counts n the products n*W and the quotients by W are exact in
    float32, so summed counts stay exact while W * sum(n) < 2**24 (16.7M);
    above that their relative error is 6e-8, harmless in a 1/N scaling.
    """

    MAX_VALUES = 64   # summed values that fit; a task logging more sends them on their own

    def __init__(self, model, world_size, device):
        super().__init__()
        self.model = model
        self.world_size = world_size
        # In a submodule registered after the model, so that parameters() lists
        # the model's own first, as they would be without the Carrier.
        self.size = self.MAX_VALUES + StatsExchange.SLOTS * world_size
        self.stats = nn.Module()
        self.stats.slot = nn.Parameter(torch.zeros(self.size, device=device))

    @property
    def slot(self):
        return self.stats.slot

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        # ``ddp.module.some_attribute`` keeps working for tasks that use it.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    def fits(self, vec):
        return len(vec) <= self.size

    def term(self, vec):
        """The scalar to add to the loss: its gradient w.r.t. ``slot`` is ``vec``
        times W (None: zeros, when the stats travel on their own)."""
        if isinstance(vec, list):   # the usual case: built in numpy, one copy
            send = np.zeros(self.size, dtype=np.float32)
            send[:len(vec)] = vec
            send *= self.world_size
            send = torch.from_numpy(send)
            if self.slot.device.type != "cpu":
                send = _to_device(send, self.slot.device)
        else:
            send = torch.zeros_like(self.slot, requires_grad=False)
            if vec is not None:
                send[:len(vec)] = vec * self.world_size
        return torch.dot(self.slot, send)

    def received(self, length):
        """The summed vector as a list, once DDP's all-reduce has finished."""
        values = self.slot.grad.tolist()[:length]
        self.slot.grad = None
        return values


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


class StatsExchange:
    SLOTS = 3   # per rank: compute seconds, samples, parameter checksum

    def __init__(self, ctx, previous=(0.0, 0.0, 0.0), carrier=None):
        self.ctx = ctx
        self.previous = previous    # this rank's slot values
        self.carrier = carrier      # a Carrier when DDP can take the vector along
        self._carried = False
        self.totals = {}
        self.gathered = {}          # key -> list of row tensors (see Gathered)
        self._keys = None
        self._vec = None

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
        slots = [0.0] * (self.SLOTS * W)
        slots[r::W] = [_readable(v) for v in self.previous]
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

    def carry(self):
        """Build the vector for the carrier to take along in the coming gradient
        all-reduce; None when it does not fit (it then travels on its own)."""
        self._build()
        if self.carrier is None or not self.carrier.fits(self._vec):
            return None
        self._carried = True
        return self._vec

    def result(self):
        """(summed totals, [per-rank values of each slot])."""
        if self._vec is None:
            self._build()
        values = self._vec
        if self._carried:
            values = self.carrier.received(len(values))
        elif self.ctx.distributed:
            vec = torch.as_tensor(values, dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(vec)
            values = vec.tolist()
        elif torch.is_tensor(values):
            values = values.tolist()
        k, W = len(self._keys), self.ctx.world_size
        slots = [values[k + i * W:k + (i + 1) * W] for i in range(self.SLOTS)]
        return {**dict(zip(self._keys, values[:k])), **self._gather()}, slots

    def _gather(self):
        if not self.gathered:
            return {}
        local = {key: torch.cat(rows) if rows else None for key, rows in self.gathered.items()}
        parts = all_gather_object(local, self.ctx)
        return {key: torch.cat([part[key] for part in parts if part.get(key) is not None])
                if any(part.get(key) is not None for part in parts) else torch.zeros(0)
                for key in sorted(local)}


class Backward:
    """The ``backward`` callable a task's ``train_step`` receives.

    ``backward(loss, sample_size, logs)`` adds the micro-batch's stats before
    running backward (and, on the last micro-batch, hands the finished vector
    to the carrier). ``backward(loss)`` alone also works; the Controller then
    adds the stats that ``train_step`` returns. ``weight`` 0 marks a padding
    batch: it runs forward/backward so the collectives match, but contributes
    nothing. ``compute_end`` is when this rank's own backward work ended,
    before it waits for the gradient all-reduce (and so for slower ranks).
    """

    def __init__(self, stats, weight, last):
        self.stats, self.weight, self.last = stats, weight, last
        self.announced = False
        self.called = False
        self.compute_end = None

    def __call__(self, loss, sample_size=None, logs=None):
        self.called = True
        if sample_size is not None:
            self.stats.add(loss.detach(), sample_size, logs or {}, self.weight)
            self.announced = True
        total = loss if self.weight == 1.0 else loss * self.weight
        carrier = self.stats.carrier
        if self.last and carrier is not None:
            # Every rank adds the term on its synchronising backward, carried or
            # not, so DDP sees the same parameters used everywhere.
            total = total + carrier.term(self.stats.carry() if self.announced else None)
            # A hook on the root runs first in backward; its callback is queued
            # before DDP's, which waits for the all-reduce, so it stamps the end
            # of this rank's compute.
            total.register_hook(lambda grad: _ENGINE.queue_callback(self._stamp))
        total.backward()

    def _stamp(self):
        self.compute_end = time.perf_counter()
