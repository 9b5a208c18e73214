"""philox.py's draw inside Triton kernels, and the keep bits attention
keeps from its draw to its backward: bit for bit the torch path's. A draw
tile is [rows, 16 g] of one plane, a Philox call per row and 16 columns.
Keep bits are 32-bit words in the order an MMA accumulator holds a tile
(triton_attention._draw packs them): a word holds the 32 elements one thread
holds of a 16 x 64 block, so a kernel in that orientation tests its own
bits with no data between threads (``unpack``). docs/gpu.md, "The draw".
"""

import triton
import triton.language as tl

from hetseq.keyed.kernels import philox

ROUNDS = tl.constexpr(philox.ROUNDS)


@triton.jit
def words(groups, rows, lead0, lead1, key, site):
    """Philox's four words for calls (column group, row) of a plane whose
    counter words are (lead0, lead1), under the key (sample key, site word)."""
    zero = (groups + rows) * 0
    return tl.philox_impl((groups + zero).to(tl.uint32), (rows + zero).to(tl.uint32),
                          (zero + lead0).to(tl.uint32), (zero + lead1).to(tl.uint32),
                          key.to(tl.uint32, bitcast=True), site.to(tl.uint32, bitcast=True),
                          ROUNDS)


# ---- keep bits between attention's kernels ----
# A word holds the 32 elements one thread of an MMA accumulator holds of a
# 16 x 64 block of a [rows, cols] plane: rows r, r + 8 (r3, bit 3 of the row)
# and columns 2t + c0 + 8 c3 + 16 c4 + 32 c5. Word (rg, cg) of the plane:
# rg = 8 (r // 16) + r % 8, cg = 4 (c // 64) + (c // 2) % 4. Two orders of
# its bits, each what _draw packs at least cost: ORDER 0 for the queries x
# keys plane (forward, dQ), ORDER 1 for keys x queries (dK/dV).

@triton.jit
def swar(w, cut4, LOW_CUT: tl.constexpr):
    """Bit 7 of each byte of uint32 ``w``: whether the byte is at or above
    cut (cut4 is (cut % 128) * 0x01010101; LOW_CUT: cut < 128)."""
    d = (w | 0x80808080) - cut4            # bit 7: the byte's low 7 bits reach cut's
    if LOW_CUT:
        kept = (w | d) & 0x80808080
    else:
        kept = (w & d) & 0x80808080
    return kept


@triton.jit
def kept_bits(w0, w1, w2, w3, cut4, LOW_CUT: tl.constexpr):
    """A call's 16 keep bits in two uint32 words: bit 8 j + 7 - k3 of z_h
    (h, j < 4, k3 < 2) is whether element 4 h + j + 8 k3 of the call is kept."""
    cut4 = cut4.to(tl.uint32)
    z0 = swar(w0, cut4, LOW_CUT) | (swar(w2, cut4, LOW_CUT) >> 1)
    z1 = swar(w1, cut4, LOW_CUT) | (swar(w3, cut4, LOW_CUT) >> 1)
    return z0, z1


@triton.jit
def _kept(z, j: tl.constexpr):
    return (z & (0x80 << (8 * j))) != 0


@triton.jit
def kept4(z):
    """[..., 2, 2] booleans: the 4 bytes of a word of ``swar``'s bits."""
    # bits 7, 15, 23, 31: written out, since each jit call costs the interpreter 0.5 ms
    return tl.join(tl.join((z & 0x80) != 0, (z & 0x800000) != 0),
                   tl.join((z & 0x8000) != 0, (z & 0x80000000) != 0))


@triton.jit
def kept8(za, zb):
    """[..., 2, 2, 2] booleans: the bytes of two words of ``swar``'s bits, in order."""
    # join appends its dimension last: (word, byte // 2, byte % 2), the word innermost
    low = tl.join(tl.join(_kept(za, 0), _kept(zb, 0)), tl.join(_kept(za, 2), _kept(zb, 2)))
    high = tl.join(tl.join(_kept(za, 1), _kept(zb, 1)), tl.join(_kept(za, 3), _kept(zb, 3)))
    return tl.join(low, high)


@triton.jit
def unpack(WORDS, stride, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
           ORDER: tl.constexpr):
    """The [ROWS, COLS] keep tile at (row0, col0) of a plane's words (row0 a
    multiple of 16; col0 of 64, or of 32 for a tile of 32 columns: a word's
    half, c5 being the top bit of its 16-bit halves in both orders), in the
    MMA accumulator's order."""
    rg = row0 // 2 + tl.arange(0, ROWS // 2)
    if COLS == 32:
        cg = col0 // 64 * 4 + tl.arange(0, 4)
    else:
        cg = col0 // 16 + tl.arange(0, COLS // 16)
    w = tl.load(WORDS + rg[:, None].to(tl.int64) * stride + cg[None, :])
    w = w.to(tl.uint32, bitcast=True)
    if COLS == 32:
        w = w >> (16 * (col0 // 32 % 2))                        # c5 is the tile's half
    # Each join splits the word's bits on one coordinate bit, the half where
    # it is 1 shifted by that bit's place (the two orders' places, ORDER 0 /
    # 1: c0 8 / 2, c3 -1 / 4, c4 2 / 8, c5 16, r3 4 / -1; a place of -1 is
    # 1 shift where the bit is 0): after five, bit 0 of each is its element's.
    # Shifts of constants compose, so a GPU tests each bit in one instruction.
    t = tl.join(w, w >> (8 - 6 * ORDER))                        # [.., c0]
    t = tl.join(t >> (1 - ORDER), t >> (4 * ORDER))             # [.., c0, c3]
    t = tl.join(t, t >> (2 + 6 * ORDER))                        # [.., c0, c3, c4]
    if COLS != 32:
        t = tl.join(t, t >> 16)                                 # [.., c4, c5]
    t = tl.join(t >> ORDER, t >> (4 - 4 * ORDER))               # [.., r3]
    kept = (t & 1) != 0
    if COLS == 32:
        # [rh, rl, cl, c0, c3, c4, r3] -> (rh, r3, rl, c4, c3, cl, c0)
        kept = tl.permute(tl.reshape(kept, (ROWS // 16, 8, 4, 2, 2, 2, 2)),
                          (0, 6, 1, 5, 4, 2, 3))
    else:
        # [rh, rl, ch, cl, c0, c3, c4, c5, r3] -> (rh, r3, rl, ch, c5, c4, c3, cl, c0)
        kept = tl.permute(tl.reshape(kept, (ROWS // 16, 8, COLS // 64, 4, 2, 2, 2, 2, 2)),
                          (0, 8, 1, 2, 7, 6, 5, 3, 4))
    return tl.reshape(kept, (ROWS, COLS))
