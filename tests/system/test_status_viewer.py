"""hetseq-status is bounded (issue 48, item 2): a silent service at the URL
costs --timeout, Ctrl-C ends it at any moment, and whatever value the store
holds (anyone may write it in a job without a secret) gives a status or one
line, never a traceback.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/reporting/test_status_viewer.py."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

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
    assert viewer.returncode == 130 and took < 5, (viewer.returncode, took)


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
