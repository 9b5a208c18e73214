"""The keyed draws as PyTorch custom operators (torch.library): autograd
knows their backward and torch.compile traces a forward that calls them
without a graph break (each has a fake implementation for the shapes).
Elementwise dropout draws its mask again in backward; attention keeps its
mask as bits (L^2 / 4 bytes a head) and never draws in backward.
docs/gpu.md, "The operators".
"""

from typing import Optional

import torch
from torch import Tensor

from hetseq.keyed.kernels import philox


@torch.library.custom_op("hetseq::keep_mask", mutates_args=())
def keep_mask(keys: Tensor, site: int, cut: int, shape: list[int]) -> Tensor:
    """Which elements of a [len(keys), *shape] tensor are kept (the torch
    path): an operator, so that no compiler rewrites its wrapping integer
    arithmetic (signed overflow is undefined in C++)."""
    return philox.keep(keys, site, cut, shape)


@keep_mask.register_fake
def _(keys, site, cut, shape):
    return keys.new_empty((keys.shape[0], *shape), dtype=torch.bool)


@torch.library.custom_op("hetseq::keyed_words", mutates_args=())
def keyed_words(keys: Tensor, site: int, shape: list[int]) -> Tensor:
    """32 random bits (int32) per element of a [len(keys), *shape] tensor."""
    return philox.draw_words(keys, site, shape)


@keyed_words.register_fake
def _(keys, site, shape):
    return keys.new_empty((keys.shape[0], *shape), dtype=torch.int32)


# ---- elementwise dropout (Triton) ----

@torch.library.custom_op("hetseq::keyed_dropout", mutates_args=())
def keyed_dropout(x: Tensor, keys: Tensor, site: int, cut: int, scale: float) -> Tensor:
    from hetseq.keyed.kernels import triton_dropout
    return triton_dropout.dropout(x, keys, site, cut, scale)


@keyed_dropout.register_fake
def _(x, keys, site, cut, scale):
    return torch.empty_like(x.contiguous())      # as the kernel allocates it


def _dropout_context(ctx, inputs, output):
    _, keys, ctx.site, ctx.cut, ctx.scale = inputs
    ctx.save_for_backward(keys)


def _dropout_backward(ctx, grad):
    # y = x * kept * scale, so dx = grad * kept * scale: the same op on the gradient.
    (keys,) = ctx.saved_tensors
    return keyed_dropout(grad, keys, ctx.site, ctx.cut, ctx.scale), None, None, None, None


keyed_dropout.register_autograd(_dropout_backward, setup_context=_dropout_context)


# ---- attention (Triton) ----

@torch.library.custom_op("hetseq::keyed_attention", mutates_args=())
def keyed_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], keys: Tensor,
                    site: int, cut: int, keep_scale: float,
                    scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, each row's log-sum-exp, the keep bits in both orders)."""
    from hetseq.keyed.kernels import flash
    return flash.forward(q, k, v, key_mask, keys, site, cut, keep_scale, scale)


def _heads_layout(x, length):
    B, H, _, D = x.shape
    return x.new_empty(B, length, H, D).transpose(1, 2)


@keyed_attention.register_fake
def _(q, k, v, key_mask, keys, site, cut, keep_scale, scale):
    from hetseq.keyed.kernels import flash
    B, H, Lq, _ = q.shape
    words_f, words_t = flash.keep_words(q, k)
    return (_heads_layout(q, Lq), q.new_empty(B * H, Lq, dtype=torch.float32), words_f,
            words_t)


@torch.library.custom_op("hetseq::keyed_attention_backward", mutates_args=())
def keyed_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, words_f: Tensor, words_t: Tensor,
                             key_mask: Optional[Tensor], keep_scale: float,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from hetseq.keyed.kernels import flash
    return flash.backward(grad, q, k, v, out, lse, words_f, words_t, key_mask, keep_scale,
                              scale)


@keyed_attention_backward.register_fake
def _(grad, q, k, v, out, lse, words_f, words_t, key_mask, keep_scale, scale):
    return (_heads_layout(q, q.shape[2]), _heads_layout(k, k.shape[2]),
            _heads_layout(v, v.shape[2]))


def _attention_context(ctx, inputs, output):
    q, k, v, key_mask, _, _, _, ctx.keep_scale, ctx.scale = inputs
    out, lse, words_f, words_t = output
    ctx.mark_non_differentiable(lse, words_f, words_t)
    ctx.save_for_backward(q, k, v, out, lse, words_f, words_t, key_mask)


def _attention_backward(ctx, grad, *_):
    q, k, v, out, lse, words_f, words_t, key_mask = ctx.saved_tensors
    dq, dk, dv = keyed_attention_backward(grad, q, k, v, out, lse, words_f, words_t, key_mask,
                                          ctx.keep_scale, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


keyed_attention.register_autograd(_attention_backward, setup_context=_attention_context)
