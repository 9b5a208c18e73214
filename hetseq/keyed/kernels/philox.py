"""The keyed draw: Philox4x32-7 (flash-attn's generator, ``tl.philox_impl``)
on Python integers and int64 tensors: the reference every kernel equals bit
for bit, and the torch path CPUs run. Key: (the sample's key, the site's
word); counter: an element's coordinates, never the tensor's sizes. One call
serves 16 elements of a row, counter (col // 16, row, *lead), element 16g + i
taking byte i; it is kept when that byte reaches ``cut`` = round(256 p), and
kept values are scaled by 256 / (256 - cut). docs/gpu.md, "The draw";
docs/design.md, "Where randomness comes from".
"""

import functools

import torch

from hetseq.keyed.kernels import words

ROUNDS = 7                      # flash-attn's; Random123's default is 10 (docs/gpu.md)
SPAN = 16                       # elements one call serves, one byte each
RESOLUTION = 256                # a byte's values: p is drawn to 1/256
_MASK = words.WORD - 1
_M0, _M1 = 0xD2511F53, 0xCD9E8D57        # the round multipliers
_K0, _K1 = 0x9E3779B9, 0xBB67AE85        # the key schedule's steps


def cut(p):
    """The byte an element's draw must reach to be kept, for dropout
    probability ``p``: round(256 p), from 0 (all kept) to 256 (none)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return round(p * RESOLUTION)


def keep_scale(cut):
    """What a kept value is multiplied by: 1 / its keep probability."""
    return RESOLUTION / (RESOLUTION - cut)


def site_word(word, call):
    """The second key word of the ``call``-th draw of the site whose word is
    ``word`` (a Python int: the same on every rank and every device)."""
    return words.absorb32(word, call)


# ---- Philox4x32 ----

def philox(counter, key, rounds=ROUNDS):
    """Philox4x32 of four counter words under two key words, on Python
    integers or on int64 tensors holding unsigned 32-bit values (broadcast
    together). Round for round what ``tl.philox_impl`` computes:
    (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1,
    lo(M0 c0)), then the key steps."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        (hi0, lo0), (hi1, lo1) = _mulhilo(_M1, c2), _mulhilo(_M0, c0)
        c0, c1, c2, c3 = hi0 ^ c1 ^ k0, lo0, hi1 ^ c3 ^ k1, lo1
        k0 = (k0 + _K0) & _MASK
        k1 = (k1 + _K1) & _MASK
    return c0, c1, c2, c3


def _mulhilo(multiplier, x):
    """(high, low) 32-bit halves of multiplier * x. On int64 tensors the
    product wraps modulo 2**64 past 2**63, as every torch build multiplies
    int64 (two's complement; tests/unit/keyed/test_randomness.py pins it against Python
    integers): its 64 bits are the exact product all the same."""
    product = multiplier * x
    if isinstance(product, int):
        return product >> 32, product & _MASK
    return (product >> 32).bitwise_and_(_MASK), product.bitwise_and_(_MASK)


# ---- where an element's byte comes from ----

def planes(shape):
    """A per-sample shape as (leading dims, rows, cols): rows and cols are
    the last two dims (a 1-D tensor is one row)."""
    shape = tuple(shape)
    if len(shape) == 1:
        return (), 1, shape[0]
    return shape[:-2], shape[-2], shape[-1]


@functools.lru_cache(maxsize=64)
def lead_words(lead, device):
    """The two counter words of every plane of leading dims ``lead``
    ([planes, 2], int64): the index before rows, and a hash of the indices
    before it (words.coordinates), zero where there are none."""
    if not lead:
        return torch.zeros(1, 2, dtype=torch.int64, device=device)
    last = torch.arange(lead[-1], device=device)
    rest = words.coordinates(lead[:-1], device).reshape(-1).long() & _MASK \
        if len(lead) > 1 else torch.zeros(1, dtype=torch.int64, device=device)
    return torch.stack([last.repeat(len(rest)), rest.repeat_interleave(len(last))], 1)


def _words32(keys, site, rows, cols, lead, device, per_call):
    """Philox's four output words for every call of the planes: int64
    tensors [n, planes, rows, ceil(cols / per_call)]."""
    k0 = keys.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1) & _MASK
    plane = lead_words(tuple(lead), device)
    counter = (torch.arange(-(-cols // per_call), device=device).view(1, 1, 1, -1),
               torch.arange(rows, device=device).view(1, 1, -1, 1),
               plane[:, 0].view(1, -1, 1, 1), plane[:, 1].view(1, -1, 1, 1))
    return philox(counter, (k0, site & _MASK))


def draw_bytes(keys, site, shape):
    """Each element's byte (uint8, [len(keys), *shape]) for the samples'
    ``keys`` (int32) and the site's ``site`` word (``site_word``)."""
    lead, rows, cols = planes(shape)
    out = _words32(keys, site, rows, cols, lead, keys.device, SPAN)
    # Four int32 words as 16 little-endian bytes: element 16g + i is byte i.
    stacked = torch.stack([w.to(torch.int32) for w in _as_signed(out)], -1)
    flat = stacked.view(torch.uint8).flatten(-2)[..., :cols]
    return flat.reshape(len(keys), *shape)


def _as_signed(values):
    return [torch.where(v >= 1 << 31, v - words.WORD, v) for v in values]


def keep(keys, site, cut, shape):
    """Whether each element of a [len(keys), *shape] tensor is kept."""
    return draw_bytes(keys, site, shape) >= cut


def draw_words(keys, site, shape):
    """32 random bits per element (int32, [len(keys), *shape]) for a task's
    own draws: one call serves 4 elements of a row, a word each."""
    lead, rows, cols = planes(shape)
    out = _words32(keys, site, rows, cols, lead, keys.device, 4)
    stacked = torch.stack([w.to(torch.int32) for w in _as_signed(out)], -1)
    return stacked.flatten(-2)[..., :cols].reshape(len(keys), *shape)


def seeds(keys, site):
    """A 63-bit seed per sample, for a task's own torch.Generator."""
    k0 = keys.to(torch.int64) & _MASK
    out = philox((0, 0, 0, 0), (k0, site & _MASK))
    return (out[0] | ((out[1] & 0x7FFFFFFF) << 32)).tolist()
