"""Modules that draw per sample (hetseq/keyed/randomness.py): drop-in for torch's."""

import torch.nn.functional as F
from torch import nn

from hetseq.keyed import kernels, randomness


class Dropout(nn.Dropout):
    """``torch.nn.Dropout`` (a subclass: code that looks for dropout layers
    finds it) whose mask for each sample comes from that sample's own stream
    while HetSeq trains, so the update does not depend on which rank held
    the sample. The first dimension of the input must be the sample.
    Outside a training step (evaluation, a model run by hand) it is torch's,
    ``inplace`` included; keyed, it never works in place.

    ``site`` names the draw; left None, the Controller names it after the
    module's path in the model (``randomness.name_sites``)."""

    def __init__(self, p=0.5, inplace=False, *, site=None):
        super().__init__(p, inplace)
        self.site = site

    def forward(self, x):
        if not (self.training and self.p > 0 and randomness.active()):
            return F.dropout(x, self.p, self.training, self.inplace)
        if self.site is None:
            raise RuntimeError("a hetseq.keyed.nn.Dropout without a site draws in a training step: "
                               "build it as part of the task's model (the Controller names "
                               "every one it holds) or pass site='name'")
        return randomness.dropout(x, self.p, self.site)

    def extra_repr(self):
        return super().extra_repr() + (f", site={self.site!r}" if self.site else "")


def attention(q, k, v, key_mask, dropout):
    """``F.scaled_dot_product_attention`` of q, k, v ([batch, heads, L, d])
    whose probabilities' dropout is ``dropout``'s (a ``Dropout`` of the
    model: its p, its site), drawn per sample while HetSeq trains: on CUDA
    inside one flash-style kernel, elsewhere explicitly, with the same masks.
    ``key_mask``: [batch, L] bool, True where a key may be attended, or None.
    Outside a training step it is torch's fused attention and dropout."""
    p = dropout.p if dropout.training else 0.0
    if not (p > 0 and randomness.active()):
        return kernels.sdpa(q, k, v, key_mask, p)
    if dropout.site is None:
        raise RuntimeError("hetseq.keyed.nn.attention's dropout has no site: build it as part of "
                           "the task's model (the Controller names every one it holds)")
    return randomness.attention(q, k, v, key_mask, p, dropout.site)
