"""Keyed dropout in one pass: each element's bits are drawn where it is
read (words.py's hash), kept or zeroed and scaled; nothing is saved for
backward, which is the same kernel on the gradient (the mask is the same
function of the same keys). Reads and writes as torch's fused dropout does,
without its mask byte."""

import torch
import triton
import triton.language as tl

from hetseq.kernels import words
from hetseq.kernels.triton_hash import absorb, site_key



@triton.jit(do_not_specialize=["word", "call"])
def _dropout(X, Y, ROW_WORDS, KEYS, word, call, rows, total_rows, cols, threshold, scale,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A tile of the batch seen as [batch * rows, cols] (each sample's tensor
    # as [rows, cols]): BLOCK_R rows of BLOCK_C columns.
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    real = row < total_rows
    inside = real[:, None] & (col < cols)[None, :]
    row_word = tl.load(ROW_WORDS + row % rows, mask=real, other=0).to(tl.uint32, bitcast=True)
    site = site_key(KEYS, row // rows, word, call, real)
    offsets = row[:, None].to(tl.int64) * cols + col[None, :]
    x = tl.load(X + offsets, mask=inside, other=0.0)
    drawn = absorb(absorb(row_word[:, None], col[None, :].to(tl.uint32)), site[:, None])
    keep = (drawn.to(tl.int32, bitcast=True) >= threshold).to(tl.float32)
    tl.store(Y + offsets, (x.to(tl.float32) * keep * scale).to(x.dtype), mask=inside)


def dropout(x, keys, word, call, threshold, scale):
    """``x`` ([batch, ...], at least 2-D) with each element kept when its
    bits (from its sample's key, the site's ``word`` and ``call``) are >=
    ``threshold``, then multiplied by ``scale``."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    shape = tuple(x.shape[1:])
    cols = shape[-1]
    rows = x[0].numel() // cols
    # The words of every row (all dimensions but the last), once per shape.
    row_words = words.coordinates(shape[:-1], x.device).reshape(-1)
    block_c = min(1024, triton.next_power_of_2(cols))
    # A GPU program takes 2048 elements; the interpreter (CPU) runs programs
    # one after another, so it takes tiles as large as numpy likes.
    block_r = max(1, (2048 if x.is_cuda else 1 << 16) // block_c)
    grid = (triton.cdiv(x.shape[0] * rows, block_r), triton.cdiv(cols, block_c))
    _dropout[grid](x, y, row_words, keys.contiguous(), words.signed(word), words.signed(call),
                   rows, x.shape[0] * rows, cols, threshold, scale, BLOCK_R=block_r,
                   BLOCK_C=block_c)
    return y
