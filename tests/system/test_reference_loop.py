"""docs/reference_loop.py with plain DDP on 2 and 3 ranks of uneven shares
equals one process of the framework: the loop a reader starts from is the
update HetSeq makes (the in-process checks: tests/unit/project/test_reference_loop.py)."""

import subprocess
import sys

import pytest
import torch

from machinery.in_process import alone, max_diff
from machinery.parity import COMMON
from machinery.settings import EXACT, QUIET, ROOT, child_env


@pytest.mark.parametrize("shares", ["20,12", "13,11,8"])
def test_the_reference_loop_on_uneven_ranks_is_the_frameworks_update(tmp_path, shares):
    out = tmp_path / "state.pt"
    done = subprocess.run([sys.executable, ROOT / "docs" / "reference_loop.py", "--shares", shares,
                           "--out", out, "--", *map(str, (*COMMON, *QUIET))],
                          capture_output=True, text=True, timeout=180, env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    framework = alone(*COMMON, "--max-sentences", 32)["model"]
    assert max_diff(torch.load(out, weights_only=True), framework) <= EXACT
