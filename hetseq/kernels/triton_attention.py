"""Attention with keyed dropout on the probabilities, flash-style, so that
nothing L x L reaches memory: each tile's mask is drawn where the tile is
computed (the torch path's mask, bit for bit), and backward draws it again.
Two backward kernels and no atomics, so a result does not vary from run to
run. docs/gpu.md, "The attention kernel" (the arithmetic is beside each kernel).
"""

import torch
import triton
import triton.language as tl

from hetseq.kernels import words
from hetseq.kernels.triton_hash import FLOAT_MIN, absorb, kept, site_key


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32. WIDEN: bfloat16 operands multiplied as
    float32 (exact products), for Triton's interpreter, whose bfloat16 dot
    multiplies the raw bits (Triton 3.9); a GPU multiplies them natively."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(q, kT, cols, Lk, attend, scale, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
            WIDEN: tl.constexpr):
    s = _dot(q, kT, PRECISION, WIDEN) * scale
    if HAS_MASK:
        s = tl.where(attend[None, :], s, FLOAT_MIN)
    return tl.where((cols < Lk)[None, :], s, float("-inf"))


@triton.jit
def _attend(KEY_MASK, b, smb, sml, cols, Lk, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        return tl.load(KEY_MASK + b * smb + cols * sml, mask=cols < Lk, other=0) != 0
    return cols < Lk


@triton.jit
def _tile(PTR, stride_b, stride_h, stride_l, stride_d, b, h, idx, L, dims, D):
    """A [len(idx), len(dims)] tile of a [batch, heads, L, d] tensor (zeros outside)."""
    base = PTR + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    ptrs = base + idx[:, None].to(tl.int64) * stride_l + dims[None, :] * stride_d
    return tl.load(ptrs, mask=(idx < L)[:, None] & (dims < D)[None, :], other=0.0)


@triton.jit
def _tile_t(PTR, stride_b, stride_h, stride_l, stride_d, b, h, idx, L, dims, D):
    """The transposed tile: [len(dims), len(idx)]."""
    base = PTR + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    ptrs = base + idx[None, :].to(tl.int64) * stride_l + dims[:, None] * stride_d
    return tl.load(ptrs, mask=(idx < L)[None, :] & (dims < D)[:, None], other=0.0)


@triton.jit
def _put(PTR, stride_b, stride_h, stride_l, stride_d, b, h, idx, L, dims, D, value):
    base = PTR + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    ptrs = base + idx[:, None].to(tl.int64) * stride_l + dims[None, :] * stride_d
    tl.store(ptrs, value.to(PTR.dtype.element_ty), mask=(idx < L)[:, None] & (dims < D)[None, :])


# Forward, per (sample, head, block of queries), over blocks of keys:
#   s = q k^T * scale, a masked key's score the smallest float32 (as the explicit
#       path fills it: a sample with no real key gets even weights)
#   m = running row max,  l = running sum of exp(s - m)
#   acc += (exp(s - m) * kept) v   (rescaled as m grows);  out = acc / l / (1 - p)
# The rows' m and l are kept (8 bytes a row) for backward.
@triton.jit(do_not_specialize=["word", "call"])
def _forward(Q, K, V, O, STATS, KEY_MASK, KEYS,
             sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
             sob, soh, sol, sod, smb, sml,
             heads, Lq, Lk, D, scale, threshold, keep_scale, word, call,
             HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
             WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, LENGTH_CLASS: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(Q, sqb, sqh, sql, sqd, b, h, rows, Lq, dims, D)
    if DROPOUT:
        site = site_key(KEYS, b, word, call)
        row_words = absorb(absorb(tl.zeros([BLOCK_M], tl.uint32), h.to(tl.uint32)),
                           rows.to(tl.uint32))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kT = _tile_t(K, skb, skh, skl, skd, b, h, cols, Lk, dims, D)
        v = _tile(V, svb, svh, svl, svd, b, h, cols, Lk, dims, D)
        attend = _attend(KEY_MASK, b, smb, sml, cols, Lk, HAS_MASK)
        s = _scores(q, kT, cols, Lk, attend, scale, HAS_MASK, PRECISION, WIDEN)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(kept(row_words, cols, site, threshold), p, 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m = m_new
    acc = acc / l[:, None]
    if DROPOUT:
        acc = acc * keep_scale
    _put(O, sob, soh, sol, sod, b, h, rows, Lq, dims, D, acc)
    inside = rows < Lq
    tl.store(STATS + bh.to(tl.int64) * Lq + rows, m, mask=inside)
    tl.store(STATS + (bh.to(tl.int64) + tl.num_programs(0)) * Lq + rows, l, mask=inside)


@triton.jit
def _probabilities(s, STATS, bh, n_bh, rows, Lq):
    """P of a tile from the rows' saved max and sum."""
    inside = rows < Lq
    m = tl.load(STATS + bh.to(tl.int64) * Lq + rows, mask=inside, other=0.0)
    l = tl.load(STATS + (bh.to(tl.int64) + n_bh) * Lq + rows, mask=inside, other=1.0)
    p = tl.exp(s - m[:, None]) / l[:, None]
    return tl.where(inside[:, None], p, 0.0)


# Backward recomputes P = exp(s - m) / l tile by tile:
#   dV = (P * kept / (1 - p))^T dO,   dP = dO V^T * kept / (1 - p)
#   dS = P * (dP - D),   D = rowsum(dO * out)   (= sum_j P dP, dropout included)
#   dQ = dS K * scale,   dK = dS^T Q * scale    (dS is 0 at a masked key)
# _backward_kv walks the queries for a block of keys (dK, dV), _backward_q the
# keys for a block of queries (dQ): no atomics.
@triton.jit
def _tile_grads(q, kT, vT, do, delta, rows, cols, Lq, Lk, attend, STATS, bh, row_words, site,
                threshold, keep_scale, scale, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """A tile's (P as dropped, for dV; dS): P recomputed from the rows' saved
    max and sum, its mask drawn again."""
    s = _scores(q, kT, cols, Lk, attend, scale, HAS_MASK, PRECISION, WIDEN)
    p = _probabilities(s, STATS, bh, tl.num_programs(0), rows, Lq)
    dp = _dot(do, vT, PRECISION, WIDEN)
    dropped = p
    if DROPOUT:
        keep = kept(row_words, cols, site, threshold)
        dropped = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    return dropped, tl.where(attend[None, :], p * (dp - delta[:, None]), 0.0)


@triton.jit(do_not_specialize=["word", "call"])
def _backward_kv(Q, K, V, DO, STATS, DELTA, KEY_MASK, KEYS, DK, DV,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
                 sdb, sdh, sdl, sdd, sgb, sgh, sgl, sgd, smb, sml,
                 heads, Lq, Lk, D, scale, threshold, keep_scale, word, call,
                 HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                 WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, LENGTH_CLASS: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kT = _tile_t(K, skb, skh, skl, skd, b, h, cols, Lk, dims, D)
    vT = _tile_t(V, svb, svh, svl, svd, b, h, cols, Lk, dims, D)
    attend = _attend(KEY_MASK, b, smb, sml, cols, Lk, HAS_MASK)
    site = site_key(KEYS, b, word, call)
    head_word = absorb(tl.zeros([BLOCK_M], tl.uint32), h.to(tl.uint32))
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, Lq, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _tile(Q, sqb, sqh, sql, sqd, b, h, rows, Lq, dims, D)
        do = _tile(DO, sdb, sdh, sdl, sdd, b, h, rows, Lq, dims, D)
        delta = tl.load(DELTA + bh.to(tl.int64) * Lq + rows, mask=rows < Lq, other=0.0)
        dropped, ds = _tile_grads(q, kT, vT, do, delta, rows, cols, Lq, Lk, attend, STATS, bh,
                                  absorb(head_word, rows.to(tl.uint32)), site, threshold,
                                  keep_scale, scale, HAS_MASK, DROPOUT, PRECISION, WIDEN)
        dv += _dot(tl.trans(dropped.to(do.dtype)), do, PRECISION, WIDEN)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, WIDEN)
    _put(DK, sgb, sgh, sgl, sgd, b, h, cols, Lk, dims, D, dk * scale)
    _put(DV, sgb, sgh, sgl, sgd, b, h, cols, Lk, dims, D, dv)


@triton.jit(do_not_specialize=["word", "call"])
def _backward_q(Q, K, V, DO, STATS, DELTA, KEY_MASK, KEYS, DQ,
                sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
                sdb, sdh, sdl, sdd, sgb, sgh, sgl, sgd, smb, sml,
                heads, Lq, Lk, D, scale, threshold, keep_scale, word, call,
                HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, LENGTH_CLASS: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(Q, sqb, sqh, sql, sqd, b, h, rows, Lq, dims, D)
    do = _tile(DO, sdb, sdh, sdl, sdd, b, h, rows, Lq, dims, D)
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + rows, mask=rows < Lq, other=0.0)
    site = site_key(KEYS, b, word, call)
    row_words = absorb(absorb(tl.zeros([BLOCK_M], tl.uint32), h.to(tl.uint32)),
                       rows.to(tl.uint32))
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kT = _tile_t(K, skb, skh, skl, skd, b, h, cols, Lk, dims, D)
        vT = _tile_t(V, svb, svh, svl, svd, b, h, cols, Lk, dims, D)
        attend = _attend(KEY_MASK, b, smb, sml, cols, Lk, HAS_MASK)
        _, ds = _tile_grads(q, kT, vT, do, delta, rows, cols, Lq, Lk, attend, STATS, bh,
                            row_words, site, threshold, keep_scale, scale, HAS_MASK, DROPOUT,
                            PRECISION, WIDEN)
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), PRECISION, WIDEN)
    _put(DQ, sgb, sgh, sgl, sgd, b, h, rows, Lq, dims, D, dq * scale)


# ---- launching ----

def _arithmetic(q):
    """tl.dot's precision: float32 as torch's matmul computes it (IEEE unless
    TF32 is allowed), the narrow dtypes as they are; bfloat16 widened in the
    interpreter (``_dot``)."""
    ieee = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(PRECISION="ieee" if ieee else "tf32",
                WIDEN=q.dtype == torch.bfloat16 and q.device.type != "cuda")


# Tiles (BLOCK_M queries, BLOCK_N keys, warps) that compile for sm_90 without
# spilling registers (ptxas -v, bf16); the autotuner picks among them on the
# first call for each head dimension and length class.
CONFIGS = {
    (_forward, 64): [(128, 64, 8), (64, 64, 4), (64, 32, 4), (128, 32, 8)],
    (_forward, 128): [(64, 64, 8), (64, 32, 8), (128, 32, 8), (32, 64, 8)],
    (_backward_kv, 64): [(64, 64, 8), (32, 64, 4), (128, 64, 8), (64, 32, 4)],
    (_backward_kv, 128): [(32, 64, 8), (32, 32, 8)],
    (_backward_q, 64): [(64, 64, 8), (128, 32, 8), (64, 32, 4), (128, 64, 8)],
    (_backward_q, 128): [(64, 32, 8), (32, 32, 8)],
}
_tuned = {}


def _launch(kernel, rows_per_program, programs, args, d, length, device, **constants):
    """Run ``kernel`` over (batch * heads, ceil(programs / its block)) programs
    (batch * heads on the first axis, which takes 2**31 - 1; the second 65535).
    On CUDA with the autotuned tiles; on a CPU (Triton's interpreter) with
    one tile large enough for the tests' shapes, since timing means nothing there."""
    block_d = max(16, triton.next_power_of_2(d))
    constants.update(BLOCK_D=block_d, LENGTH_CLASS=max(64, triton.next_power_of_2(length)))
    if device.type != "cuda":
        kernel[(programs[1], triton.cdiv(programs[0], 64))](*args, BLOCK_M=64, BLOCK_N=64,
                                                             **constants)
        return
    key = (kernel, 64 if block_d <= 64 else 128)
    if key not in _tuned:
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=2)
                   for m, n, w in CONFIGS[key]]
        _tuned[key] = triton.autotune(configs, key=["BLOCK_D", "LENGTH_CLASS"])(kernel)
    grid = lambda meta: (programs[1], triton.cdiv(programs[0], meta[rows_per_program]))  # noqa: E731
    _tuned[key][grid](*args, **constants)


def _like_heads(x, length=None):
    """An empty [batch, heads, L, d] tensor laid out as [batch, L, heads, d],
    the layout the model reshapes the context from without a copy."""
    B, H, L, D = x.shape
    return torch.empty(B, length or L, H, D, dtype=x.dtype, device=x.device).transpose(1, 2)


def _site(draw):
    """The site's word and call as the kernels take them (int32)."""
    return words.signed(draw[1]), words.signed(draw[2])


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()]


def _mask_args(key_mask, q):
    if key_mask is None:
        return q, 0, 0          # any pointer: never read
    key_mask = key_mask.view(torch.uint8)    # a bool tensor as bytes: the same memory
    return key_mask, key_mask.stride(0), key_mask.stride(1)


def forward(q, k, v, key_mask, draw, threshold, keep_scale, scale, dropout=True):
    """(out [B, heads, Lq, d], stats [2, B * heads, Lq]: each row's max and sum)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    out = _like_heads(q)
    stats = torch.empty(2, B * H, Lq, dtype=torch.float32, device=q.device)
    mask, smb, sml = _mask_args(key_mask, q)
    args = (q, k, v, out, stats, mask, draw[0], *_strides(q, k, v, out), smb, sml,
            H, Lq, Lk, D, scale, threshold, keep_scale, *_site(draw))
    _launch(_forward, "BLOCK_M", (Lq, B * H), args, D, max(Lq, Lk), q.device,
            HAS_MASK=key_mask is not None, DROPOUT=dropout, **_arithmetic(q))
    return out, stats


def backward(grad, q, k, v, out, stats, key_mask, draw, threshold, keep_scale, scale,
             dropout=True):
    """(dq, dk, dv) of ``forward``'s output, the masks drawn again."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    delta = (grad.float() * out.float()).sum(-1).reshape(B * H, Lq).contiguous()
    dq, dk, dv = _like_heads(q), _like_heads(k), _like_heads(v)
    mask, smb, sml = _mask_args(key_mask, q)
    common = dict(HAS_MASK=key_mask is not None, DROPOUT=dropout, **_arithmetic(q))
    inputs = (q, k, v, grad, stats, delta, mask, draw[0])
    sizes = (H, Lq, Lk, D, scale, threshold, keep_scale, *_site(draw))
    _launch(_backward_kv, "BLOCK_N", (Lk, B * H),
            (*inputs, dk, dv, *_strides(q, k, v, grad, dk), smb, sml, *sizes),
            D, max(Lq, Lk), q.device, **common)
    _launch(_backward_q, "BLOCK_M", (Lq, B * H),
            (*inputs, dq, *_strides(q, k, v, grad, dq), smb, sml, *sizes),
            D, max(Lq, Lk), q.device, **common)
    return dq, dk, dv
