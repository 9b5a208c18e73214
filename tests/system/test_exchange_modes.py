"""Exchange modes are plugins (update/exchange.py, update/modes/): a mode
defined under tests/ (tests/modes/allreduce.py, ``--user-dir tests/modes``),
with no edit under hetseq/, trains exactly as one process does; a name
registered twice, or an unknown --exchange, is a clear error.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_exchange_modes.py."""

import pytest

from machinery.jobs import run_jobs

from machinery.in_process import max_diff
from machinery.settings import EXACT

from machinery.parity import COMMON, params, reference
from unit.update.test_exchange_modes import MODE, job


JOBS = {
    "24+8": job([24, 8]),
    "24+8 in 3 chunks, --update-freq 2": job([24, 8], "--allreduce-chunks", 3,
                                             "--update-freq", 2),
    # Weights 1000:1 leave rank 1 without samples: it sends zeros, no forward.
    "32+0": [[*COMMON, *MODE, "--capacity", "manual", "--capacity-weight", weight,
              "--global-batch-size", 32, "--no-save"] for weight in (1000, 1)],
}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_jobs(2, list(JOBS.items()), tmp_path_factory.mktemp("modes"))


@pytest.mark.parametrize("name, extra", [("24+8", ()), ("32+0", ()),
                                         ("24+8 in 3 chunks, --update-freq 2",
                                          ("--update-freq", 2))])
def test_a_mode_from_outside_hetseq_trains_exactly(two, name, extra):
    """Its own all-reduce of the sum-loss gradients, divisor 1: the
    large-batch update of one process, whatever the split."""
    result = two[name]
    assert result.global_batch == 32
    assert max_diff(reference(*extra), params(result.state)) < EXACT
    chunks = 3 if "chunks" in name else 1
    for calls in result.updates().values():      # the stats, then the mode's sum: no DDP
        assert [call.op for call in calls] == ["allreduce"] * (1 + chunks), calls
