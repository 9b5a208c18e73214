"""Nodes must agree on the job: a node whose flags differ is refused before it
claims a rank, with the flags named; the job that was there first goes on.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/distributed/test_job_identity.py."""

import time


from machinery.commands import finish, node_commands, start_nodes
from machinery.settings import TOY


RUN = [*TOY, "--max-update", 3, "--max-sentences", 8, "--disable-validation", "--no-save"]


def node(url, rank, *extra):
    """Node ``rank`` of a two-node job meeting at ``url``."""
    return node_commands([*RUN, *extra], [[], []], url)[rank]


def test_node_with_other_seed_and_epochs_is_refused_naming_both():
    # Rank 0 then waits for a rank 1 that never comes (test_startup.py tests
    # that it names it at the timeout): once rank 1 is refused it is stopped.
    job, refused = start_nodes(node_commands(RUN, [[], ["--seed", 7, "--max-epoch", 2]]))
    code1, out1 = finish([refused])[0]
    job.kill()
    finish([job])
    assert code1 == 2, out1[-3000:]
    assert "refused by the job" in out1 and "--seed 7 here, 19940802 in the job" in out1 \
        and "--max-epoch 2 here, 0 in the job" in out1, out1[-3000:]
    assert "Traceback" not in out1


def test_two_jobs_on_one_file_path_do_not_merge(tmp_path):
    # Per-node commands started in the order A0, B1, A1, B0 on one path: B's
    # nodes are refused and A's job trains as if B had never come.
    path = tmp_path / "meet"
    url = f"file://{path}"
    job_a, job_b = ["--seed", 1], ["--seed", 2, "--max-sentences", 16]
    a0 = start_nodes([node(url, 0, *job_a)])[0]
    deadline = time.time() + 60
    # A's rank 0 has defined the job: its identity is in the store's file.
    while not (path.exists() and b"hetseq/job" in path.read_bytes()):
        assert time.time() < deadline and a0.poll() is None
        time.sleep(0.05)
    b1 = start_nodes([node(url, 1, *job_b)])[0]
    out_b1 = b1.communicate(timeout=60)[0]
    a1, b0 = start_nodes([node(url, 1, *job_a), node(url, 0, *job_b)])
    outs = [proc.communicate(timeout=120)[0] for proc in (a0, a1, b0)]
    assert b1.returncode == 2 and "--seed 2 here, 1 in the job" in out_b1, out_b1[-3000:]
    assert b0.returncode == 2 and "refused by the job" in outs[2], outs[2][-3000:]
    assert a0.returncode == 0 and a1.returncode == 0, (outs[0] + outs[1])[-3000:]
    assert "global batch 16" in outs[0], outs[0][-3000:]
