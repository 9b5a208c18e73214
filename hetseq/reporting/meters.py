"""Running averages and rates for the training log."""

import time

from hetseq.checkpoints.state import ANYTHING, Fields, MapOf, Number, OfType


class AverageMeter:
    """Weighted running average (e.g. loss weighted by sample count)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sum = 0.0
        self.count = 0.0

    def update(self, value, weight=1.0):
        self.sum += value * weight
        self.count += weight

    @property
    def avg(self):
        return self.sum / self.count if self.count else 0.0

    def state_dict(self):
        return {"sum": self.sum, "count": self.count}

    def load_state_dict(self, state):
        self.sum, self.count = state["sum"], state["count"]


class RateMeter:
    """Items per second of wall time since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        self.items = 0.0

    def update(self, items):
        self.items += items

    @property
    def rate(self):
        elapsed = time.perf_counter() - self.start
        return self.items / elapsed if elapsed > 0 else 0.0


class Meters:
    """A named set of AverageMeters, created on first use."""

    def __init__(self):
        self._meters = {}

    def update(self, values, weight=1.0):
        for name, value in values.items():
            self._meters.setdefault(name, AverageMeter()).update(value, weight)

    def averages(self):
        return {name: meter.avg for name, meter in self._meters.items()}

    def reset(self):
        self._meters.clear()

    def state_dict(self):
        return {name: meter.state_dict() for name, meter in self._meters.items()}

    @staticmethod
    def state_kind():
        """What saved meters must be (hetseq/checkpoints/state.py): named sums, any sign
        (a loss may be negative, inf or NaN), over a weight that is not negative."""
        return MapOf(OfType(str), Fields({"sum": Number(finite=False),
                                          "count": Number(low=0)}, extra=ANYTHING))

    def load_state_dict(self, state):
        self._meters = {}
        for name, meter_state in state.items():
            self._meters[name] = AverageMeter()
            self._meters[name].load_state_dict(meter_state)
