"""``python train.py ...`` for tests, forked from a process that imported torch once.

Most of a short test job's CPU is its start-up (importing torch,
docs/testing.md); the zygote (the name Android gives the same trick) is one
process per test worker that paid it once (zygote_server.py). Asked over a
Unix socket, it forks a child that runs the command as ``python`` would; a
test gets a Popen-like ``Child``. The child is the zygote's, not the
test's: its exit code comes back over the socket, and the test signals it
by pid. Tests that need a process started from nothing (the launcher's
nodes over SSH, the real launchers, resource limits) keep ``subprocess``.
"""

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

from machinery import zygote_server
from machinery.zygote_server import MESSAGE

# Read by an interpreter or by torch's libraries when they start, so a child
# cannot take them from its own environment: a command whose values differ
# from the zygote's needs a process of its own (``Zygote.serves``).
# PYTHONPATH and PYTHONUNBUFFERED a child applies itself (zygote_server._become).
AT_START = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH",
            "TORCH_CPP_LOG_LEVEL")
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED")
_PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Zygote:
    """The zygote serving this process; ``popen`` starts a command from it."""

    def __init__(self, timeout=120):
        self._folder = tempfile.mkdtemp(prefix="hetseq-zygote-")     # mode 0700
        self.path = os.path.join(self._folder, "socket")
        self._env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # Run from the folder that holds this package (tests/), so that
        # ``-m`` finds it; a child's folder is its request's.
        self._server = subprocess.Popen([sys.executable, "-m", zygote_server.__name__, self.path],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=self._env, cwd=_PACKAGES)
        ready = _read_line(self._server.stdout, timeout)
        if ready != b"ready\n":
            self.close()
            raise RuntimeError(f"the test zygote did not start (it printed {ready!r})")

    def serves(self, env):
        """Whether a child with environment ``env`` runs as a fresh process
        would: the variables read at start (AT_START, other PYTHON* ones)
        as the zygote's own."""
        def at_start(variables):
            return {k: v for k, v in variables.items()
                    if k in AT_START or (k.startswith("PYTHON") and k not in APPLIED)}
        return at_start(env) == at_start(self._env)

    def popen(self, argv, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
              text=True, start_new_session=False, host=None):
        """Start ``python *argv`` (``argv[0]`` a script or ``-m``); a ``Child``.
        ``stdout``/``stderr``: PIPE, STDOUT (stderr only) or None (this
        process's own); ``host``: (network namespace, hostname) of a
        namespace host to run it on (``namespace_host.enter_host``)."""
        ends, theirs = {}, [os.open(os.devnull, os.O_RDONLY)]
        for name, choice, own in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if choice == subprocess.PIPE:
                read, write = os.pipe()
                ends[name] = read
                theirs.append(write)
            elif choice == subprocess.STDOUT and name == "stderr":
                theirs.append(os.dup(theirs[1]))
            elif choice is None:
                theirs.append(os.dup(own))
            else:
                raise ValueError(f"{name}={choice!r}: PIPE, STDOUT or None")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = {"argv": [str(a) for a in argv], "cwd": os.path.abspath(cwd),
                       "env": dict(env), "new_session": start_new_session, "host": host}
            socket.send_fds(conn, [json.dumps(request).encode()], theirs)
            answer = json.loads(conn.recv(MESSAGE) or b'{"error": "the zygote ended"}')
        finally:
            for fd in theirs:
                os.close(fd)
        if "error" in answer:
            conn.close()
            raise RuntimeError(f"the test zygote could not start {argv}: {answer['error']}")
        return Child([sys.executable, *map(str, argv)], answer["pid"], conn, ends, text)

    def close(self):
        if self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._server.stdout.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.rmdir(self._folder)


def _read_line(stream, timeout):
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    return stream.readline() if selector.select(timeout) else b""


class Child:
    """What a test uses of ``subprocess.Popen`` for a zygote's child: ``pid``,
    ``args``, ``stdout``/``stderr`` (when piped), ``returncode``, ``poll``,
    ``wait``, ``communicate``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, args, pid, conn, ends, text):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._text, self._got = conn, text, {}
        self.stdout = self._file(ends.get("stdout"))
        self.stderr = self._file(ends.get("stderr"))

    def _file(self, fd):
        if fd is None:
            return None
        return open(fd, "r" if self._text else "rb", encoding="utf-8" if self._text else None)

    def poll(self):
        if self.returncode is None and _readable(self._conn, 0):
            self._collect()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not _readable(self._conn, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def _collect(self):
        data = self._conn.recv(MESSAGE)
        self._conn.close()
        if not data:
            raise RuntimeError(f"the test zygote ended before its child {self.pid} did")
        self.returncode = json.loads(data)["code"]

    def communicate(self, timeout=None):
        """(stdout, stderr) read to their end, then the exit; a timeout
        keeps what was read for the next call, as Popen's does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
        selector = selectors.DefaultSelector()
        for stream in streams:
            self._got.setdefault(stream, [])
            selector.register(stream.fileno(), selectors.EVENT_READ, stream)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            ready = selector.select(left) if left is None or left > 0 else []
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in ready:
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    self._got[key.data].append(chunk)
                else:
                    selector.unregister(key.fd)
                    key.data.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output(self.stdout), self._output(self.stderr)

    def _output(self, stream):
        if stream is None:
            return None
        data = b"".join(self._got.get(stream, []))
        if not self._text:
            return data
        return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")

    def send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _readable(sock, timeout):
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    return bool(selector.select(timeout))


def run(zygote, argv, cwd, env, timeout=None, host=None):
    """``subprocess.run(..., capture_output=True, text=True, timeout=...)`` for
    a zygote's child: a CompletedProcess; on a timeout the child is killed
    and TimeoutExpired raised, as subprocess.run does."""
    child = zygote.popen(argv, cwd, env, stderr=subprocess.PIPE, host=host)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)
