"""A small CNN task (compute-heavy, few parameters) whose chosen rank is made slower per sample, for bench/hetero.py.

The slowdown sleeps ``(factor - 1) x`` the measured compute time per sample
(``--bench-ms-per-sample``), so a rank with factor 2 takes twice as long per
sample: a stable, CPU-friendly stand-in for an older GPU. ``--bench-slow-after``
lets the slowdown start mid-run (a GPU that gets shared or throttled).

A third of the sleep comes before the forward and two thirds in the backward,
before any gradient is ready (``--bench-forward-share``), as a slower device
spends its time (a backward costs about two forwards). Sleeping all of it before the forward would model
a device slow only at loading data: nothing started in backward (the stats
all-reduce, stats.py) could then overlap with a slow rank's work.
"""

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hetseq.tasks import Task, register_task


def make_cnn():
    # ~60 MFLOP per sample for 19k parameters: compute dominates communication,
    # as it does for real models on real interconnects.
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class SlicedImages(Dataset):
    """Yields indices; the collater cuts a batch with one slice (as MNIST does)."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return index

    def collater(self, indices):
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]


class Padded(nn.Module):
    """``model`` with ``mb`` MB of parameters more, in the graph at weight 0:
    their gradient is zero but travels in every exchange."""

    def __init__(self, model, mb):
        super().__init__()
        self.model = model
        self.pad = nn.Parameter(torch.zeros(int(mb * 2**20) // 4))

    def forward(self, x):
        return self.model(x) + 0 * self.pad[0]


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps; applied to the model's output, so the
    sleep comes before every parameter's gradient."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@register_task("bench_hetero")
class HeteroBenchTask(Task):
    _sleep = 0.0   # seconds this rank sleeps for the micro-batch in train_step

    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--bench-slow-rank", type=int, default=1)
        parser.add_argument("--bench-slow-factor", type=float, default=2.0)
        parser.add_argument("--bench-slow-after", type=int, default=0,
                            help="train_step calls before the slowdown starts")
        parser.add_argument("--bench-ms-per-sample", type=float, default=0.5,
                            help="compute time per sample the slowdown is scaled from")
        parser.add_argument("--bench-forward-share", type=float, default=1 / 3,
                            help="share of the sleep before the forward; the rest is "
                                 "in the backward (1: a device slow only at loading data)")
        parser.add_argument("--bench-extra-mb", type=float, default=0.0,
                            help="with --bench-factors: this many MB of extra parameters "
                                 "(zero gradient, summed like any other: an exchange of "
                                 "a bigger model)")
        parser.add_argument("--bench-factors", metavar="F0,F1,...",
                            help="per rank: sleep F x --bench-ms-per-sample per sample on a "
                                 "tiny model (so that more ranks than cores fit)")

    def load_dataset(self, split):
        g = torch.Generator().manual_seed(0)
        return SlicedImages(torch.randn(20000, 1, 28, 28, generator=g),
                            torch.randint(0, 10, (20000,), generator=g))

    def build_model(self):
        if self.args.bench_factors:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
            return Padded(model, self.args.bench_extra_mb) if self.args.bench_extra_mb else model
        return make_cnn()

    def _sleep_per_sample(self, rank):
        """Seconds this rank sleeps per sample, standing in for a slower device."""
        ms = self.args.bench_ms_per_sample / 1000
        if self.args.bench_factors:
            return float(self.args.bench_factors.split(",")[rank]) * ms
        if rank == self.args.bench_slow_rank and self.calls > self.args.bench_slow_after:
            return (self.args.bench_slow_factor - 1) * ms
        return 0.0

    def loss(self, model, sample):
        x, y = sample
        logits = model(x)
        if self._sleep:
            logits = _SleepInBackward.apply(
                logits, (1 - self.args.bench_forward_share) * self._sleep)
        return F.cross_entropy(logits, y, reduction="sum"), len(y), {}

    def train_step(self, model, sample, backward=None):
        self.calls = getattr(self, "calls", 0) + 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._sleep = self._sleep_per_sample(rank) * len(sample[1])
        time.sleep(self.args.bench_forward_share * self._sleep)
        try:
            return super().train_step(model, sample, backward)
        finally:
            self._sleep = 0.0
