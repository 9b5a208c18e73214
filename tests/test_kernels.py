"""The kernels that draw keyed masks inside (hetseq/kernels/): the Triton
path gives the torch path's masks bit for bit, and its outputs and
gradients. On a GPU they run compiled; without one (CI) in Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1)."""

import pytest
import torch

from conftest import require_module
from hetseq import kernels, randomness
from hetseq.kernels import ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IEEE = 1e-6       # float32 with IEEE products: only the order of sums differs


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


# ---- elementwise dropout ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5,), (7, 33), (3, 4, 9)])
def test_the_dropout_kernel_keeps_what_the_torch_path_keeps(dtype, shape):
    """The same mask; each kept value x / (1 - p) rounded once from float32
    (torch's CPU dropout rounds 1 / (1 - p) to the dtype first, which differs
    in bfloat16 and float16 by an ulp)."""
    keys = site_keys([4, 11, 2])
    x = torch.randn(3, *shape, device=DEVICE).to(dtype).requires_grad_()
    kernel = kernels.dropout(x, keys, 0.3)
    reference = torch_path(kernels.dropout, x, keys, 0.3)
    keep = reference != 0
    assert torch.equal(kernel != 0, keep)
    same_values(kernel, (x.float() * keep * (1 / 0.7)).to(dtype))
    grad = torch.randn_like(kernel)
    (kernel_grad,) = torch.autograd.grad(kernel, x, grad)
    assert torch.equal(kernel_grad != 0, keep)        # backward draws the same mask again
    same_values(kernel_grad, (grad.float() * keep * (1 / 0.7)).to(dtype))


def same_values(ours, expected):
    """Equal; in bfloat16 on a CPU within an ulp: Triton's interpreter rounds
    float32 to bfloat16 toward zero, a GPU to the nearest."""
    if ours.dtype == torch.bfloat16 and ours.device.type != "cuda":
        torch.testing.assert_close(ours, expected, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(ours, expected)


# ---- attention ----

def qkv(B, H, L, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(DEVICE, dtype).requires_grad_()
            for _ in range(3)]


def kept(keys, q, k, key_mask=None, p=0.25):
    """Which probabilities the kernel kept: with v the identity (d = L) the
    output is the dropped probability matrix itself."""
    L = k.shape[2]
    v = torch.eye(L, device=DEVICE).expand(q.shape[0], q.shape[1], L, L)
    with torch.no_grad():
        return kernels.attention(q.detach(), k.detach(), v, key_mask, keys, p) != 0


def test_the_attention_kernel_draws_the_masks_of_randomness_bit_for_bit():
    keys = site_keys([0, 7, 3])
    q, k, _ = qkv(3, 2, 32, 32)
    expected = ops.keyed_bits(keys.site_keys(), [2, 32, 32]) >= kernels.threshold(0.25)
    assert torch.equal(kept(keys, q, k), expected)
    assert 0.2 < 1 - expected.float().mean().item() < 0.3


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
    torch.testing.assert_close(out, reference, rtol=IEEE, atol=IEEE)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(reference, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=IEEE, atol=IEEE)


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
    torch.testing.assert_close(out, reference, rtol=IEEE, atol=IEEE)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=IEEE, atol=IEEE)


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


# ---- what a GPU would run ----

COMPILE_FOR_H100 = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hetseq.kernels import triton_attention, triton_dropout
dtype = sys.argv[1]
pointer = "*" + dtype
types = {"STATS": "*fp32", "DELTA": "*fp32", "KEY_MASK": "*u8", "KEYS": "*i32",
         "ROW_WORDS": "*i32", "scale": "fp32", "keep_scale": "fp32"}
builds = [(triton_dropout._dropout, dict(BLOCK_R=2, BLOCK_C=1024), 4)]
for (kernel, d), tiles in triton_attention.CONFIGS.items():
    for (m, n, warps), masked in ((tiles[0], True), (tiles[-1], False)):
        builds.append((kernel, dict(HAS_MASK=masked, DROPOUT=True, BLOCK_M=m, BLOCK_N=n,
                                    BLOCK_D=d, LENGTH_CLASS=128, WIDEN=False,
                                    PRECISION="ieee" if dtype == "fp32" else "tf32"), warps))
for kernel, constants, warps in builds:
    signature = {name: "constexpr" if name in constants else
                 types.get(name, pointer if name.isupper() and name != "D" else "i32")
                 for name in kernel.arg_names}
    binary = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 2})
    assert binary.asm["cubin"]
    print("compiled", kernel.fn.__name__, constants.get("BLOCK_D", ""), flush=True)
"""


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_an_h100(dtype):
    """Triton's interpreter is lenient; a GPU's compiler is not. Each kernel
    compiles to an sm_90 binary here, without a GPU (ptxas ships with
    Triton), in a process where the interpreter is off."""
    import subprocess
    import sys

    from conftest import ROOT, child_env
    require_module("triton")
    env = child_env({"TRITON_DEFAULT_FP_FUSION": "1"})
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100, dtype], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 1 + 2 * len(_attention_configs())


def _attention_configs():
    from hetseq.kernels import triton_attention
    return triton_attention.CONFIGS


# ---- torch.compile ----

@pytest.fixture
def dynamo_counters():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_a_compiled_bert_forward_draws_in_one_graph(monkeypatch, dynamo_counters, path):
    """Keyed dropout of 2-D (the classifier), 3-D (hidden states) and 4-D
    (attention) tensors traces into one graph: no graph break, no recompile
    from one update (other keys, the same shapes) to the next, and the
    compiled forward's output and gradients are the eager ones."""
    from hetseq.bert import BertConfig, BertForSequenceClassification
    monkeypatch.setenv("HETSEQ_KERNELS", path)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32), 3).to(DEVICE).train()
    randomness.name_sites(model)
    compiled = torch.compile(model.forward, backend="aot_eager")
    for update in range(3):
        g = torch.Generator().manual_seed(update)
        ids = torch.randint(1, 40, (4, 16), generator=g).to(DEVICE)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        results = []
        for forward in (compiled, model.forward):
            with randomness.using(randomness.sample_keys(5, 1, range(4 * update, 4 * update + 4))
                                  .to(DEVICE)):
                logits = forward(ids, torch.zeros_like(ids), mask)
            results.append((logits, torch.autograd.grad(logits.square().sum(),
                                                        list(model.parameters()))))
        (ours, our_grads), (eager, eager_grads) = results
        assert torch.equal(ours, eager)
        for a, b in zip(our_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=IEEE, atol=IEEE)
    assert dict(dynamo_counters["graph_break"]) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == 1


class Draws(torch.nn.Module):
    """Every kind of keyed draw a model makes, its masks as the output."""

    def __init__(self):
        super().__init__()
        from hetseq.nn import Dropout
        self.hidden, self.probs, self.pooled = Dropout(0.3), Dropout(0.2), Dropout(0.5)

    def forward(self, q, k):
        from hetseq.nn import attention
        L = k.shape[2]
        identity = torch.eye(L, device=q.device).expand(q.shape[0], q.shape[1], L, L)
        return (self.hidden(torch.ones(q.shape[0], L, 8, device=q.device)) != 0,
                attention(q, k, identity, None, self.probs) != 0,
                self.pooled(torch.ones(q.shape[0], 8, device=q.device)) != 0)


def test_compiled_and_eager_masks_are_identical(dynamo_counters):
    """Under inductor too: the draws are operators it calls as they are."""
    model = Draws()
    randomness.name_sites(model)
    compiled = torch.compile(model, backend="inductor")
    q, k, _ = qkv(3, 2, 16, 16)
    with randomness.using(randomness.sample_keys(2, 3, [7, 1, 4]).to(DEVICE)):
        eager = model(q.detach(), k.detach())
    with randomness.using(randomness.sample_keys(2, 3, [7, 1, 4]).to(DEVICE)):
        ours = compiled(q.detach(), k.detach())
    for a, b in zip(ours, eager):
        assert torch.equal(a, b)
    assert dict(dynamo_counters["graph_break"]) == {}


def test_the_gpu_step_table_runs(tmp_path):
    """bench/step_table.py, which a GPU session runs once with no time to
    debug, works end to end: its smoke size on this device (in a process of
    its own: the bench puts bench/ on the module path)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, child_env
    only = ["hetseq", "hetseq_unkeyed", "bare", "transformers"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_table.py"), "--device", DEVICE.type,
         "--model", "tiny", "--seq", "32", "--batch", "4", "--rounds", "1", "--steps", "1",
         "--only", *only, "--out", str(tmp_path / "table.json")],
        cwd=ROOT, env=child_env({"HETSEQ_KERNELS": "triton"}), capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((tmp_path / "table.json").read_text())["tables"][0]
    assert sorted(table["rows"]) == sorted(only)
    assert all(row["samples_per_s"] > 0 for row in table["rows"].values())
    assert table["ratios"]["default_over_bare (goal >= 0.95)"] > 0


def test_a_misspelt_kernel_path_is_named_before_training():
    from conftest import TOY, run_train
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 1, "--no-save",
                       env={"HETSEQ_KERNELS": "trition"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "HETSEQ_KERNELS=trition: expected auto, torch or triton" in result.stderr
    assert "Traceback" not in result.stderr
