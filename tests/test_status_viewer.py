"""hetseq-status is bounded (issue 48, item 2): a silent service at the URL
costs --timeout, Ctrl-C ends it at any moment, and whatever value the store
holds (anyone may write it in a job without a secret) gives a status or one
line, never a traceback."""

import json
import math
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hetseq.base.errors import UserError
from hetseq.reporting import status
from hetseq.store import job_secret, server as job_store

from machinery.commands import run_python
from machinery.settings import child_env

VIEWER = [sys.executable, "-m", "hetseq.reporting.status"]


class SilentService:
    """Accepts every connection on 127.0.0.1 and never writes; ``asked`` is
    set once a client has sent bytes (it is then waiting for an answer)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked = threading.Event()
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:            # closed: the test is over
                return
            self.held.append(conn)
            threading.Thread(target=self._listen, args=(conn,), daemon=True).start()

    def _listen(self, conn):
        try:
            if conn.recv(1):
                self.asked.set()
        except OSError:
            pass

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent():
    service = SilentService()
    yield service
    service.close()


def viewer_run(argv, **options):
    """The viewer's run; one that outlives ``timeout`` fails the test (a hang
    is the broken promise, not an error of the test)."""
    try:
        return run_python([*VIEWER[1:], *argv], **options)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hetseq-status {' '.join(argv)} still ran after {err.timeout} s")


def no_traceback(result):
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def test_a_silent_service_costs_the_timeout_and_is_named(silent):
    start = time.monotonic()
    result = viewer_run([silent.url, "--timeout", "2"], env=child_env(), timeout=60)
    took = time.monotonic() - start
    no_traceback(result)
    assert result.returncode == 2, result.stderr
    assert took < 15, took
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and silent.url in lines[0] and "within 2 s" in lines[0], lines
    assert silent.asked.is_set()       # it did wait inside the store's handshake


def test_ctrl_c_ends_the_wait_for_a_silent_service(silent):
    # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job
    # would hand the test, and so the viewer, SIGINT ignored).
    viewer = subprocess.Popen(
        [*VIEWER, silent.url, "--timeout", "60"], env=child_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert silent.asked.wait(60), "the viewer never asked the service"
        viewer.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            out, err = viewer.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("hetseq-status still waited 20 s after Ctrl-C")
        took = time.monotonic() - start
    finally:
        viewer.kill()
        viewer.communicate()
    assert "Traceback" not in err and err.strip() == "", err
    assert viewer.returncode == 0 and took < 5, (viewer.returncode, took)


def test_a_peer_that_keeps_going_silent_ends_the_watch():
    """--watch looks again after a silent read, but the threads left waiting
    are bounded: the MAX_STUCK-th still waiting ends it."""
    never = threading.Event()
    try:
        for _ in range(status.MAX_STUCK):
            with pytest.raises(UserError, match="did not answer within 0.1 s"):
                status.bounded(never.wait, "tcp://h:1", 0.1)
        with pytest.raises(UserError, match=f"went silent {status.MAX_STUCK} times"):
            status.bounded(lambda: "answer", "tcp://h:1", 0.1)
    finally:
        never.set()
    for worker in status._workers:
        worker.join(10)
    assert status.bounded(lambda: "answer", "tcp://h:1", 5) == "answer"


def test_the_timeout_flag_is_checked():
    result = viewer_run(["tcp://127.0.0.1:1", "--timeout", "0"], env=child_env(), timeout=60)
    assert result.returncode == 2 and "'0': expected seconds from 1 to 3600" in result.stderr


def status_value(batches, **more):
    return json.dumps({"state": "training", "update": 3, "planned": 9, "time": time.time(),
                       "ranks": [{"rank": r, "host": f"host{r}", "batch": b}
                                 for r, b in enumerate(batches)], **more})


CRAFTED = {
    "nested": ("[" * 100000, 2, "not JSON (RecursionError"),
    "huge-batches": (status_value([1e308, -1e308]), 0, "update 3/9"),
    "huge-numbers": (status_value([4, 4], left_s=10**400, time=-10**400, loss=1e308), 0,
                     "host0"),
    "two-mib": (json.dumps({"state": "x" * (2 << 20)}), 2, "bytes, more than a status"),
    "not-json": ("{not json", 2, "not JSON"),
    "valid": (status_value([8, 24]), 0, "host1"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_any_value_in_the_store_gives_a_status_or_one_line(case):
    value, code, expected = CRAFTED[case]
    server = dist.TCPStore("127.0.0.1", 0, None, True)
    server.set(status.KEY, value)
    url = f"tcp://127.0.0.1:{server.port}"
    result = viewer_run([url, "--timeout", "30"], env=child_env(), timeout=90)
    no_traceback(result)
    assert result.returncode == code, result.stderr
    if code:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and expected in lines[0], lines
    else:
        assert expected in result.stdout and result.stderr == "", result
        assert result.stdout.startswith(url), result.stdout


def test_a_job_with_a_secret_is_read_through_its_gate():
    """The same worker thread and deadline on the gate's path; the job id
    comes with the URL, as hetseq-launch prints it: without it the viewer
    is refused like a node of another job, and told both causes."""
    secret = "c41e9a07d3b25f68e1a4c7093bd2f5e6"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}/5be0c2d94e1f"
    served = job_store.serve(listener, job_secret.read_secret(
        None, {job_secret.SECRET_VARIABLE: secret}, url))
    served.set(status.KEY, status_value([8, 24]))
    invited = child_env({job_secret.SECRET_VARIABLE: secret})
    try:
        seen = viewer_run([url, "--json"], env=invited, timeout=60)
        no_id = viewer_run([f"tcp://127.0.0.1:{port}"], env=invited, timeout=60)
        refused = viewer_run([url], env=child_env(), timeout=60)
    finally:
        listener.close()
    assert seen.returncode == 0, seen.stderr
    assert [r["batch"] for r in json.loads(seen.stdout)["ranks"]] == [8, 24]
    assert no_id.returncode == 2 and "its secret differs from this node's, or its job id " \
        "does" in no_id.stderr and "tcp://HOST:PORT/JOB_ID" in no_id.stderr, no_id.stderr
    no_traceback(no_id)
    assert refused.returncode == 2 and "has a job secret" in refused.stderr, refused.stderr
    no_traceback(refused)


class Member(job_store.LocalStore):
    """A member's store as the viewer holds it: closed once it moved on."""
    closed = False

    def close(self):
        self.closed = True


def test_the_viewer_follows_the_leader_with_the_job_id_it_was_given():
    """Under --elastic any member's address shows the job: the viewer
    follows e/leader, an address only, and passes the leader's gate with the
    key of the job id in the URL it was given; a leader at that same
    address is the store it holds already."""
    secret = job_secret.read_secret(None, {job_secret.SECRET_VARIABLE:
                                           "c41e9a07d3b25f68e1a4c7093bd2f5e6"},
                                    "tcp://127.0.0.1:9/7a0f3e")
    listener = socket.create_server(("127.0.0.1", 0))
    leader_port = listener.getsockname()[1]
    leader = job_store.serve(listener, secret)
    leader.set(status.KEY, "the leader's")
    member = Member()
    member.set("e/leader", json.dumps({"addr": "127.0.0.1", "port": leader_port}))
    try:
        there, url = status.leader_store(member, "tcp://127.0.0.1:9/7a0f3e", secret)
        assert url == f"tcp://127.0.0.1:{leader_port}" and there.get(status.KEY) == \
            b"the leader's"
        there.close()
        assert member.closed
        here = f"tcp://127.0.0.1:{leader_port}/7a0f3e"
        member.closed = False
        assert status.leader_store(member, here, secret) == (member, here) and not member.closed
    finally:
        listener.close()


NASTY = [0, -1, 1, 2.5, 1e308, -1e308, 10**400, -10**400, 10**15, 1e15 + 1, math.nan,
         math.inf, -math.inf, True, False, None, "", "8", "\x1b[2J", "\ud800", "\u202e",
         "a\x07b" * 3000, "\n\t\r", [], {}]
FIELDS = ["state", "generation", "update", "planned", "left_s", "left", "loss", "samples_per_s",
          "time", "ranks", "checkpoint", "rank", "host", "batch", "wait_s", "path"]


def fuzzed(rng, depth=0):
    """A JSON-ish value: mostly dicts with the viewer's own keys, nested."""
    pick = rng.random()
    if depth < 4 and pick < 0.45:
        return {rng.choice(FIELDS): fuzzed(rng, depth + 1) for _ in range(rng.randrange(8))}
    if depth < 4 and pick < 0.6:
        return [fuzzed(rng, depth + 1) for _ in range(rng.randrange(6))]
    if pick < 0.75:
        return rng.choice([rng.uniform(-1e18, 1e18), rng.randrange(-10**20, 10**20),
                           rng.random(), -rng.randrange(100), rng.randrange(100)])
    return rng.choice(NASTY)


def fuzzed_status(rng):
    """A status's shape (rows of ranks), each field fuzzed."""
    rows = [{f: fuzzed(rng, 3) for f in ("rank", "host", "batch", "wait_s", "samples_per_s")
             if rng.random() < 0.8} for _ in range(rng.randrange(6))]
    return {**{f: fuzzed(rng, 3) for f in FIELDS if rng.random() < 0.5}, "ranks": rows}


def test_clean_and_render_take_any_value():
    """3000 values: each draws, with no escape and every share within 0-100%."""
    rng = random.Random(48)
    shares = 0
    for i in range(3000):
        value = fuzzed(rng) if i % 2 else fuzzed_status(rng)
        view = value if isinstance(value, dict) else {"ranks": [value], "checkpoint": value}
        try:
            text = "\n".join(status.render(status.clean(view), "tcp://h:1", now=1e9))
        except Exception as err:          # the promise: never a traceback
            pytest.fail(f"value {i} ({value!r:.200}) raised {err!r}")
        assert "\x1b" not in text and "\x07" not in text and "\ud800" not in text, i
        for share in re.findall(r"(-?\d+)% ", text):
            assert 0 <= int(share) <= 100, (i, value)
            shares += int(share) > 0
    assert shares > 100        # the fuzz does reach the rank rows


@pytest.mark.parametrize("leader", [
    b'{"addr": "10.0.0.1", "port": 1e999}', b'{"addr": "10.0.0.1", "port": 70000}',
    b'{"addr": ' + b"[" * 100000 + b"}", b'{"addr": "\\u001b]0;PWNED\\u0007", "port": 29500}',
    b'{"addr": "a b", "port": 29500}', b'{"addr": 5, "port": 29500}', b'["10.0.0.1", 1]',
    b'{"addr": "' + b"a" * (2 << 20) + b'", "port": 1}'])
def test_a_crafted_leader_address_gives_one_line(leader):
    """e/leader, which --elastic members write and the viewer follows, is
    read with the status's own bounds: one line, no escape, no traceback."""
    store = job_store.LocalStore()
    store.set("e/leader", leader)
    secret = job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: "c41e9a07d3b25f68e1a4c7093bd2f5e6"})
    try:
        status.leader_store(store, "tcp://10.0.0.2:29500", secret)
    except UserError as err:
        message = str(err)
    except Exception as err:       # the promise: never a traceback
        pytest.fail(f"{leader[:60]!r} raised {err!r}")
    else:
        pytest.fail(f"{leader[:60]!r} was followed")
    assert "\n" not in message and "\x1b" not in message and "PWNED" not in message, message


class MadeUp:
    """A store client whose answers a hostile service made up: c10d's client
    fails in C++ on them (a length no store sends)."""

    def __init__(self, error):
        self.error = error

    def check(self, keys):
        return True

    def get(self, key):
        raise self.error


@pytest.mark.parametrize("error", [
    MemoryError("std::bad_alloc"), ValueError("cannot create std::vector larger than "
                                              "max_size()"), RuntimeError("unexpected reply")])
def test_store_answers_no_store_sends_give_one_line(error):
    try:
        status.read(MadeUp(error))
    except status.BadValue as err:
        assert f"no HetSeq store sends ({type(error).__name__}" in str(err), err
    except Exception as err:             # the traceback a user would have seen
        pytest.fail(f"a made-up answer raised {err!r}, not one line")
    else:
        pytest.fail("a made-up answer read as a status")
    with pytest.raises(dist.DistError):                # a lost connection stays one
        status.read(MadeUp(dist.DistError("connection closed")))


@pytest.mark.parametrize("url", ["tcp://a..b:80", "tcp://.:80", f"tcp://{'a' * 64}.org:80"])
def test_a_url_that_names_no_host_is_one_line(url):
    result = viewer_run([url, "--timeout", "5"], env=child_env(), timeout=60)
    no_traceback(result)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert url in lines[0] or "not a host name" in lines[0], lines


def test_watch_shows_a_value_that_is_no_status_and_a_closed_pipe_ends_it_quietly():
    """--watch says what is wrong with the value each look (it may be
    published again), and a reader that stops reading (| head -1) ends it
    without a traceback."""
    server = dist.TCPStore("127.0.0.1", 0, None, True)
    server.set(status.KEY, "[1, 2, 3]")
    url = f"tcp://127.0.0.1:{server.port}"
    viewer = subprocess.Popen([*VIEWER, url, "--watch", "--interval", "1", "--timeout", "30"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    try:
        import select
        if not select.select([viewer.stdout], [], [], 60)[0]:
            pytest.fail("--watch printed nothing in 60 s for a value that is no status")
        first = viewer.stdout.readline().decode()
        assert first.startswith(url) and "is not a status" in first, first
        viewer.stdout.close()                      # the reader has what it wanted
        code = viewer.wait(timeout=60)
    finally:
        viewer.kill()
    errors = viewer.stderr.read().decode()
    assert code == 0 and "Traceback" not in errors, errors
