"""The balance of a run, one JSON line per update in ``<save-dir>/balance.jsonl``
(rank 0, unless --no-save), so that a user can plot their own run (as
``bench/hetero.py`` and ``hetseq-plot`` do). A line is written one update
late: the ranks' compute times arrive with the next update's stats.
docs/capacity.md, "What a run records" (the fields, an example line).
"""

import contextlib
import json
import os
import time

from hetseq.base.logs import BestEffort


class JsonLines:
    """A file of one JSON object per line, opened on the first line and kept
    open; ``path`` None writes nothing. It is for people (hetseq-plot): a
    write that fails (a full disk) stops the file with one warning
    (logs.BestEffort) and the run goes on, and the file keeps whole lines."""

    def __init__(self, path, what):
        self.path, self._file = path, None
        self._out = BestEffort(path, what)

    @property
    def writing(self):
        return self._out.writing

    def append(self, line):
        if not self._out.writing:
            return
        text = (json.dumps(line) + "\n").encode()
        self._out.attempt(lambda: self._write(text))
        if self._out.stopped:
            self.close()

    def _write(self, data):
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            # Unbuffered: each line reaches the file in its own write, so a
            # failure is this line's and no buffer is left to fail again at close.
            self._file = open(self.path, "ab", buffering=0)
        start = os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError:
            # Half a line would be a line hetseq-plot cannot read: cut it off.
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), start)
            raise

    def close(self):
        if self._file is not None:
            with contextlib.suppress(OSError):     # nothing is buffered: nothing to lose
                self._file.close()
            self._file = None


class BalanceLog:
    NAME = "balance.jsonl"

    def __init__(self, save_dir, enabled):
        self.path = os.path.join(save_dir, self.NAME) if enabled else None
        self.pending = None
        self._lines = JsonLines(self.path, "the balance log")

    def record(self, update, batch_sizes, samples, wall_s, rank_times, rank_samples, **figures):
        """One update's figures; ``rank_times``/``rank_samples`` are the
        previous update's (as the stats all-reduce carries them); ``figures``:
        the update's own numbers (loss, lr)."""
        if not self._lines.writing:     # none asked for, or stopped (a full disk)
            return
        if self.pending is not None:
            self._write(self.pending, rank_times, rank_samples)
        self.pending = {"update": update, "time": time.time(), "wall_s": wall_s,
                        "samples": samples, "batch_sizes": list(batch_sizes), **figures}

    def close(self):
        if self.pending is not None:
            self._write(self.pending, None, None)
            self.pending = None
        self._lines.close()

    def _write(self, line, rank_times, rank_samples):
        if rank_times is not None:
            line.update(rank_compute_s=rank_times, rank_samples=rank_samples,
                        rank_samples_per_s=[n / t if t > 0 else 0.0
                                            for n, t in zip(rank_samples, rank_times)])
        self._lines.append(line)


class ValidLog:
    """Every validation, ``<save-dir>/valid.jsonl`` (rank 0, unless --no-save):
    ``{"update": 40, "epoch": 1, "split": "valid", "time": ..., "loss": 0.86,
    "accuracy": 0.71}``, for hetseq-plot's validation curves."""
    NAME = "valid.jsonl"

    def __init__(self, save_dir, enabled):
        self._lines = JsonLines(os.path.join(save_dir, self.NAME) if enabled else None,
                                "the validation log")

    def record(self, update, epoch, split, metrics):
        self._lines.append({"update": update, "epoch": epoch, "split": split,
                            "time": time.time(), **{k: float(v) for k, v in metrics.items()}})

    def close(self):
        self._lines.close()
