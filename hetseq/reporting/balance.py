"""The balance of a run, one JSON line per update in ``<save-dir>/balance.jsonl``
(rank 0, unless --no-save), so that a user can plot their own run (as
``bench/hetero.py`` and ``hetseq-plot`` do). A line is written one update
late: the ranks' compute times arrive with the next update's stats.
docs/capacity.md, "What a run records" (the fields, an example line).
"""

import json
import os
import time


class JsonLines:
    """A file of one JSON object per line, opened on the first line and kept
    open (line-buffered); ``path`` None writes nothing."""

    def __init__(self, path):
        self.path, self._file = path, None

    def append(self, line):
        if self.path is None:
            return
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(line) + "\n")

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


class BalanceLog:
    NAME = "balance.jsonl"

    def __init__(self, save_dir, enabled):
        self.path = os.path.join(save_dir, self.NAME) if enabled else None
        self.pending = None
        self._lines = JsonLines(self.path)

    def record(self, update, batch_sizes, samples, wall_s, rank_times, rank_samples, **figures):
        """One update's figures; ``rank_times``/``rank_samples`` are the
        previous update's (as the stats all-reduce carries them); ``figures``:
        the update's own numbers (loss, lr)."""
        if self.path is None:
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
        self._lines = JsonLines(os.path.join(save_dir, self.NAME) if enabled else None)

    def record(self, update, epoch, split, metrics):
        self._lines.append({"update": update, "epoch": epoch, "split": split,
                            "time": time.time(), **{k: float(v) for k, v in metrics.items()}})

    def close(self):
        self._lines.close()
