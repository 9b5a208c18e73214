"""Modules that draw per sample (hetseq/randomness.py): drop-in for torch's."""

from torch import nn

from hetseq import randomness


class Dropout(nn.Module):
    """``torch.nn.Dropout`` whose mask for each sample comes from that
    sample's own stream while HetSeq trains (the first dimension must be the
    sample), so the update does not depend on which rank held the sample.
    Outside a training step (evaluation, a model run by hand) it is torch's.

    ``site`` names the draw; left None, the Controller names it after the
    module's path in the model (``randomness.name_sites``)."""

    def __init__(self, p=0.5, site=None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p
        self.site = site

    def forward(self, x):
        if self.training and self.p > 0 and randomness.active() and self.site is None:
            raise RuntimeError("a hetseq.nn.Dropout without a site draws in a training step: "
                               "build it as part of the task's model (the Controller names "
                               "every one it holds) or pass site='name'")
        return randomness.dropout(x, self.p, self.site, self.training)

    def extra_repr(self):
        return f"p={self.p}" + (f", site={self.site!r}" if self.site else "")
