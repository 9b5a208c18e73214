"""words.py's hash as Triton functions on uint32 (shifts logical, products
wrapping), for the kernels that draw inside: bit for bit the torch path's."""

import triton
import triton.language as tl

from hetseq.kernels.words import GOLDEN, MULTIPLIERS

_M0 = tl.constexpr(MULTIPLIERS[0])
_M1 = tl.constexpr(MULTIPLIERS[1])
_GOLDEN = tl.constexpr(GOLDEN)
# The smallest float32: a masked key's score, as torch's explicit path fills it.
FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def mix(x):
    """lowbias32 (words.SHIFTS 16, 15, 16 around the two multipliers)."""
    x ^= x >> 16
    x *= _M0
    x ^= x >> 15
    x *= _M1
    x ^= x >> 16
    return x


@triton.jit
def absorb(state, word):
    return mix((state ^ word) + _GOLDEN)


@triton.jit
def site_key(KEYS, sample, word, call, real=True):
    """The site key of the batch's ``sample``-th sample (from its own key,
    wherever it sits) for the ``call``-th draw of the site whose word is
    ``word``: randomness._site_keys."""
    key = tl.load(KEYS + sample, mask=real, other=0).to(tl.uint32, bitcast=True)
    return absorb(absorb(key, word.to(tl.uint32, bitcast=True)), call.to(tl.uint32, bitcast=True))


@triton.jit
def kept(row_words, cols, site, threshold):
    """Whether each element of a [rows, cols] tile is kept: its bits, as
    int32, at or above ``threshold`` (randomness.dropout's rule)."""
    words = absorb(row_words[:, None], cols[None, :].to(tl.uint32))
    return absorb(words, site).to(tl.int32, bitcast=True) >= threshold
