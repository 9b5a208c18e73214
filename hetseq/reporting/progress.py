"""Progress output: a tqdm bar on rank 0, or plain log lines every N updates.

A plain line reads ``epoch 001 | update 40/60 | 0:00:21 left | loss=... |``
(the time left counts the validations and saves still due);
the next names every rank's samples/s and share of the global batch, which
rank 0 has from the per-update stats anyway.
"""

import collections
import logging
import math
import time

from tqdm import tqdm

logger = logging.getLogger("hetseq.progress")


def format_stats(stats):
    parts = []
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
        parts.append(f"{key}={value}")
    return " | ".join(parts)


def format_duration(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_ranks(rank_samples, rank_times, batch_sizes):
    """'ranks: 0 18.6/s 16 (50%) | 1 ...': each rank's samples per second of
    its own compute and its share of the global batch."""
    total = sum(batch_sizes) or 1
    parts = []
    for rank, (samples, seconds, size) in enumerate(zip(rank_samples, rank_times, batch_sizes)):
        rate = f"{samples / seconds:.1f}/s" if seconds > 0 else "idle"
        parts.append(f"{rank} {rate} {size} ({100 * size / total:.0f}%)")
    return "ranks: " + " | ".join(parts)


class Clock:
    """The run's position (``update N/planned``) and the time left: the
    updates still to make at the wall time per update of the last ``window``
    updates (so a change of speed shows within a few log lines; validations
    and saves left out), plus the validations and saves still due
    (``due(update)``: {kind: count}). Each at what the last of its kind took;
    before one ran, a validation at its samples (``valid_samples``) at the
    training rate, a forward a third of a training step, and a save at one
    update's time. "measuring time left" until there is a rate; "0:00:00
    left" only once nothing is left."""

    FORWARD_SHARE = 1 / 3       # a forward's share of a training step's time

    def __init__(self, planned=None, window=2):
        self.planned = planned
        self.window = max(2, window)   # updates the rate is measured over
        self.due = None            # due(update) -> {"validation": n, "saving": n}, or None
        self.valid_samples = None  # samples of one validation (every --valid-subset), if known
        self.batch = None          # samples of one update (the global batch), if known
        self.took = {}             # kind -> seconds the last one took
        self._last = {}            # kind -> the update the last one followed
        self._ticks = collections.deque()   # (time less the pauses, update) of recent updates
        self._paused = 0.0         # seconds of validations and saves so far

    def tick(self, update, steps=1):
        self._ticks.append((time.perf_counter() - self._paused, update))
        while len(self._ticks) > 2 and update - self._ticks[1][1] >= self.window:
            self._ticks.popleft()

    def paused(self, kind, seconds, update=None):
        """A ``kind`` ("validation", "saving") after ``update`` took
        ``seconds``: its time, not the updates', and what the next ones are
        expected to take (one update's validations of several splits summed)."""
        last = self._last.get(kind)
        self.took[kind] = seconds + (self.took[kind] if last is not None and last == update else 0)
        self._last[kind] = update
        self._paused += seconds

    def per_update(self, update):
        """Wall seconds per update lately (None without two updates)."""
        if not self._ticks or update <= self._ticks[0][1]:
            return None
        since, first = self._ticks[0]
        return (time.perf_counter() - self._paused - since) / (update - first)

    def estimate(self, update):
        """Seconds left; None without a rate."""
        per_update = self.per_update(update) if self.planned else None
        if per_update is None:
            return None
        left = max(0, self.planned - update) * per_update
        for kind, count in (self.due(update) if self.due else {}).items():
            left += count * self.expected(kind, per_update)
        return left

    def expected(self, kind, per_update):
        """What one ``kind`` takes: the last one's time, else an estimate."""
        if kind in self.took:
            return self.took[kind]
        if kind == "validation" and self.valid_samples and self.batch:
            return self.valid_samples / self.batch * per_update * self.FORWARD_SHARE
        return per_update

    def left(self, update):
        return self.estimate(update)

    def left_text(self, update):
        """'0:00:21 left', or 'measuring time left' before there is a rate."""
        left = self.estimate(update)
        return "measuring time left" if left is None else \
            f"{format_duration(math.ceil(left))} left"

    def head(self, update):
        where = f"update {update}/{self.planned}" if self.planned else f"update {update}"
        return f"{where} | {self.left_text(update)}" if self.planned else where


class Progress:
    """Wraps the update loop of one epoch.

    ``log(stats, update)`` is called after every update; ``summary`` at the end.
    """

    def __init__(self, total, prefix, is_main, use_bar, log_interval, clock=None):
        self.prefix = prefix
        self.is_main = is_main
        self.log_interval = max(1, log_interval)
        self.clock = clock or Clock()
        self.bar = tqdm(total=total, desc=prefix, leave=False, dynamic_ncols=True) \
            if is_main and use_bar else None

    def due(self, update, steps=1):
        """Whether plain lines are written after ``update`` (covering ``steps``)."""
        return self.bar is None and \
            update // self.log_interval > (update - steps) // self.log_interval

    def log(self, stats, update, steps=1, ranks=None):
        """After update ``update``, which covered ``steps`` updates (a round);
        ``ranks``: the per-rank line, for plain output."""
        self.clock.tick(update, steps)
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v
                                  for k, v in stats.items()}, refresh=False)
        elif self.due(update, steps):
            logger.info("%s | %s | %s", self.prefix, self.clock.head(update), format_stats(stats))
            if ranks:
                logger.info("%s | %s", self.prefix, ranks)

    def summary(self, stats):
        if self.bar is not None:
            self.bar.close()
        if self.is_main:
            logger.info("%s | %s", self.prefix, format_stats(stats))
