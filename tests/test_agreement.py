"""Ranks stay equal to rank 0 for runs of any length: rounding apart is undone,
a real divergence stops the run (hetseq/update/agreement.py)."""

import re

import pytest
import torch
from test_parity import COMMON, reference

from machinery.commands import assert_ok, final_params, run_job
from machinery.in_process import max_diff
from machinery.settings import TOY
from hetseq.update.agreement import _buckets, checksum, disagreeing


def test_checksum_is_exact_order_sensitive_and_dtype_blind():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64)
    base = checksum([a, b])
    assert base == checksum([a.clone(), b.clone()]) and base > 0
    nudged = a.clone()
    nudged[17] = torch.nextafter(nudged[17], torch.tensor(10.0))    # one unit in the last place
    assert checksum([nudged, b]) != base
    assert checksum([b, a]) != base                                 # the order counts
    assert checksum([a.bfloat16(), torch.ones(4, dtype=torch.bool)]) > 0
    assert checksum([]) == 0.0
    assert disagreeing([5.0, 5.0, 6.0]) == [2] and disagreeing([0.0, 0.0]) == []


def test_ranks_split_their_state_alike_whatever_device_holds_it():
    """A GPU rank keeps Adam's step counts on the host, a CPU rank all of its
    state: both must make the same broadcasts in a resync, or it hangs (seen
    on an H200 with a CPU rank). Here "meta" stands in for the GPU."""
    shapes = [(4, 3), (), (4, 3), (), (5,)]
    on_host = [torch.zeros(shape) for shape in shapes]
    mixed = [torch.zeros(shape, device="meta" if shape else "cpu") for shape in shapes]

    def sizes(tensors):
        return [sum(t.numel() for t in bucket) for bucket in _buckets(tensors, limit=20)]
    assert sizes(mixed) == sizes(on_host) == [13, 18]


ADAMW = ["--optimizer", "adamw", "--lr", "0.01", "--max-update", 150]


def test_a_rank_that_rounds_differently_is_kept_equal_to_rank_0(tmp_path):
    """Rank 1's parameters move by 1e-7 (relative) at every step, as on a
    device that rounds differently: 150 updates add up to 1.5e-5, which
    stopped the run before. Now each check (every 10 updates) finds the
    checksums differ, finds rank 1 within the tolerance, and copies rank 0's
    parameters and Adam state to it: the run finishes, the ranks agree to
    within one interval's drift, and the result is one process's."""
    out = tmp_path / "drift"
    results = run_job([*COMMON, *ADAMW, "--max-sentences", 16, "--save-dir", out,
                       "--toy-dump-params", tmp_path / "params", "--toy-drift-rank", 1], [[], []])
    assert_ok(results)
    log = results[0][1]
    resyncs = re.findall(r"ranks drifted apart by rounding \(relative distance to rank 0: "
                         r"rank 1 ([\d.e-]+)\)", log)
    assert len(resyncs) >= 10 and all(float(d) < 1e-5 for d in resyncs), log[-3000:]
    ranks = [torch.load(f"{tmp_path / 'params'}.{r}", weights_only=True) for r in (0, 1)]
    assert max((p0 - p1).abs().max().item() for p0, p1 in zip(*ranks)) < 1e-5
    assert max_diff(reference(*ADAMW), final_params(out)) < 1e-4


@pytest.mark.parametrize("tolerance", ["1e-4", "0"])
def test_a_real_divergence_still_stops_the_run(tmp_path, tolerance):
    # --toy-perturb-after adds 1.0 to one weight on rank 1 (a rank running
    # different code): far beyond rounding. Tolerance 0 stops on any difference.
    perturb = ["--toy-perturb-after", 2] if tolerance == "1e-4" else ["--toy-drift-rank", 1]
    common = [*TOY, "--max-sentences", 8, "--max-update", 5, "--no-save", "--disable-validation",
              "--divergence-check-interval", 1, "--divergence-tolerance", tolerance]
    results = run_job(common, [[], perturb])
    for code, out in results:
        assert code == 4, out[-3000:]
    assert re.search(r"parameters differ between ranks before update \d: relative distance "
                     r"to rank 0's [\d.e-]+ on rank 1, beyond --divergence-tolerance",
                     results[0][1]), results[0][1][-3000:]
