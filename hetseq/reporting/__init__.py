"""Logging set-up, meters, progress display and TensorBoard output."""

import logging
import sys
import time

_FORMAT = "%(asctime)s | rank {rank} | %(levelname)s | %(name)s | %(message)s"


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


def setup_logging(rank=0, all_ranks=False, node_first=False):
    """Log INFO on rank 0 and only WARNING and above elsewhere (unless all_ranks);
    the node's lines (``NODE``) at INFO on each node's first process."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_hetseq", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._hetseq = True
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    NODE.setLevel(logging.INFO if rank == 0 or all_ranks or node_first else logging.WARNING)
