"""A rank that cannot pay for its place sits out (plan/links.py,
update/members.py): no samples, no gradient exchange; the update stays one
process's, and the rank comes back when a re-plan finds it pays.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/plan/test_sitting.py."""

import re

import pytest

from machinery.jobs import run_jobs

from machinery.commands import assert_ok, final_params, run_job
from machinery.in_process import max_diff
from machinery.settings import EXACT, TOY
from machinery.parity import COMMON, params, reference
SIT_MODES = {"zero0": [], "bf16 reduce": ["--reduce-dtype", "bfloat16"]}


@pytest.fixture(scope="module")
def weight_zero(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sitting")
    jobs = [(mode, [[*COMMON, *extra, "--capacity", "1,0", "--global-batch-size", 32,
                     "--no-save", "--divergence-check-interval", 2,
                     "--toy-log-forwards", folder / mode.replace(" ", "-")]] * 2)
            for mode, extra in SIT_MODES.items()]
    return folder, run_jobs(2, jobs, folder / "jobs")


@pytest.mark.parametrize("mode", sorted(SIT_MODES))
def test_a_rank_with_weight_zero_sits_out_and_the_update_stays_exact(weight_zero, mode):
    """--capacity 1,0: rank 1 runs one zero-weight batch in the first update
    (the stats' layout), then no forward and no gradient collective: each
    update it sends its zeros in the stats and hears the outcome from rank 0."""
    folder, results = weight_zero
    result = results[mode]
    close = 1e-2 if mode == "bf16 reduce" else EXACT
    assert max_diff(reference(), params(result.state)) < close
    forwards = (folder / f"{mode.replace(' ', '-')}.1").read_text().split("\n")[:-1]
    assert forwards == ["1 0.0"], forwards
    sitting = result.updates(1)
    for update in range(2, 8):
        ops = [call.op for call in sitting[f"update {update}"]]
        assert ops == ["allreduce", "recv"], (update, ops)
    members = [call.op for call in result.updates(0)["update 5"]]
    assert "send" in members, members


# Momentum: a rank that comes back must take rank 0's optimizer state too
# (DDP's start-up broadcast gives it the parameters only), or the agreement
# check finds it drifting away.
FLAGS = [*TOY, "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--lr-scheduler",
         "fixed", "--clip-norm",
         "0", "--toy-size", "100", "--max-update", 24, "--validate-interval-updates", 6,
         "--divergence-check-interval", 3]


def test_a_slow_rank_sits_out_then_comes_back_and_the_job_matches_one_process(tmp_path):
    """Rank 1 at 200 ms a sample beside rank 0 at 1 ms: of a global batch of
    16 its whole-sample share is none, and the plan leaves it out of the
    exchange (validations and agreement checks go on without it). After 16
    of its calls rank 0 slows to 31 ms a sample: with rank 1 taking 2 samples
    an update takes 0.43 s instead of 0.5 s, and the re-plan brings it back
    with rank 0's state. The job's result is one process's."""
    out = tmp_path / "job"
    results = run_job([*FLAGS, "--capacity", "auto", "--global-batch-size", 16,
                       "--save-dir", out, "--toy-sample-ms", 1],
                      [["--toy-slow-rank", 0, "--toy-slow-after", 16, "--toy-slow-ms", 30],
                       ["--toy-slow-rank", 1, "--toy-slow-ms", 199]], timeout=240)
    assert_ok(results)
    log = results[0][1]
    assert re.search(r"rank 1 cpu \(\S+\) sits out: [\d.]+ samples/s would save", log), log[-3000:]
    assert "every rank takes part in the exchange again" in log, log[-3000:]
    ref = reference_of(FLAGS, "--max-sentences", 16)
    assert max_diff(ref, final_params(out)) < EXACT


def reference_of(*argv):
    from machinery.in_process import alone
    flat = [a for part in argv for a in (part if isinstance(part, list) else [part])]
    return alone(*flat)["model"]


def test_a_node_that_sits_out_stays_a_member_of_an_elastic_job(tmp_path):
    """--elastic: the node whose rank sits out keeps its heartbeats and its
    place: one generation from start to end, and the update is one
    process's. (Both nodes slow whichever of them is rank 1.)"""
    from machinery.in_process import alone
    from machinery.settings import free_port
    from machinery.elastic_jobs import finish_ok, node
    url = f"tcp://127.0.0.1:{free_port()}"
    # The slow rank's speed probe takes about 10 s: longer than the 10 s
    # the elastic tests give a collective.
    slow = ["--capacity", "auto", "--max-update", 20, "--toy-sample-ms", 1,
            "--toy-slow-rank", 1, "--toy-slow-ms", 199, "--distributed-timeout", 60]
    nodes = [node(None, None, url, tmp_path / name, *slow) for name in "ab"]
    outputs = finish_ok(*nodes)
    leader = 0 if "this node is rank 0" in outputs[0] else 1
    log = outputs[leader]
    assert re.search(r"rank 1 cpu \(\S+\) sits out", log), log[-3000:]
    assert re.findall(r"generation (\d+): \d+ nodes", log) == ["1"], log[-3000:]
    expected = alone(*COMMON, "--max-update", 20, "--max-sentences", 48)
    assert max_diff(expected["model"], final_params(tmp_path / "ab"[leader])) < EXACT
