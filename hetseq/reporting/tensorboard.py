"""TensorBoard scalars, written by rank 0 into --tensorboard-logdir (by
default <save-dir>/tensorboard; --no-tensorboard: none).

TensorBoard is for people to look at: when its files cannot be written (a
full disk, a folder that went away) the run warns once, naming the disk
(logs.BestEffort), and goes on without it; the checkpoint, which matters,
reports the disk itself."""

import logging
import os
import threading

from hetseq.base.logs import BestEffort

logger = logging.getLogger(__name__)


def _quiet_writer_threads():
    """SummaryWriter's writer thread dies with a traceback on stderr when a
    write fails, then hands the error to the next add_scalar, which
    ``TensorBoard.log`` turns into one warning: keep only the warning."""
    previous = threading.excepthook
    if getattr(previous, "_hetseq", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)
    hook._hetseq = True
    threading.excepthook = hook


class TensorBoard:
    def __init__(self, logdir, enabled):
        self._writers = {}
        self.logdir = logdir if enabled else None
        self._out = BestEffort(self.logdir, "TensorBoard", logger)

    def log(self, split, scalars, step):
        if self.logdir is None:
            return
        try:
            writer = self._writer(split)
            # No flush here: this runs every update; SummaryWriter flushes on
            # its own timer and at close().
            for name, value in scalars.items():
                writer.add_scalar(name, value, step)
        except Exception as err:   # the writer's thread re-raises any OSError here
            self._give_up(err)

    def _writer(self, split):
        if split not in self._writers:
            from torch.utils.tensorboard import SummaryWriter  # optional at import time
            if not self._writers:
                _quiet_writer_threads()
            self._writers[split] = SummaryWriter(os.path.join(self.logdir, split))
        return self._writers[split]

    def _give_up(self, err):
        self._out.stop(err)
        self.logdir = None
        self.close()

    def close(self):
        writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            try:
                writer.close()
            except Exception as err:   # the last events met the full disk: said once
                self._out.stop(err)
