"""Ranks stay equal to rank 0 for runs of any length: rounding apart is undone,
a real divergence stops the run (hetseq/update/agreement.py).

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_agreement.py."""

import re

import pytest
import torch
from machinery.parity import COMMON, reference
from machinery.commands import assert_ok, final_params, run_job
from machinery.in_process import max_diff
from machinery.settings import TOY


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
