"""The hash of what is not a Philox counter (philox.py): samples' keys from
(seed, epoch, index), sites' words, and the indices before a plane's last
two, on Python integers (the reference) and on int32 tensors (the torch
path; the Triton kernels compute the same). Hashed from indices, never
from the tensor's sizes. docs/design.md, "Where randomness comes from";
docs/gpu.md, "The hash".
"""

import functools

import torch

WORD = 1 << 32
GOLDEN = 0x9E3779B9            # added at every absorb, so that a zero word still mixes
# mix is Wellons's lowbias32: two multiply-xorshift rounds, full avalanche;
# absorb(state, word) = mix((state ^ word) + GOLDEN).
MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
SHIFTS = (16, 15, 16)


def mix32(value):
    """lowbias32 of an unsigned 32-bit integer."""
    x = value % WORD
    for shift, multiplier in zip(SHIFTS, MULTIPLIERS + (None,)):
        x ^= x >> shift
        if multiplier is not None:
            x = (x * multiplier) % WORD
    return x


def absorb32(state, word):
    """The state after taking in one more 32-bit word."""
    return mix32(((state ^ (word % WORD)) + GOLDEN) % WORD)


def signed(value):
    """An unsigned 32-bit value as the int32 a tensor holds."""
    value %= WORD
    return value - WORD if value >= 1 << 31 else value


_MULTIPLIERS = tuple(signed(m) for m in MULTIPLIERS)
_GOLDEN = signed(GOLDEN)


def mix_(x):
    """lowbias32 of every element of the int32 tensor ``x``, in place."""
    for shift, multiplier in zip(SHIFTS, _MULTIPLIERS + (None,)):
        # >> on int32 copies the sign bit; the mask makes the shift logical.
        x.bitwise_xor_(x.bitwise_right_shift(shift).bitwise_and_((1 << (32 - shift)) - 1))
        if multiplier is not None:
            x.mul_(multiplier)            # wraps modulo 2**32
    return x


def absorb_(state, words):
    """``absorb32`` elementwise, in place on ``state`` (int32; ``words`` broadcast)."""
    state.bitwise_xor_(words).add_(_GOLDEN)
    return mix_(state)


@functools.lru_cache(maxsize=32)
def coordinates(shape, device):
    """int32 words for every element of a per-sample tensor of ``shape``,
    hashed dimension by dimension from its indices, never from the sizes:
    element (i, j) has the same word in a (4, 7) tensor and in a (9, 7) one."""
    words = torch.zeros((), dtype=torch.int32, device=device)
    for size in shape:
        index = torch.arange(size, dtype=torch.int32, device=device)
        words = absorb_(words.unsqueeze(-1).expand(*words.shape, size).clone(), index)
    return words
