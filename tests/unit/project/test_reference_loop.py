"""docs/reference_loop.py, the update as a plain loop, is HetSeq's update:
one process of it equals one process of the framework, weight for weight
(the split runs with DDP are tests/system/test_reference_loop.py)."""

import importlib.util

import torch

from machinery.in_process import alone, max_diff
from machinery.parity import COMMON
from machinery.settings import EXACT, QUIET, ROOT


def reference_loop():
    spec = importlib.util.spec_from_file_location("reference_loop",
                                                  ROOT / "docs" / "reference_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_loop_alone_is_the_frameworks_update():
    loop = reference_loop()
    mine = loop.train(0, [32], [str(a) for a in (*COMMON, *QUIET)])
    framework = alone(*COMMON, "--max-sentences", 32)["model"]
    assert max_diff(mine, framework) <= EXACT
    assert max_diff(mine, loop.train(0, [32], [str(a) for a in (*COMMON, *QUIET)])) == 0


def test_a_short_batch_is_cut_in_proportion_and_every_sample_is_taken_once():
    loop = reference_loop()
    for length, shares in ((32, [20, 12]), (4, [20, 12]), (4, [13, 11, 8]), (1, [3, 1])):
        cuts = [loop._slice(length, shares, rank) for rank in range(len(shares))]
        taken = [i for cut in cuts for i in range(length)[cut]]
        assert taken == list(range(length)), (length, shares, cuts)
    assert loop._slice(32, [20, 12], 0) == slice(0, 20)
    assert torch.equal(torch.arange(4)[loop._slice(4, [3, 1], 1)], torch.tensor([3]))
