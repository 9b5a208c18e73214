"""Elastic jobs whose state is split between ranks (--zero 1/2/3, even or
by memory: update/zero/uneven.py). A rank holds only its shard, so a member's
snapshot cannot be made without a collective and a lost member takes its
shard along: each node's first process keeps the newest full state (the one
its generation started from, the one every rank took together before a join
or at a save: elastic/hooks.py) and a generation after a loss goes back to
it. Each job ends by itself at the weights of one
process training with the whole global batch (EXACT on the float64 toy with
SGD), on loopback."""


import pytest

from hetseq.app import cli


@pytest.mark.parametrize("mode", [["--zero", 1], ["--zero", 2], ["--zero", 3],
                                  ["--zero", 3, "--cpu-offload"]])
def test_elastic_takes_a_split_state(mode):
    argv = ["--task", "toy", "--user-dir", "tests/tasks", "--elastic", "--global-batch-size", "8",
            "--distributed-init-method", "tcp://127.0.0.1:1", *map(str, mode)]
    _, job, _ = cli.parse(argv)
    assert job.elastic.elastic and job.sharding.zero == mode[1]
