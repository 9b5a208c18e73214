"""Keyed dropout in one pass: each element's byte is drawn where the
element is read (philox.py's draw), kept or zeroed and scaled; nothing is
saved for backward, which is the same kernel on the gradient (the mask is
the same function of the same keys). Reads and writes as torch's fused
dropout does, without its mask byte."""

import torch
import triton
import triton.language as tl

from hetseq.keyed.kernels import philox
from hetseq.keyed.kernels import words as hashes
from hetseq.keyed.kernels.triton_draw import kept4, kept8, swar, words


@triton.jit
def _part(X, Y, offsets, inside, keep, scale, zero, DROPOUT: tl.constexpr):
    x = tl.load(X + offsets, mask=inside, other=0.0)
    y = x.to(tl.float32) * scale
    if DROPOUT:
        # zero is a runtime 0.0: against a constant, LLVM moves the select
        # past the cast to 16 bits, where it costs three instructions a pair.
        y = tl.where(keep, y, zero)
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["site", "zero"])
def _dropout(X, Y, KEYS, LEAD, site, cut4, scale, zero, planes, rows, cols, row_tiles,
             col_tiles, DROPOUT: tl.constexpr, LOW_CUT: tl.constexpr, VEC: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    # The batch as [samples * planes, rows, cols]; one program BLOCK_R rows x
    # BLOCK_G calls of 16 columns of one plane; a thread a call, its 16
    # elements read VEC at a time (16 bytes).
    tile = tl.program_id(0)
    col_tile = tile % col_tiles
    row_tile = (tile // col_tiles) % row_tiles
    plane = tile // (col_tiles * row_tiles)
    row = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    group = col_tile * BLOCK_G + tl.arange(0, BLOCK_G)
    if DROPOUT:
        lead = LEAD + 2 * (plane % planes)
        w0, w1, w2, w3 = words(group[None, :], row[:, None], tl.load(lead), tl.load(lead + 1),
                               tl.load(KEYS + plane // planes), site)
        cut4 = cut4.to(tl.uint32)
        z = (swar(w0, cut4, LOW_CUT), swar(w1, cut4, LOW_CUT), swar(w2, cut4, LOW_CUT),
             swar(w3, cut4, LOW_CUT))
    base = (plane.to(tl.int64) * rows + row[:, None, None]) * cols + 16 * group[None, :, None]
    for part in tl.static_range(16 // VEC):
        col = 16 * group[None, :, None] + part * VEC + tl.arange(0, VEC)[None, None, :]
        inside = (row < rows)[:, None, None] & (col < cols)
        offsets = base + part * VEC + tl.arange(0, VEC)[None, None, :]
        keep = None
        if DROPOUT:
            if VEC == 8:
                keep = kept8(z[2 * part], z[2 * part + 1])
            else:
                keep = kept4(z[part])
            keep = tl.reshape(keep, (BLOCK_R, BLOCK_G, VEC))
        _part(X, Y, offsets, inside, keep, scale, zero, DROPOUT)


def block_cols(cols):
    """Columns per tile: the multiple of 16 (a call's span) up to 256 that
    pads ``cols`` least, the widest of those (768 columns: 3 x 256, where a
    tile of 1024 would leave a quarter idle). Rows fill the tile to 256
    calls: two a thread of four warps (the draw's setup paid once for both)."""
    return -min((triton.cdiv(cols, width) * width, -width) for width in (16, 32, 64, 128, 256))[1]


def launch(x, keys, site, cut, scale, dropout=True):
    """(kernel, grid, args, constants) of keyed dropout of ``x`` ([batch,
    ...], contiguous) into a new tensor, args[1]."""
    shape = tuple(x.shape[1:])
    lead, rows, cols = philox.planes(shape)
    lead_words = _lead_words(lead, x.device)
    y = torch.empty_like(x)
    block_g = block_cols(cols) // 16
    block_r = max(1, min(triton.next_power_of_2(rows), 256 // block_g))
    row_tiles, col_tiles = triton.cdiv(rows, block_r), triton.cdiv(cols, 16 * block_g)
    planes = len(lead_words)
    grid = (x.shape[0] * planes * row_tiles * col_tiles,)
    args = (x, y, keys, lead_words, hashes.signed(site), (cut % 128) * 0x01010101, scale, 0.0,
            planes, rows, cols, row_tiles, col_tiles)
    return _dropout, grid, args, dict(DROPOUT=dropout, LOW_CUT=cut < 128,
                                      VEC=16 // x.element_size(), BLOCK_R=block_r,
                                      BLOCK_G=block_g, num_warps=4)


def _lead_words(lead, device):
    lead_words = philox.lead_words(tuple(lead), device)
    return torch.where(lead_words >= 1 << 31, lead_words - hashes.WORD, lead_words).to(
        torch.int32).contiguous()


def dropout(x, keys, site, cut, scale):
    """``x`` ([batch, ...], at least 2-D) with each element kept when its
    byte (from its sample's key and the site's word ``site``) is at or
    above ``cut``, then multiplied by ``scale``."""
    x = x.contiguous()
    if x.numel() == 0:
        return torch.empty_like(x)
    kernel, grid, args, constants = launch(x, keys.contiguous(), site, cut, scale)
    kernel[grid](*args, **constants)
    return args[1]
