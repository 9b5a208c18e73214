"""Only invited nodes: a job secret guards the meeting point (channel.py), and
rank 0's store listens only on the job's address.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/store/test_secret.py."""

import os
import subprocess
import sys

import pytest

from machinery.parity import COMMON, reference
from machinery.settings import EXACT
from machinery.commands import assert_ok, final_params, finish, node_commands, start_nodes
from machinery.in_process import max_diff
from hetseq.base.errors import UserError
from hetseq.store import job_secret, secret
from unit.store.test_secret import OTHER, SECRET, join, key, serve


def test_store_through_the_channel_and_intruders_refused_without_disturbing_it(caplog):
    url, server = serve(key(SECRET))
    member = join(url, key(SECRET))
    member.set("hetseq/who/1", "member")
    for wrong, words in [(key(OTHER), "its secret differs"), (None, "has a job secret and this "
                                                                    "node none")]:
        with pytest.raises(UserError, match=words):
            join(url, wrong)
    assert "refused a connection to the job's store from 127.0.0.1" in caplog.text
    # The member's connection and the store's keys are as before.
    assert member.add("n", 2) == 2 and server.get("hetseq/who/1") == b"member"
    assert member.clone().get("hetseq/who/1") == b"member"    # gloo clones the store
    # A secret where the job has none: refused, not hung.
    plain_url, _ = serve(None)
    with pytest.raises(UserError, match="runs without a job secret"):
        join(plain_url, key(SECRET))


def test_a_secret_without_the_cipher_is_one_line_and_no_secret_needs_none():
    """Where `cryptography` cannot be imported (the GPU machine has none), a
    job without a secret runs as before, and one with a secret stops with
    one line naming the install (exit 2): it never falls back to frames
    that anyone on the path can read."""
    blocked = ("import sys; sys.modules['cryptography'] = None\n"
               "import datetime\n"
               "from hetseq.distributed import meeting_point\n"
               "from hetseq.store import job_secret\n"
               "assert job_secret.read_secret(None, {}) is None\n"
               "s = meeting_point.loopback_store(1, datetime.timedelta(seconds=10))\n"
               "s.set('k', 'v'); assert s.get('k') == b'v'\n"
               "print('without a secret: served', flush=True)\n"
               "from hetseq.reporting import status\n"
               "status.main(['tcp://127.0.0.1:9'])\n")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                          timeout=120, env={**os.environ, job_secret.SECRET_VARIABLE: SECRET})
    assert done.stdout == "without a secret: served\n", done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "pip install cryptography" in done.stderr and "ChaCha20-Poly1305" in done.stderr


def test_hetseq_secret_makes_accepted_secrets_and_private_files(tmp_path):
    # The console script pip installed beside this interpreter (PATH may
    # reach it only through a shim that is made later).
    script = os.path.join(os.path.dirname(sys.executable), "hetseq-secret")
    assert os.path.exists(script), f"{script}: pip install -e . installs it"
    made = subprocess.run([script], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and len(made.stdout.strip()) == 64, made
    assert key(made.stdout) is not None
    for _ in range(200):           # the rule refuses none of what it makes
        assert key(secret.make()) is not None
    path = tmp_path / "job-secret"
    run = [sys.executable, "-m", "hetseq.store.secret", "--file", str(path)]
    os.umask(old := os.umask(0))   # the widest umask: the file must still be 600
    try:
        assert subprocess.run(run, capture_output=True, timeout=60).returncode == 0
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert job_secret.read_secret(str(path), {}) is not None
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr, again
    assert "Traceback" not in again.stderr, again.stderr


def test_uninvited_nodes_are_refused_and_the_job_trains_on_exactly(three_hosts, tmp_path):
    """Rank 0 on host A waits for rank 1; from host C a node with another
    secret and one with none try to take rank 1 first: both are refused
    (exit 2, one line) before they can claim it. Then host B's node joins
    and the job ends with one process's weights."""
    out = tmp_path / "job"
    url = f"tcp://{three_hosts.addresses[0]}:29511"
    commands = node_commands([*COMMON, "--save-dir", out, "--distributed-timeout", 60],
                             [["--max-sentences", 20], ["--max-sentences", 12]], url)
    invited = {"HETSEQ_JOB_SECRET": SECRET}
    rank0 = start_nodes([commands[0]], three_hosts, on=[0], env=invited)
    for env, words in [({"HETSEQ_JOB_SECRET": OTHER}, "its secret differs"),
                       (None, "has a job secret and this node none")]:
        code, text = finish(start_nodes([commands[1]], three_hosts, on=[2], env=env),
                            timeout=60)[0]
        assert code == 2 and words in text, text[-3000:]
        assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text[-3000:]
    rank1 = start_nodes([commands[1]], three_hosts, on=[1], env=invited)
    results = finish(rank0 + rank1)
    assert_ok(results)
    # The wrong secret is logged by the job; the node with none saw the
    # greeting, knew it was not invited and left without a word.
    assert results[0][1].count("refused a connection to the job's store from 10.213.0.3") == 1, \
        results[0][1][-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT
