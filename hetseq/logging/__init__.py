"""Logging set-up, meters, progress display and TensorBoard output."""

import logging
import sys

_FORMAT = "%(asctime)s | rank {rank} | %(levelname)s | %(name)s | %(message)s"


def setup_logging(rank=0, all_ranks=False):
    """Log INFO on rank 0 and only WARNING and above elsewhere (unless all_ranks)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_hetseq", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._hetseq = True
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
