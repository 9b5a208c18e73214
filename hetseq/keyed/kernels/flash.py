"""The launches of triton_attention.py's kernels: their tiles, chosen once
per (kernel, head dimension, length, dtype, card) and never by timing, so
every run and every rank computes the same bits; the keep bits' memory;
the grids. Each launch is a ``Launch``, which bench/kernel_report.py
compiles for a GPU on a CPU, exactly as a call here specializes it."""

import dataclasses
import math

import torch
import triton

from hetseq.keyed.kernels import triton_attention as kernels
from hetseq.keyed.kernels import words

LOG2E = math.log2(math.e)
MAX_BATCH = 65535   # the grid's third axis: larger batches run in slices
# (BLOCK_M, BLOCK_N, warps, stages) per kernel and head-dimension class,
# chosen from their SASS on sm_80 and sm_90 (bench/kernel_report.py
# --all-tiles: no spills in bf16 and fp16; a warp owns 16 rows of a tile, so
# no elementwise work is done twice). BLOCK_N of the forward and dQ, BLOCK_M
# of dK/dV (their tiles' columns) are 32 or a multiple of 64 (a word's span
# or half); at d 128 dK and dV run as two launches (backward_launches).
TILES = {
    "forward": {64: (128, 64, 8, 2), 128: (128, 64, 8, 2)},
    "backward_dq": {64: (128, 64, 8, 2), 128: (64, 64, 4, 2)},
    "backward_kv": {64: (64, 64, 4, 2), 128: (64, 64, 4, 1)},   # BLOCK_M queries, BLOCK_N keys
}
# sm_8x: mma.sync holds its operands in registers, so the backward kernels
# take 32 columns a step (a word's half) where 64 spill.
TILES_SM80 = {
    "forward": {64: (128, 64, 8, 2), 128: (128, 32, 8, 2)},
    "backward_dq": {64: (128, 32, 8, 2), 128: (64, 32, 4, 2)},
    "backward_kv": {64: (32, 64, 4, 2), 128: (64, 64, 4, 1)},
}
SHORT = (64, 64, 4, 2)      # every kernel where queries and keys fit 64 (d 64)
# float32 with IEEE products multiplies on the FMA units, and every tile of
# it spills: these are the least (HETSEQ_KERNELS=triton only; auto takes
# float32 attention to the explicit path, kernels.attention).
FLOAT32 = {"forward": (32, 64, 4, 1), "backward_dq": (32, 64, 4, 1),
           "backward_kv": (64, 16, 4, 1)}
# Triton's interpreter (tensors on a CPU) runs programs one after another,
# each as numpy calls: one tile of 64 x 64 takes the fewest programs and
# steps. It is a card of its own (INTERPRETED), with the same bits.
INTERPRETER = (64, 64, 4, 1)
INTERPRETED = (0, 0)
DRAW = (128, 4)             # _draw's units (16 x 32 elements each) and warps
DELTA = (64, 4)             # _delta's rows and warps


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **constants)``."""
    name: str
    kernel: object
    grid: tuple
    args: tuple
    constants: dict

    def __call__(self):
        self.kernel[self.grid](*self.args, **self.constants)


def tiles(kernel, d, length, dtype, capability):
    """The tile of ``kernel`` for head dimension ``d``, the longer of the
    query and key lengths, the inputs' dtype and the card: sm_80 and newer
    share the table; INTERPRETED is Triton's interpreter."""
    if capability == INTERPRETED:
        return INTERPRETER
    if dtype == torch.float32:
        return FLOAT32[kernel]
    if length <= 64 and d <= 64 and capability >= (9, 0):
        return SHORT
    return (TILES if capability >= (9, 0) else TILES_SM80)[kernel][64 if d <= 64 else 128]


def _name(kernel, tile, dropout):
    return f"attention_{kernel}_{tile[0]}x{tile[1]}x{tile[2]}" + \
        ("" if dropout is None else "-keyed" if dropout else "-plain")


def _arithmetic(q):
    """tl.dot's precision: float32 as torch's matmul computes it (IEEE unless
    TF32 is allowed), the narrow dtypes as they are; bfloat16 widened in the
    interpreter (triton_attention._dot); float32 divided correctly rounded."""
    fp32 = q.dtype == torch.float32
    ieee = fp32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(PRECISION="ieee" if ieee else "tf32", DIV_RN=fp32,
                WIDEN=q.dtype == torch.bfloat16 and q.device.type != "cuda")


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()]


def _like_heads(x, length=None):
    """An empty [batch, heads, L, d] tensor laid out as [batch, L, heads, d],
    the layout the model reshapes the context from without a copy."""
    B, H, L, D = x.shape
    return torch.empty(B, length or L, H, D, dtype=x.dtype, device=x.device).transpose(1, 2)


def _padding(q, k, capability=None):
    """(queries, keys) the keep bits cover: the lengths padded to every tile
    that reads them and to 64, a word's span (the draw's units, 64 x 32)."""
    D, length = q.shape[-1], max(q.shape[2], k.shape[2])
    forward, dq, kv = (tiles(kernel, D, length, q.dtype, _card(q, capability))
                       for kernel in ("forward", "backward_dq", "backward_kv"))
    queries = max(64, forward[0], dq[0], kv[0])
    keys = max(64, forward[1], dq[1], kv[1])
    return triton.cdiv(q.shape[2], queries) * queries, triton.cdiv(k.shape[2], keys) * keys


def keep_words(q, k, capability=None):
    """Empty keep bits for q and k: (queries x keys, keys x queries), one
    int32 word per 32 elements (L^2 / 8 bytes a head each)."""
    B, H = q.shape[:2]
    queries, keys = _padding(q, k, capability)
    return (torch.empty(B * H, queries // 2, keys // 16, dtype=torch.int32, device=q.device),
            torch.empty(B * H, keys // 2, queries // 16, dtype=torch.int32, device=q.device))


def masks(key_mask, scale2, device):
    """(key bytes, per-sample scales) for a [batch, Lk] bool key mask: a
    sample with no real key attends to every key with scale 0 (even
    weights, as the explicit path gives it); (None, None) without a mask."""
    if key_mask is None:
        return None, None
    live = key_mask.any(1)
    attend = (key_mask | ~live[:, None]).view(torch.uint8)
    return attend, torch.where(live, scale2, 0.0).to(device=device, dtype=torch.float32)


def _mask_args(attend, scales, q):
    """(KEY_MASK, SCALES, its strides) as the kernels take them."""
    if attend is None:
        return q, q, 0, 0          # any pointers: never read
    return attend, scales, attend.stride(0), attend.stride(1)


def _constants(kernel, q, k, attend, dropout, capability, forward=False):
    """(tile, the kernel's constants) for these inputs."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    m, n, warps, stages = tile = tiles(kernel, D, max(Lq, Lk), q.dtype, _card(q, capability))
    block_d = max(16, triton.next_power_of_2(D))
    arithmetic = _arithmetic(q)
    if not forward:
        del arithmetic["DIV_RN"]
    return tile, dict(HAS_MASK=attend is not None, DROPOUT=dropout, EVEN_M=Lq % m == 0,
                      EVEN_N=Lk % n == 0, EVEN_D=D == block_d, BLOCK_M=m, BLOCK_N=n,
                      BLOCK_D=block_d, num_warps=warps, num_stages=stages, **arithmetic)


def draw_launch(keys, site, cut, heads, words_f, words_t, capability=None):
    """The keep bits of one call: philox.keep's bytes of (head, query, key)."""
    q_units, k_blocks = words_f.shape[1] * 2 // 16, words_f.shape[2] * 16 // 32
    units = words_f.shape[0] * q_units * k_blocks
    per_program, warps = DRAW
    if _card(keys, capability) == INTERPRETED:     # programs one by one, each as numpy
        per_program = min(triton.next_power_of_2(units), 4096)
    args = (keys, words_f, words_t, words.signed(site), (cut % 128) * 0x01010101, heads, units,
            q_units, k_blocks, *words_f.stride()[:2], *words_t.stride()[:2])
    return Launch(f"attention_dropout_draw_{per_program}x{warps}", kernels._draw,
                  (triton.cdiv(units, per_program),), args,
                  dict(LOW_CUT=cut < 128, UNITS=per_program, num_warps=warps))


def forward_launch(q, k, v, out, lse, attend, scales, words_f, keep_scale, scale,
                   dropout=True, capability=None):
    """``capability``: the card's (bench/kernel_report.py), else q's device's."""
    B, H, Lq, D = q.shape
    tile, constants = _constants("forward", q, k, attend, dropout, capability, forward=True)
    bits = words_f if dropout else q
    args = (q, k, v, out, lse, *_mask_args(attend, scales, q)[:2], bits,
            *_strides(q, k, v, out), *_mask_args(attend, scales, q)[2:],
            *(bits.stride()[:2] if dropout else (0, 0)), H, Lq, k.shape[2], D,
            scale * LOG2E, keep_scale if dropout else 1.0, 0.0)
    return Launch(_name("forward", tile, dropout), kernels._forward,
                  (triton.cdiv(Lq, tile[0]), H, B), args, constants)


def delta_launch(out, grad, delta, keep_scale):
    B, H, Lq, D = out.shape
    rows, warps = DELTA
    block_d = max(16, triton.next_power_of_2(D))
    args = (out, grad, delta, *_strides(out, grad), H, Lq, D, 1.0 / keep_scale)
    return Launch(f"attention_backward_delta_{rows}x{warps}", kernels._delta,
                  (triton.cdiv(Lq, rows), H, B), args,
                  dict(EVEN_D=D == block_d, BLOCK_M=rows, BLOCK_D=block_d, num_warps=warps))


def backward_launches(grad, q, k, v, lse, delta, attend, scales, words_f, words_t,
                      keep_scale, scale, dq, dk, dv, dropout=True, capability=None):
    """dQ's launch and dK/dV's (after delta_launch's): scale is d^-1/2. At
    head dimensions over 64, dK and dV run as two launches (each holds a
    [keys, d] accumulator in registers: both would spill)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    keep_scale = keep_scale if dropout else 1.0
    mask, scales_, smb, sml = _mask_args(attend, scales, q)
    launches = []
    kv = [("backward_kv", (dk, dv), words_t, Lk, grads) for grads in
          (("k", "v") if D > 64 else ("kv",))]
    for kernel, outputs, bits, length, *grads in [("backward_dq", (dq,), words_f, Lq)] + kv:
        tile, constants = _constants(kernel, q, k, attend, dropout, capability)
        bits = bits if dropout else q
        extra = (keep_scale,) if grads else ()
        if grads:
            constants["GRADS"] = grads[0]
        args = (q, k, v, grad, *outputs, lse, delta, mask, scales_, bits,
                *_strides(q, k, v, grad, outputs[0]), smb, sml,
                *(bits.stride()[:2] if dropout else (0, 0)), H, Lq, Lk, D, scale * LOG2E,
                keep_scale * scale, *extra, 0.0)
        block = tile[0] if kernel == "backward_dq" else tile[1]
        name = _name(kernel + ("" if not grads or grads[0] == "kv" else "_" + grads[0]), tile,
                     dropout)
        launches.append(Launch(name, getattr(kernels, "_" + kernel),
                               (triton.cdiv(length, block), H, B), args, constants))
    return launches


def _capability(x):
    """x's card: its CUDA capability, or INTERPRETED on a CPU."""
    return torch.cuda.get_device_capability(x.device) if x.is_cuda else INTERPRETED


def _card(x, capability):
    return _capability(x) if capability is None else capability


def _batches(batch):
    """Slices of the batch the grid's third axis takes."""
    return [slice(start, min(start + MAX_BATCH, batch)) for start in range(0, batch, MAX_BATCH)]


def forward(q, k, v, key_mask, keys, site, cut, keep_scale, scale):
    """(out [B, heads, Lq, d], lse [B * heads, Lq], keep bits, keep bits
    transposed): attention with its probabilities' dropout drawn for the
    samples' ``keys`` and the site's word ``site``, cut at ``cut``."""
    B, H, Lq, _ = q.shape
    out = _like_heads(q)
    lse = torch.empty(B * H, Lq, dtype=torch.float32, device=q.device)
    words_f, words_t = keep_words(q, k)
    attend, scales = masks(key_mask, scale * LOG2E, q.device)
    for part in _batches(B):
        heads = slice(part.start * H, part.stop * H)
        draw_launch(keys[part], site, cut, H, words_f[heads], words_t[heads])()
        forward_launch(q[part], k[part], v[part], out[part], lse[heads], _part(attend, part),
                       _part(scales, part), words_f[heads], keep_scale, scale)()
    return out, lse, words_f, words_t


def backward(grad, q, k, v, out, lse, words_f, words_t, key_mask, keep_scale, scale):
    """(dq, dk, dv) of ``forward``'s output: its keep bits, no draw."""
    B, H, Lq, _ = q.shape
    delta = torch.empty_like(lse)
    dq, dk, dv = _like_heads(q), _like_heads(k), _like_heads(v)
    attend, scales = masks(key_mask, scale * LOG2E, q.device)
    for part in _batches(B):
        heads = slice(part.start * H, part.stop * H)
        delta_launch(out[part], grad[part], delta[heads], keep_scale)()
        for launch in backward_launches(grad[part], q[part], k[part], v[part], lse[heads],
                                        delta[heads], _part(attend, part), _part(scales, part),
                                        words_f[heads], words_t[heads], keep_scale, scale,
                                        dq[part], dk[part], dv[part]):
            launch()
    return dq, dk, dv


def _part(x, part):
    return None if x is None else x[part]
