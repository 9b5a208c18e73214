"""The keyed draws as PyTorch custom operators (torch.library): autograd
knows their backward and torch.compile traces a forward that calls them
without a graph break (each has a fake implementation for the shapes).
Backward draws the masks again from the keys instead of saving them.
docs/gpu.md, "The operators".
"""

from typing import Optional

import torch
from torch import Tensor

from hetseq.kernels import words


@torch.library.custom_op("hetseq::site_keys", mutates_args=())
def site_keys(keys: Tensor, site_word: int, call: int) -> Tensor:
    """Each sample's key for the ``call``-th draw of the site whose word is
    ``site_word``: an operator, so that no compiler rewrites its wrapping
    int32 arithmetic (signed overflow is undefined in C++)."""
    return words.absorb_(words.absorb_(keys.clone(), words.signed(site_word)),
                         words.signed(call))


@site_keys.register_fake
def _(keys, site_word, call):
    return torch.empty_like(keys)


@torch.library.custom_op("hetseq::keyed_bits", mutates_args=())
def keyed_bits(site_keys: Tensor, shape: list[int]) -> Tensor:
    return words.bits(site_keys, shape)


@keyed_bits.register_fake
def _(site_keys, shape):
    return site_keys.new_empty((site_keys.shape[0], *shape), dtype=torch.int32)


# ---- elementwise dropout (Triton) ----

@torch.library.custom_op("hetseq::keyed_dropout", mutates_args=())
def keyed_dropout(x: Tensor, keys: Tensor, word: int, call: int, threshold: int,
                  scale: float) -> Tensor:
    from hetseq.kernels import triton_dropout
    return triton_dropout.dropout(x, keys, word, call, threshold, scale)


@keyed_dropout.register_fake
def _(x, keys, word, call, threshold, scale):
    return torch.empty_like(x.contiguous())      # as the kernel allocates it


def _dropout_context(ctx, inputs, output):
    _, keys, ctx.word, ctx.call, ctx.threshold, ctx.scale = inputs
    ctx.save_for_backward(keys)


def _dropout_backward(ctx, grad):
    # y = x * kept * scale, so dx = grad * kept * scale: the same op on the gradient.
    (keys,) = ctx.saved_tensors
    dx = keyed_dropout(grad, keys, ctx.word, ctx.call, ctx.threshold, ctx.scale)
    return dx, None, None, None, None, None


keyed_dropout.register_autograd(_dropout_backward, setup_context=_dropout_context)


# ---- attention (Triton) ----

@torch.library.custom_op("hetseq::keyed_attention", mutates_args=())
def keyed_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], keys: Tensor,
                    word: int, call: int, threshold: int, keep_scale: float,
                    scale: float) -> tuple[Tensor, Tensor]:
    from hetseq.kernels import triton_attention
    return triton_attention.forward(q, k, v, key_mask, (keys, word, call), threshold,
                                    keep_scale, scale)


def _heads_layout(x, length):
    B, H, _, D = x.shape
    return x.new_empty(B, length, H, D).transpose(1, 2)


@keyed_attention.register_fake
def _(q, k, v, key_mask, keys, word, call, threshold, keep_scale, scale):
    B, H, Lq, _ = q.shape
    return _heads_layout(q, Lq), q.new_empty(2, B * H, Lq, dtype=torch.float32)


@torch.library.custom_op("hetseq::keyed_attention_backward", mutates_args=())
def keyed_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             stats: Tensor, key_mask: Optional[Tensor], keys: Tensor, word: int,
                             call: int, threshold: int, keep_scale: float,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from hetseq.kernels import triton_attention
    return triton_attention.backward(grad, q, k, v, out, stats, key_mask, (keys, word, call),
                                     threshold, keep_scale, scale)


@keyed_attention_backward.register_fake
def _(grad, q, k, v, out, stats, key_mask, keys, word, call, threshold, keep_scale, scale):
    return (_heads_layout(q, q.shape[2]), _heads_layout(k, k.shape[2]),
            _heads_layout(v, v.shape[2]))


def _attention_context(ctx, inputs, output):
    q, k, v, key_mask, keys, ctx.word, ctx.call, ctx.threshold, ctx.keep_scale, ctx.scale = inputs
    ctx.mark_non_differentiable(output[1])          # the rows' max and sum
    ctx.save_for_backward(q, k, v, *output, key_mask, keys)


def _attention_backward(ctx, grad, _grad_stats):
    q, k, v, out, stats, key_mask, keys = ctx.saved_tensors
    dq, dk, dv = keyed_attention_backward(grad, q, k, v, out, stats, key_mask, keys, ctx.word,
                                          ctx.call, ctx.threshold, ctx.keep_scale, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


keyed_attention.register_autograd(_attention_backward, setup_context=_attention_context)
