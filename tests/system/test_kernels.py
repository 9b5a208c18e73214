"""The kernels that draw keyed masks inside (hetseq/keyed/kernels/): the Triton
path gives the torch path's masks bit for bit, and its outputs and
gradients. On a GPU they run compiled; without one (CI) in Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1).

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/keyed/test_kernels.py."""

import pytest
import torch

from hetseq.keyed import randomness
from unit.keyed.test_kernels import DEVICE, near, qkv
from unit.keyed.test_kernels import kernel_path  # noqa: F401,F811  (fixtures)


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
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32), 3).to(DEVICE).train()
    randomness.name_sites(model)
    compiled = torch.compile(model.forward, backend="aot_eager")
    for update in range(2):
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
            near(a, b)
    assert dict(dynamo_counters["graph_break"]) == {}
    assert dynamo_counters["stats"]["unique_graphs"] == 1


class Draws(torch.nn.Module):
    """Every kind of keyed draw a model makes, its masks as the output."""

    def __init__(self):
        super().__init__()
        from hetseq.keyed.nn import Dropout
        self.hidden, self.probs, self.pooled = Dropout(0.3), Dropout(0.2), Dropout(0.5)

    def forward(self, q, k):
        from hetseq.keyed.nn import attention
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
    its own: the bench puts bench/ on the module path; on a CPU through the
    torch path, as a CPU trains: the kernels' own tests run them)."""
    import json
    import subprocess
    import sys

    from machinery.settings import ROOT, child_env
    only = ["hetseq", "hetseq_unkeyed", "bare", "transformers"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_table.py"), "--device", DEVICE.type,
         "--model", "tiny", "--seq", "32", "--batch", "4", "--rounds", "1", "--steps", "1",
         "--only", *only, "--out", str(tmp_path / "table.json")],
        cwd=ROOT, env=child_env({"HETSEQ_KERNELS": "auto"}), capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((tmp_path / "table.json").read_text())["tables"][0]
    assert table["complete"] and sorted(table["rows"]) == sorted(only)
    assert all(row["samples_per_s"] > 0 for row in table["rows"].values())
    assert table["ratios"]["default_over_bare (goal >= 0.95)"] > 0


def test_the_kernel_benchmark_runs(tmp_path):
    """bench/attention_kernels.py, the GPU checklist's kernel step, works end
    to end at a smoke size: keyed attention and dropout timed beside torch's."""
    import json
    import subprocess
    import sys

    from machinery.settings import ROOT, child_env
    out = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention_kernels.py"), "--device", DEVICE.type,
         "--seq", "64", "--tokens", "128", "--heads", "2", "--head-dim", "16", "--rounds", "1",
         "--steps", "1", "--out", str(out)],
        cwd=ROOT, env=child_env({"HETSEQ_KERNELS": "triton"}), capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads(out.read_text())["tables"]["64"]
    assert set(table["ms"]) == {"keyed", "keyed_masked", "sdpa_flash", "keyed_dropout",
                                "torch_dropout"}
    assert all(ms > 0 for ms in table["ms"].values())
    assert "keyed_over_flash (goal <= 1.3)" in table["ratios"]


def test_a_misspelt_kernel_path_is_named_before_training():
    from machinery.commands import run_train
    from machinery.settings import TOY
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 1, "--no-save",
                       env={"HETSEQ_KERNELS": "trition"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "HETSEQ_KERNELS=trition: expected auto, torch or triton" in result.stderr
    assert "Traceback" not in result.stderr
