"""TensorBoard scalars, written by rank 0 only when --tensorboard-logdir is set."""

import os


class TensorBoard:
    def __init__(self, logdir, enabled):
        self._writers = {}
        self.logdir = logdir if enabled else None

    def log(self, split, scalars, step):
        if self.logdir is None:
            return
        writer = self._writer(split)
        # No flush here: this runs every update; SummaryWriter flushes on its
        # own timer and at close().
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)

    def _writer(self, split):
        if split not in self._writers:
            from torch.utils.tensorboard import SummaryWriter  # optional at import time
            self._writers[split] = SummaryWriter(os.path.join(self.logdir, split))
        return self._writers[split]

    def close(self):
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
