"""Attention with keyed dropout of its probabilities, flash-style, so that
nothing L x L of floats reaches memory. The mask is drawn once per call
(``_draw``: philox.py's bits, the torch path's bit for bit) and kept as one
bit per element in two orders, one per orientation of the kernels that use
it (triton_draw.unpack); forward and backward test those bits where they
compute a tile. Two backward kernels and no atomics, so a result does not
vary from run to run. docs/gpu.md, "The attention kernels" (the arithmetic
is beside each kernel); the launches and tiles are flash.py's.
"""

import triton
import triton.language as tl

from hetseq.keyed.kernels.triton_draw import kept_bits, unpack
from hetseq.keyed.kernels.triton_draw import words as words_of

# A masked key's score in log2 units: exp2 of it less any real score is 0,
# and a row with no real key in its first block of keys stays finite.
MASKED = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32. WIDEN: bfloat16 operands multiplied as
    float32 (exact products), for Triton's interpreter, whose bfloat16 dot
    multiplies the raw bits (Triton 3.9); a GPU multiplies them natively."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load(PTR, stride_l, stride_d, idx, L, dims, D, EVEN_L: tl.constexpr,
          EVEN_D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A [len(idx), len(dims)] tile of a [L, d] matrix (its transpose when
    TRANSPOSED), zeros outside; no bounds where the sizes divide."""
    if TRANSPOSED:
        ptrs = PTR + idx[None, :].to(tl.int64) * stride_l + dims[:, None] * stride_d
        inside = (idx < L)[None, :] & (dims < D)[:, None]
    else:
        ptrs = PTR + idx[:, None].to(tl.int64) * stride_l + dims[None, :] * stride_d
        inside = (idx < L)[:, None] & (dims < D)[None, :]
    if EVEN_L and EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=inside, other=0.0)


@triton.jit
def _store(PTR, stride_l, stride_d, idx, L, dims, D, value):
    ptrs = PTR + idx[:, None].to(tl.int64) * stride_l + dims[None, :] * stride_d
    tl.store(ptrs, value.to(PTR.dtype.element_ty), mask=(idx < L)[:, None] & (dims < D)[None, :])


@triton.jit
def _row(PTR, idx, L, other, EVEN_L: tl.constexpr):
    if EVEN_L:
        return tl.load(PTR + idx)
    return tl.load(PTR + idx, mask=idx < L, other=other)


@triton.jit
def _key_bias(KEY_MASK, smb, sml, b, cols, Lk, HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr):
    """What a block of keys adds to its scores: 0, or MASKED for a masked
    key or one past the end (all 0, and not added, where neither exists)."""
    if HAS_MASK:
        attend = _row(KEY_MASK + b.to(tl.int64) * smb, cols * sml, Lk * sml, 0, EVEN_N) != 0
        return tl.where(attend, 0.0, MASKED)
    return tl.where(cols < Lk, 0.0, MASKED)


# ---- the draw: once per call, its bits kept in both orientations ----

@triton.jit
def _eight(x):
    return (x, x, x, x, x, x, x, x)


@triton.jit
def _to_words(w, z0, z1, t: tl.constexpr):
    """Four words of queries x keys, each OR-ed with its bits of a call:
    keys 16 g + 2 t + c0 + 8 c3 are bits 16 (t % 2) + 8 c0 + 7 - c3 of
    z_(t // 2), taken to (c0, c3) at bit t (of 0x303 << t). A shift right
    then left is one shift to a GPU (LLVM folds them with the mask)."""
    return (w[0] | ((z0 >> 6 << t) & (0x303 << t)), w[1] | ((z0 >> 22 << t) & (0x303 << t)),
            w[2] | ((z1 >> 6 << t) & (0x303 << t)), w[3] | ((z1 >> 22 << t) & (0x303 << t)))


@triton.jit
def _to_words_t(w, z0, z1, t: tl.constexpr):
    """Eight words of keys x queries (keys 16 g + kl, kl < 8) OR-ed with a
    call's bits: keys kl (+ 8) are bits 8 (kl % 4) + 7 (+ 6) of z_(kl // 4)."""
    return (w[0] | ((z0 >> 6 << t) & (3 << t)), w[1] | ((z0 >> 14 << t) & (3 << t)),
            w[2] | ((z0 >> 22 << t) & (3 << t)), w[3] | ((z0 >> 30 << t) & (3 << t)),
            w[4] | ((z1 >> 6 << t) & (3 << t)), w[5] | ((z1 >> 14 << t) & (3 << t)),
            w[6] | ((z1 >> 22 << t) & (3 << t)), w[7] | ((z1 >> 30 << t) & (3 << t)))


@triton.jit
def _pair(words_t0, words_t1, q_base, group, head, key, site, cut4, LOW_CUT: tl.constexpr,
          pair: tl.constexpr):
    """The 4 calls of queries q_base + (q0, q4, q5) of ``pair`` (+ 8) and 32
    keys from 16 group: their 4 half words, and their bits of the 16 words_t
    (keys 16 group + kl, then 16 (group + 1) + kl)."""
    q0: tl.constexpr = pair % 2
    q4: tl.constexpr = pair // 2 % 2
    q5: tl.constexpr = pair // 4
    words = (q_base * 0).to(tl.uint32)
    words = (words, words, words, words)
    for q3 in tl.static_range(2):
        for g in tl.static_range(2):
            w0, w1, w2, w3 = words_of(group + g, q_base + q0 + 8 * q3 + 16 * q4 + 32 * q5, head,
                                      0, key, site)
            z0, z1 = kept_bits(w0, w1, w2, w3, cut4, LOW_CUT)
            words = _to_words(words, z0, z1, 4 * q3 + 2 * g)
            # queries q0 + 8 q3 + 16 q4 + 32 q5: bit 2 q0 + 4 q3 + 8 q4 + 16 q5 (+ 1 - r3)
            if g == 0:
                words_t0 = _to_words_t(words_t0, z0, z1, 16 * q5 + 8 * q4 + 4 * q3 + 2 * q0)
            else:
                words_t1 = _to_words_t(words_t1, z0, z1, 16 * q5 + 8 * q4 + 4 * q3 + 2 * q0)
    return words, words_t0, words_t1


@triton.jit(do_not_specialize=["site"])
def _draw(KEYS, WORDS, WORDS_T, site, cut4, heads, units, q_units, k_blocks, sw_bh, sw_r,
          st_bh, st_r, LOW_CUT: tl.constexpr, UNITS: tl.constexpr):
    # A thread's unit: one head's 16 queries 64 qb + 2 tq + (q0, q3, q4, q5)
    # x 32 keys 32 kb + 16 g + i, 32 calls (philox.keep's bytes), packed with
    # no data between threads into the 16 words of those keys x queries
    # (triton_draw's ORDER 1) and the halves (bit 4 of a word's bits: c5 = kb
    # % 2) of the 32 of queries x keys (ORDER 0), stored a query pair at a time.
    u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
    live = u < units
    plane = u // (q_units * k_blocks)
    kb = u % k_blocks
    qb = u // k_blocks % q_units // 4
    tq = u // k_blocks % q_units % 4
    key = tl.load(KEYS + plane // heads, mask=live, other=0)
    zero = (kb * 0).to(tl.uint32)
    words_t0, words_t1 = _eight(zero), _eight(zero)
    HALVES = WORDS.to(tl.pointer_type(tl.int16))       # little-endian: bits 0-15 first
    for pair in tl.static_range(8):
        words, words_t0, words_t1 = _pair(words_t0, words_t1, 64 * qb + 2 * tq, 2 * kb,
                                          plane % heads, key, site, cut4, LOW_CUT, pair)
        # queries 64 qb + 2 tq + (q0, q4, q5) of the pair: rows 8 (q // 16) + q % 8
        row = 8 * (4 * qb + pair // 2) + 2 * tq + pair % 2
        for t in tl.static_range(4):
            tl.store(HALVES + 2 * (plane * sw_bh + row * sw_r + 4 * (kb // 2) + t) + kb % 2,
                     words[t].to(tl.int16), mask=live)
    for kl in tl.static_range(8):
        # keys 32 kb + 16 g + kl (+ 8): rows 8 (k // 16) + k % 8
        for g in tl.static_range(2):
            if g == 0:
                word = words_t0[kl]
            else:
                word = words_t1[kl]
            tl.store(WORDS_T + plane * st_bh + (8 * (2 * kb + g) + kl) * st_r + 4 * qb + tq,
                     word.to(tl.int32, bitcast=True), mask=live)


# ---- forward ----
# Per (block of queries, head, sample), over blocks of keys, in log2 units
# (scale = d^-1/2 log2 e, 0 for a sample with no real key: even weights):
#   s = q k^T scale + bias          (bias: MASKED at a masked key)
#   m = running row max,  l = running sum of 2^(s - m)
#   acc += (2^(s - m) * kept) v     (rescaled by 2^(m_old - m) as m grows)
#   out = acc / l * keep_scale,  lse = m + log2 l   (4 bytes a row, for backward)
@triton.jit(do_not_specialize=["zero"])
def _forward(Q, K, V, O, LSE, KEY_MASK, SCALES, WORDS,
             sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sob, soh, sol, sod,
             smb, sml, sw_bh, sw_r, heads, Lq, Lk, D, scale, keep_scale, zero,
             HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
             EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
             WIDEN: tl.constexpr, DIV_RN: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load(Q + b.to(tl.int64) * sqb + h * sqh, sql, sqd, rows, Lq, dims, D, EVEN_M, EVEN_D,
              False)
    K += b.to(tl.int64) * skb + h * skh
    V += b.to(tl.int64) * svb + h * svh
    WORDS += (b * heads + h).to(tl.int64) * sw_bh
    if HAS_MASK:
        scale = tl.load(SCALES + b)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kT = _load(K, skl, skd, cols, Lk, dims, D, EVEN_N, EVEN_D, True)
        v = _load(V, svl, svd, cols, Lk, dims, D, EVEN_N, EVEN_D, False)
        s = _dot(q, kT, PRECISION, WIDEN) * scale
        if HAS_MASK or not EVEN_N:
            s += _key_bias(KEY_MASK, smb, sml, b, cols, Lk, HAS_MASK, EVEN_N)[None, :]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if DROPOUT:
            # zero is a runtime 0.0: against a constant, LLVM moves the select
            # past the cast to 16 bits, where it costs three instructions a pair.
            p = tl.where(unpack(WORDS, sw_r, tl.program_id(0) * BLOCK_M, start, BLOCK_M, BLOCK_N,
                                0), p, zero)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m = m_new
    if DIV_RN:
        acc = tl.math.div_rn(acc, l[:, None])       # float32: correctly rounded
    else:
        acc = acc / l[:, None]
    _store(O + b.to(tl.int64) * sob + h * soh, sol, sod, rows, Lq, dims, D, acc * keep_scale)
    tl.store(LSE + (b * heads + h).to(tl.int64) * Lq + rows, m + tl.log2(l), mask=rows < Lq)


# ---- backward ----
# Recomputing P = 2^(s - lse) tile by tile, with K = kept, k = keep_scale:
#   dV = k (P * K)^T dO,   dS = k (P * K * dP~ - P * D'),   dP~ = dO V^T
#   D' = rowsum(dO * out) / k   (so that dS is P (dP - D) of the dropped P)
#   dQ = dS K * d^-1/2,   dK = dS^T Q * d^-1/2   (P is 0 at a masked key; dQ
#   and dK are 0 for a sample with no real key: its scores are constant)
# _backward_kv walks the queries for a block of keys in the orientation
# K Q^T (no transpose of P or dS), _backward_dq the keys for a block of
# queries: no atomics.

@triton.jit
def _delta(O, DO, DELTA, sob, soh, sol, sod, sgb, sgh, sgl, sgd, heads, Lq, D, inv_keep,
           EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    o = _load(O + b.to(tl.int64) * sob + h * soh, sol, sod, rows, Lq, dims, D, False, EVEN_D,
              False)
    do = _load(DO + b.to(tl.int64) * sgb + h * sgh, sgl, sgd, rows, Lq, dims, D, False, EVEN_D,
               False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) * inv_keep
    tl.store(DELTA + (b * heads + h).to(tl.int64) * Lq + rows, delta, mask=rows < Lq)


@triton.jit(do_not_specialize=["zero"])
def _backward_dq(Q, K, V, DO, DQ, LSE, DELTA, KEY_MASK, SCALES, WORDS,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
                 sgb, sgh, sgl, sgd, sdb, sdh, sdl, sdd, smb, sml, sw_bh, sw_r,
                 heads, Lq, Lk, D, scale, grad_scale, zero,
                 HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                 WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = (b * heads + h).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load(Q + b.to(tl.int64) * sqb + h * sqh, sql, sqd, rows, Lq, dims, D, EVEN_M, EVEN_D,
              False)
    do = _load(DO + b.to(tl.int64) * sgb + h * sgh, sgl, sgd, rows, Lq, dims, D, EVEN_M, EVEN_D,
               False)
    lse = _row(LSE + bh * Lq, rows, Lq, 0.0, EVEN_M)
    delta = _row(DELTA + bh * Lq, rows, Lq, 0.0, EVEN_M)
    K += b.to(tl.int64) * skb + h * skh
    V += b.to(tl.int64) * svb + h * svh
    WORDS += bh * sw_bh
    if HAS_MASK:
        scale = tl.load(SCALES + b)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kT = _load(K, skl, skd, cols, Lk, dims, D, EVEN_N, EVEN_D, True)
        vT = _load(V, svl, svd, cols, Lk, dims, D, EVEN_N, EVEN_D, True)
        s = _dot(q, kT, PRECISION, WIDEN) * scale
        if HAS_MASK or not EVEN_N:
            s += _key_bias(KEY_MASK, smb, sml, b, cols, Lk, HAS_MASK, EVEN_N)[None, :]
        p = tl.exp2(s - lse[:, None])
        dp = _dot(do, vT, PRECISION, WIDEN)
        if DROPOUT:
            dropped = tl.where(unpack(WORDS, sw_r, tl.program_id(0) * BLOCK_M, start, BLOCK_M,
                                      BLOCK_N, 0), p, zero)
            ds = dropped * dp - p * delta[:, None]
        else:
            ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), PRECISION, WIDEN)
    if HAS_MASK:
        grad_scale = tl.where(scale == 0.0, 0.0, grad_scale)     # a sample with no real key
    _store(DQ + b.to(tl.int64) * sdb + h * sdh, sdl, sdd, rows, Lq, dims, D, dq * grad_scale)


@triton.jit(do_not_specialize=["zero"])
def _backward_kv(Q, K, V, DO, DK, DV, LSE, DELTA, KEY_MASK, SCALES, WORDS_T,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
                 sgb, sgh, sgl, sgd, sdb, sdh, sdl, sdd, smb, sml, sw_bh, sw_r,
                 heads, Lq, Lk, D, scale, grad_scale, keep_scale, zero,
                 HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                 WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, GRADS: tl.constexpr):
    # BLOCK_N keys a program, BLOCK_M queries a step: tiles are keys x queries.
    # GRADS: "kv" both, or "k" / "v" one (two launches where both would not
    # fit the registers: each recomputes P).
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = (b * heads + h).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _load(K + b.to(tl.int64) * skb + h * skh, skl, skd, cols, Lk, dims, D, EVEN_N, EVEN_D,
              False)
    v = _load(V + b.to(tl.int64) * svb + h * svh, svl, svd, cols, Lk, dims, D, EVEN_N, EVEN_D,
              False)
    bias = _key_bias(KEY_MASK, smb, sml, b, cols, Lk, HAS_MASK, EVEN_N)
    Q += b.to(tl.int64) * sqb + h * sqh
    DO += b.to(tl.int64) * sgb + h * sgh
    WORDS_T += bh * sw_bh
    if HAS_MASK:
        scale = tl.load(SCALES + b)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, Lq, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        qT = _load(Q, sql, sqd, rows, Lq, dims, D, EVEN_M, EVEN_D, True)
        do = _load(DO, sgl, sgd, rows, Lq, dims, D, EVEN_M, EVEN_D, False)
        lse = _row(LSE + bh * Lq, rows, Lq, float("inf"), EVEN_M)     # past Lq: P = 0
        delta = _row(DELTA + bh * Lq, rows, Lq, 0.0, EVEN_M)
        s = _dot(k, qT, PRECISION, WIDEN) * scale
        if HAS_MASK or not EVEN_N:
            s += bias[:, None]
        p = tl.exp2(s - lse[None, :])
        dropped = p
        if DROPOUT:
            dropped = tl.where(unpack(WORDS_T, sw_r, tl.program_id(0) * BLOCK_N, start, BLOCK_N,
                                      BLOCK_M, 1), p, zero)
        if GRADS != "k":
            dv += _dot(dropped.to(do.dtype), do, PRECISION, WIDEN)
        if GRADS != "v":
            dp = _dot(v, tl.trans(do), PRECISION, WIDEN)
            if DROPOUT:
                ds = dropped * dp - p * delta[None, :]
            else:
                ds = p * (dp - delta[None, :])
            dk += _dot(ds.to(qT.dtype), tl.trans(qT), PRECISION, WIDEN)
    if GRADS != "v":
        if HAS_MASK:
            grad_scale = tl.where(scale == 0.0, 0.0, grad_scale)     # a sample with no real key
        _store(DK + b.to(tl.int64) * sdb + h * sdh, sdl, sdd, cols, Lk, dims, D, dk * grad_scale)
    if GRADS != "k":
        _store(DV + b.to(tl.int64) * sdb + h * sdh, sdl, sdd, cols, Lk, dims, D, dv * keep_scale)
