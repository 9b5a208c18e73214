"""The kernels that draw keyed masks inside (hetseq/keyed/kernels/): the Triton
path gives the torch path's masks bit for bit, and its outputs and
gradients. On a GPU they run compiled; without one (CI) in Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch

from machinery.settings import require_module
from hetseq.keyed import kernels, randomness
from hetseq.keyed.kernels import philox


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


IEEE = 1e-6       # float32 with IEEE products: only the order of sums differs


def near(ours, reference):
    """Within IEEE (1 + the reference's largest value) everywhere: a gradient
    summed over 64 keys in another order is 1.5e-6 off at values near 1,
    and the explicit path's own order varies with its threads."""
    error = (ours.double() - reference.double()).abs().max().item()
    assert error <= IEEE * (1.0 + reference.abs().max().item()), error


@pytest.fixture(autouse=True)
def kernel_path(monkeypatch):
    require_module("triton")
    monkeypatch.setenv("HETSEQ_KERNELS", "triton")
    if DEVICE.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def site_keys(indices, site="layer.attention", call=0):
    """The draw of ``site`` for samples ``indices`` (kernels.Draw)."""
    keys = randomness.sample_keys(3, 2, indices).to(DEVICE)
    return kernels.Draw(keys, randomness._site_word(site), call)


def torch_path(fn, *args):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HETSEQ_KERNELS", "torch")
        return fn(*args)


# Every shape, dtype and rate, each shape with two of the dtypes and both
# rates between them (not the whole product: each case is seconds in
# Triton's interpreter, and the draw does not depend on the dtype).
DROPOUT_CASES = [(torch.float32, (5,), 0.3), (torch.bfloat16, (5,), 0.6),
                 (torch.float16, (7, 33), 0.3), (torch.float32, (7, 33), 0.6),
                 (torch.bfloat16, (3, 4, 9), 0.3), (torch.float16, (3, 4, 9), 0.6),
                 (torch.float32, (2, 3, 5, 20), 0.6), (torch.bfloat16, (2, 3, 5, 20), 0.3),
                 (torch.float16, (4, 768), 0.6), (torch.float32, (4, 768), 0.3)]


@pytest.mark.parametrize("dtype, shape, p", DROPOUT_CASES)
def test_the_dropout_kernel_keeps_what_the_torch_path_keeps(dtype, shape, p):
    """The same mask (philox.keep's, bit for bit: rows, columns past a
    call's 16, planes of 3-D and 4-D tensors, a cut above 128); each kept
    value x times the keep scale, rounded once from float32 (torch's CPU
    dropout rounds the scale to the dtype first: an ulp in bf16 and fp16)."""
    keys = site_keys([4, 11, 2])
    x = torch.randn(3, *shape, device=DEVICE).to(dtype).requires_grad_()
    kernel = kernels.dropout(x, keys, p)
    keep = philox.keep(keys.keys, keys.site, philox.cut(p), shape)
    assert torch.equal(torch_path(kernels.dropout, x, keys, p) != 0, keep)
    assert torch.equal(kernel != 0, keep)
    scale = philox.keep_scale(philox.cut(p))
    same_values(kernel, (x.float() * keep * scale).to(dtype))
    grad = torch.randn_like(kernel)
    (kernel_grad,) = torch.autograd.grad(kernel, x, grad)
    assert torch.equal(kernel_grad != 0, keep)        # backward draws the same mask again
    same_values(kernel_grad, (grad.float() * keep * scale).to(dtype))


def same_values(ours, expected):
    """Equal; in bfloat16 on a CPU within an ulp: Triton's interpreter rounds
    float32 to bfloat16 toward zero, a GPU to the nearest."""
    if ours.dtype == torch.bfloat16 and ours.device.type != "cuda":
        torch.testing.assert_close(ours, expected, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(ours, expected)


def qkv(B, H, L, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(DEVICE, dtype).requires_grad_()
            for _ in range(3)]


def kept(keys, q, k, key_mask=None, p=0.25):
    """Which probabilities the kernel kept: with v the identity (d = L) the
    output is the dropped probability matrix itself."""
    L = k.shape[2]
    v = torch.eye(L, device=DEVICE, dtype=q.dtype).expand(q.shape[0], q.shape[1], L, L)
    with torch.no_grad():
        return kernels.attention(q.detach(), k.detach(), v, key_mask, keys, p) != 0


# (Each card's tiles at 72: two column tiles, the second mostly padding, at
# 0.37x the interpreter's cost of 100, where v's head dimension is L.)
@pytest.mark.parametrize("length, card", [(32, None), (100, None), (72, (9, 0)), (72, (8, 0)),
                                          (64, (8, 0))],
                         ids=["32", "100", "72 on sm_90's tiles", "72 on sm_80's tiles",
                              "64 on sm_80's tiles"])
def test_the_attention_kernel_drops_the_masks_of_randomness_bit_for_bit(monkeypatch, length,
                                                                         card):
    """Its keep bits, drawn once and read in both orientations (forward and
    dQ queries x keys, dK/dV keys x queries), are philox.keep's of (head,
    query, key): over several tiles and words, and past the padding; with
    this device's tiles and (in bf16) with each card's, whose tiles of 32
    columns read half words. With v the identity (d = L) the output is the
    dropped probabilities and dV, for dO the identity, their transpose."""
    from hetseq.keyed.kernels import flash
    dtype = torch.float32
    if card is not None:
        monkeypatch.setattr(flash, "_capability", lambda x: card)
        dtype = torch.bfloat16
    keys = site_keys([0, 7, 3])
    q, k, _ = qkv(3, 2, length, length, dtype)
    v = torch.eye(length, device=DEVICE, dtype=dtype).repeat(3, 2, 1, 1).requires_grad_()
    expected = philox.keep(keys.keys, keys.site, philox.cut(0.25), [2, length, length])
    assert 0.2 < 1 - expected.float().mean().item() < 0.3
    out = kernels.attention(q, k, v, None, keys, 0.25)
    assert torch.equal(out != 0, expected)
    grad = torch.eye(length, device=DEVICE, dtype=dtype).repeat(3, 2, 1, 1)
    dq, dv = torch.autograd.grad(out, (q, v), grad)
    assert torch.equal(dv != 0, expected.transpose(-1, -2))
    # dQ reads the bits on its own: the explicit path's, within bf16's rounding
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = kernels.explicit_attention(*wide, None, keys, 0.25)
    (dq_reference,) = torch.autograd.grad(reference, wide[0], grad.float())
    scale = dq_reference.abs().max().item()
    assert (dq.float() - dq_reference).abs().max().item() < (1e-5 if card is None else 2e-2) * scale
    words, words_t = kernels.ops.keyed_attention(
        q, k, v, None, keys.keys, keys.site, philox.cut(0.25), 1.0, length ** -0.5)[2:]
    for bits, mask in ((words, expected), (words_t, expected.transpose(-1, -2))):
        assert torch.equal(unpacked(bits, length, ORDERS[bits is words_t]), mask)


ORDERS = [lambda r3, c0, c3, c4, c5: 16 * c5 + 8 * c0 + 4 * r3 + 2 * c4 + 1 - c3,
          lambda r3, c0, c3, c4, c5: 16 * c5 + 8 * c4 + 4 * c3 + 2 * c0 + 1 - r3]


def unpacked(words, length, order):
    """[B, heads, length, length] bools from keep words (triton_draw's layout),
    read here in Python: each element's word and bit, as docs/gpu.md says."""
    r = torch.arange(length)[:, None]
    c = torch.arange(length)[None, :]
    word = words.cpu()[:, (8 * (r // 16) + r % 8), 4 * (c // 64) + (c // 2) % 4]
    bit = order((r >> 3) & 1, c & 1, (c >> 3) & 1, (c >> 4) & 1, (c >> 5) & 1)
    kept = (word.long() >> bit) & 1
    return kept.view(-1, 2, length, length).to(DEVICE) != 0


@pytest.mark.parametrize("d", [32, 40, 64, 128])
@pytest.mark.parametrize("masked", [False, True], ids=["every key", "padded keys"])
def test_attention_outputs_and_gradients_equal_the_explicit_path(d, masked):
    keys = site_keys([5, 1, 9])
    q, k, v = qkv(3, 2, 37, d)
    key_mask = None
    if masked:      # sample 1 padded after 20 keys, sample 2 without a real key
        key_mask = torch.ones(3, 37, dtype=torch.bool, device=DEVICE)
        key_mask[1, 20:] = False
        key_mask[2] = False
    out = kernels.attention(q, k, v, key_mask, keys, 0.25)
    reference = kernels.explicit_attention(q, k, v, key_mask, keys, 0.25)
    near(out, reference)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(reference, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        near(a, b)


@pytest.mark.parametrize("lq, lk", [(80, 80), (70, 100), (100, 70), (150, 130)])
def test_attention_over_several_tiles_equals_the_explicit_path(lq, lk):
    """More queries and keys than one tile (64 on a CPU): the running max and
    sum rescale across tiles, each tile's mask is drawn at its own
    positions; queries and keys of different lengths (cross-attention)."""
    keys = site_keys([3, 8])
    q = qkv(2, 2, lq, 64)[0]
    k, v = qkv(2, 2, lk, 64, seed=1)[1:]
    key_mask = torch.arange(lk, device=DEVICE)[None, :] < torch.tensor([[lk], [lk - 13]],
                                                                        device=DEVICE)
    out = kernels.attention(q, k, v, key_mask, keys, 0.25)
    reference = kernels.explicit_attention(q, k, v, key_mask, keys, 0.25)
    near(out, reference)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(reference, (q, k, v), grad)):
        near(a, b)


def test_a_mask_that_is_not_bool_is_refused():
    q, k, v = qkv(2, 2, 8, 16)
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        kernels.attention(q, k, v, torch.ones(2, 8, dtype=torch.long, device=DEVICE),
                          site_keys([1, 2]), 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_in_narrow_dtypes_is_the_explicit_path_rounded(dtype):
    """bf16/fp16 inputs: the kernel accumulates in float32, so it lands within
    the narrow dtype's rounding of the explicit path run in float32."""
    keys = site_keys([2, 6])
    q, k, v = qkv(2, 2, 48, 64, dtype)
    out = kernels.attention(q, k, v, None, keys, 0.1)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = kernels.explicit_attention(*wide, None, keys, 0.1)
    assert out.dtype == dtype
    assert (out.float() - reference).abs().max().item() < 2e-2
    grad = torch.randn_like(reference)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad.to(dtype)),
                    torch.autograd.grad(reference, wide, grad)):
        assert (a.float() - b).abs().max().item() < 5e-2 * (1 + b.abs().max().item())


def test_a_samples_attention_mask_is_its_own_wherever_it_sits():
    """The same sample permuted within its batch, alone, or padded to a
    longer sequence keeps its mask: the mask comes from its key and the
    positions, never from its slot in the batch or the batch's length."""
    q, k, _ = qkv(3, 2, 24, 24, seed=1)
    batch = kept(site_keys([10, 20, 30]), q, k)
    order = [2, 0, 1]
    permuted = kept(site_keys([30, 10, 20]), q[order], k[order])
    assert torch.equal(permuted, batch[order])
    alone = kept(site_keys([20]), q[1:2], k[1:2])
    assert torch.equal(alone[0], batch[1])
    pad = lambda t: torch.cat([t[1:2], torch.randn(1, 2, 7, 24, device=DEVICE)], 2)  # noqa: E731
    key_mask = torch.arange(31, device=DEVICE)[None, :] < 24
    padded = kept(site_keys([20]), pad(q), pad(k), key_mask)
    assert torch.equal(padded[0, :, :24, :24], batch[1])
    assert not torch.equal(batch[0], batch[1])
