"""Progress output: a tqdm bar on rank 0, or plain log lines every N updates.

A plain line reads ``epoch 001 | update 40/60 | 0:00:21 left | loss=... |``
(the time left counts the validations and saves still due);
the next names every rank's samples/s and share of the global batch, which
rank 0 has from the per-update stats anyway.
"""

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
    updates still to make at the wall time per update measured since this
    process's first update ended (validations and saves left out), plus the
    validations and saves still due (``due(update)``: {kind: count}) at what
    the last of each kind took. "measuring time left" until it has a rate;
    "0:00:00 left" only once nothing is left."""

    def __init__(self, planned=None):
        self.planned = planned
        self.due = None            # due(update) -> {"validation": n, "saving": n}, or None
        self.took = {}             # kind -> seconds the last one took
        self._last = {}            # kind -> the update the last one followed
        self._start = None         # (time, update) at the end of the first update seen

    def tick(self, update, steps=1):
        if self._start is None:
            self._start = (time.perf_counter(), update)

    def paused(self, kind, seconds, update=None):
        """A ``kind`` ("validation", "saving") after ``update`` took
        ``seconds``: its time, not the updates', and what the next ones are
        expected to take (one update's validations of several splits summed)."""
        last = self._last.get(kind)
        self.took[kind] = seconds + (self.took[kind] if last is not None and last == update else 0)
        self._last[kind] = update
        if self._start is not None:
            self._start = (self._start[0] + seconds, self._start[1])

    def estimate(self, update):
        """(seconds left, kinds still due and not yet timed); None without a rate."""
        if not self.planned or self._start is None or update <= self._start[1]:
            return None
        since, first = self._start
        left = max(0, self.planned - update) * (time.perf_counter() - since) / (update - first)
        untimed = []
        for kind, count in (self.due(update) if self.due else {}).items():
            if count and kind in self.took:
                left += count * self.took[kind]
            elif count:
                untimed.append(kind)
        return left, untimed

    def left(self, update):
        estimate = self.estimate(update)
        return None if estimate is None else estimate[0]

    def left_text(self, update):
        """'0:00:21 left', '0:00:21 left + saving (not yet timed)', 'measuring time left'."""
        estimate = self.estimate(update)
        if estimate is None:
            return "measuring time left"
        left, untimed = estimate
        text = f"{format_duration(math.ceil(left))} left" if left > 0 or not untimed else ""
        if untimed:
            text += f"{' + ' if text else ''}{' and '.join(untimed)}" \
                f"{'' if text else ' left'} (not yet timed)"
        return text

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
