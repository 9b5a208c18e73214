"""Per-update statistics, summed over micro-batches and ranks in ONE all-reduce.

The vector holds the summed values (loss, sample_size and the task's logs, by
sorted key) followed by three world-size slots: each rank writes its compute
time and sample count of the PREVIOUS update and a checksum of its parameters
into its own slot, so after the SUM every rank knows every rank's speed
(capacity planning reads it) and can check that no rank diverged.

When the task hands its stats to ``backward`` (the base ``Task.train_step``
does), they are complete before the last backward of an update and travel
inside DDP's first gradient-bucket all-reduce (``carrier``, the Controller's
SumHook): no collective of their own. Otherwise (a task calling
``backward(loss)``, validation, a single process without DDP) they are
all-reduced on their own afterwards. The numbers are the same either way.
"""

import torch
import torch.distributed as dist


class StatsExchange:
    SLOTS = 3   # per rank: compute seconds, samples, parameter checksum

    def __init__(self, ctx, previous=(0.0, 0.0, 0.0), carrier=None):
        self.ctx = ctx
        self.previous = previous    # this rank's slot values
        self.carrier = carrier      # sends the vector with the next gradient all-reduce
        self._carried = False
        self.totals = {}
        self._keys = None
        self._vec = None
        self._work = None

    def add(self, loss, sample_size, logs, weight=1.0):
        # Values may be device tensors: summed as they are and read once, after
        # the all-reduce, so no micro-batch waits on the device.
        for key, value in {**logs, "loss": loss, "sample_size": sample_size}.items():
            self.totals[key] = self.totals.get(key, 0.0) + weight * value

    def launch(self, before_backward=False):
        """Build the vector and start its reduction; ``before_backward``: the
        gradient all-reduce that can carry it has not run yet."""
        device, W, r = self.ctx.device, self.ctx.world_size, self.ctx.rank
        self._keys = sorted(self.totals)
        values = [torch.as_tensor(self.totals[k], dtype=torch.float64, device=device).reshape(())
                  for k in self._keys]
        slots = torch.zeros(self.SLOTS * W, dtype=torch.float64, device=device)
        for i, value in enumerate(self.previous):
            slots[i * W + r] = value
        self._vec = torch.cat([torch.stack(values), slots])
        if not self.ctx.distributed:
            return
        if before_backward and self.carrier is not None and self._counts_fit_float32():
            self.carrier.carry(self._vec)
            self._carried = True
        else:
            self._work = dist.all_reduce(self._vec, async_op=True)

    def _counts_fit_float32(self):
        # A float32 bucket sums integers exactly below 2**24; a tensor count is
        # not checked (that would wait for the device) and travels on its own.
        n = self.totals["sample_size"]
        return isinstance(n, (int, float)) and abs(n) * self.ctx.world_size < 2**24

    def result(self):
        """(summed totals, [per-rank values of each slot])."""
        if self._vec is None:
            self.launch()
        if self._carried:
            self._vec = self.carrier.take()
        elif self._work is not None:
            self._work.wait()
        values = self._vec.tolist()
        k, W = len(self._keys), self.ctx.world_size
        slots = [values[k + i * W:k + (i + 1) * W] for i in range(self.SLOTS)]
        return dict(zip(self._keys, values[:k])), slots


class Backward:
    """The ``backward`` callable a task's ``train_step`` receives.

    ``backward(loss, sample_size, logs)`` adds the micro-batch's stats before
    running backward (and, on the last micro-batch, hands the finished vector
    to the gradient all-reduce). ``backward(loss)`` alone also works; the Controller then adds
    the stats that ``train_step`` returns. ``weight`` 0 marks a padding batch:
    it runs forward/backward so the collectives match, but contributes nothing.
    """

    def __init__(self, stats, weight, last):
        self.stats, self.weight, self.last = stats, weight, last
        self.announced = False

    def __call__(self, loss, sample_size=None, logs=None):
        if sample_size is not None:
            self.stats.add(loss.detach(), sample_size, logs or {}, self.weight)
            self.announced = True
            if self.last:
                self.stats.launch(before_backward=True)
        (loss if self.weight == 1.0 else loss * self.weight).backward()
