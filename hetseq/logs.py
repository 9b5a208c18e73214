"""Logging basics that every layer may use, start-up included: the set-up
(rank 0 at INFO, the others at WARNING), the node's own lines (NODE), and
helpers that keep waiting and refusals from flooding the log."""

import logging
import sys
import threading
import time

_FORMAT = "%(asctime)s | {label} | %(levelname)s | %(name)s | %(message)s"


# Lines every node prints, from its first process, whatever --log-all-ranks:
# joining, waiting at start-up, ending. Other INFO lines come from rank 0 only.
NODE = logging.getLogger("hetseq.node")
WAIT_LINE_S = 12.0     # how often a waiting node says what it waits for


def rank_ranges(ranks):
    """'0-3' or '1, 4' for a set of ranks."""
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class Every:
    """True from ``due()`` once every ``seconds`` (the first time after ``seconds``)."""

    def __init__(self, seconds=WAIT_LINE_S):
        self.seconds, self.next = seconds, time.monotonic() + seconds

    def due(self):
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.seconds
        return True


class Tally:
    """Warnings that anyone can cause (refused connections), kept from
    flooding the log: the first from a source is logged at once, the rest
    counted and summed up in one line per source once ``seconds`` have
    passed (at the next one after them). At most ``sources`` are told apart;
    the others are counted together."""

    def __init__(self, seconds=30.0, sources=64):
        self.seconds, self.sources = seconds, sources
        self._lock = threading.Lock()
        self._counts = {}        # source -> [not yet logged, the last reason]
        self._next = time.monotonic() + seconds

    def add(self, source, why):
        """Count one; returns (whether to log this one, [(source, count,
        last reason)] to log as a summary now)."""
        with self._lock:
            if source not in self._counts and len(self._counts) >= self.sources:
                source = "other addresses"
            first = source not in self._counts
            entry = self._counts.setdefault(source, [0, why])
            if not first:
                entry[0] += 1
            entry[1] = why
            due, now = [], time.monotonic()
            if now >= self._next:
                due = [(s, n, w) for s, (n, w) in self._counts.items() if n]
                self._counts, self._next = {}, now + self.seconds
        return first, due


def setup_logging(rank=0, all_ranks=False, node_first=False, label=None):
    """Log INFO on rank 0 and only WARNING and above elsewhere (unless all_ranks);
    the node's lines (``NODE``) at INFO on each node's first process. Each
    line says ``label``, by default 'rank RANK' (a node's own process, before
    its ranks start: 'rank 2-3', or 'node' before they are known)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_hetseq", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._hetseq = True
    handler.setFormatter(logging.Formatter(_FORMAT.format(label=label or f"rank {rank}"),
                                           "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    NODE.setLevel(logging.INFO if rank == 0 or all_ranks or node_first else logging.WARNING)
