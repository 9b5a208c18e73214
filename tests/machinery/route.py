"""The route of one update, traced: the HetSeq files a one-process toy run
enters from one call of the task's loss to the next (one whole update: its
backward, exchange, step and bookkeeping, the next batch and forward).
docs/design.md's route names the same files (tests/unit/project/test_route.py)."""

import sys

from machinery.settings import EXACT_SGD, QUIET, ROOT

# Updates 3 and 4 of 8-sample batches: an update in the middle of an epoch,
# nothing validated or saved around it.
ARGV = [*EXACT_SGD, *QUIET, "--max-update", "4", "--max-sentences", "8", "--no-save"]


def trace(argv=ARGV, first=3):
    """The files under hetseq/ (paths from the checkout, in the order first
    entered) whose Python functions run between loss call ``first`` and the next."""
    import torch
    from hetseq.distributed.spawn import DistContext
    from machinery.jobs import _build
    library = str(ROOT / "hetseq")
    run = _build(argv, DistContext(0, 1, 0, torch.device("cpu")))
    entered, calls, loss = [], [0], run.task.loss

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(library):
            path = name[len(str(ROOT)) + 1:]
            if path not in entered:
                entered.append(path)

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] in (first, first + 1):
            sys.setprofile(profile if calls[0] == first else None)
        return loss(*args, **kwargs)

    run.task.loss = counted
    try:
        run.train()
    finally:
        sys.setprofile(None)
    return entered
