"""CUDA checks; they skip on machines without a GPU (CI has none)."""

import pytest
import torch

from hetseq.capacity import cuda_memory_cap

from conftest import TOY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_memory_probe_finds_the_largest_micro_batch():
    layer = torch.nn.Linear(4096, 4096).cuda()
    free, _ = torch.cuda.mem_get_info()
    per_sample = 4096 * 4 * 8            # activations and gradients, roughly

    def run(size):
        x = torch.randn(size, 4096, device="cuda", requires_grad=True)
        layer(x).square().sum().backward()
        layer.zero_grad(set_to_none=True)
    limit = 4 * free // per_sample       # beyond what fits
    cap = cuda_memory_cap(run, 1024, limit)
    assert 0 < cap < limit
    run(cap)                             # the cap itself fits


def test_trains_on_one_gpu():
    import subprocess
    import sys
    from conftest import ROOT, child_env
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, TOY), "--max-sentences", "8",
           "--max-update", "3", "--no-save", "--no-progress-bar", "--distributed-world-size", "1"]
    result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "updates=3" in result.stderr
