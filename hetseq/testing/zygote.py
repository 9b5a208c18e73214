"""``python train.py ...`` for tests, forked from a process that imported torch once.

A suite of hundreds of short jobs on 2 cores spends most of its CPU starting
them: each ``python train.py`` imports torch (3.5 s of CPU on a 2-core AVX2
machine) and torch._dynamo (which torch.optim's first optimizer imports:
2.3 s more) before its first step of a few milliseconds. The zygote (the
name Android gives the same trick) is one process per test worker that
imported them once; asked over a Unix socket, it forks a child that runs the
command as ``python`` would: its own working directory, environment,
arguments and standard streams, ``__main__`` being the script, exit code as
the script's. A test gets a Popen-like ``Child``.

What a child shares with the zygote, and why that does not change what the
tests see:
- modules imported before its flags were read: HetSeq reads its flags and
  environment at run time, not at import; what the imports did to the
  environment and printed, a child does again (``Preloaded``); a command
  whose variables read at start (AT_START) differ from the zygote's gets a
  process of its own (``Zygote.serves``);
- Python's hash seed (the same in every child; ranks forked from a fork
  server share theirs already); ``random`` reseeds itself after a fork and
  torch's generators start from their fixed seed in any fresh process;
- the zygote never runs an OpenMP region, so a fork is safe (the fork
  server's rule, launch.start_method).
The child is the zygote's, not the test's: its exit code comes back over the
socket, and the test signals it by pid. On a namespace host the child
enters the host itself (cluster.enter_host). Tests that need a process
started from nothing (the launcher's nodes over SSH, the real launchers,
resource limits) keep ``subprocess``.
"""

import atexit
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# What every train.py imports before its first update; not quick_exit (its
# atexit would end every child with code 0).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "hetseq.main", "hetseq.run.loop",
           "hetseq.run.elastic")
MESSAGE = 1 << 20          # one request (arguments and environment) at most, in bytes
# Read by an interpreter or by torch's libraries when they start, so a child
# cannot take them from its own environment: a command whose values differ
# from the zygote's needs a process of its own (``Zygote.serves``).
# PYTHONPATH and PYTHONUNBUFFERED a child applies itself (``_become``).
AT_START = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH",
            "TORCH_CPP_LOG_LEVEL")
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED")


# ----------------------------------------------------------------- the zygote

class Preloaded:
    """What importing PRELOAD did, which a fresh interpreter's child would
    do again: ``base_path``, sys.path without the script's folder and
    PYTHONPATH (a child has its own); ``environ``, the variables the
    imports set (hetseq's own TORCH_CPP_LOG_LEVEL=FATAL), which a child
    takes where its environment has none; ``printed``, what they wrote
    to standard output and error, which every child writes first."""

    def __init__(self):
        import contextlib
        import importlib
        # The environment this process started with, as the kernel keeps it:
        # os.environ has had hetseq's own import already (this module's package).
        with open("/proc/self/environ", "rb") as f:
            before = dict(os.fsdecode(entry).partition("=")[::2]
                          for entry in f.read().split(b"\0") if entry)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                contextlib.ExitStack() as stack:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            for fd, file in ((1, out), (2, err)):
                os.dup2(file.fileno(), fd)           # what C code writes
            stack.enter_context(contextlib.redirect_stdout(_text(out)))   # and Python
            stack.enter_context(contextlib.redirect_stderr(_text(err)))
            try:
                for name in PRELOAD:
                    importlib.import_module(name)
            finally:
                stack.close()
                for fd, copy in zip((1, 2), saved):
                    os.dup2(copy, fd)
                    os.close(copy)
                self.printed = [_read_all(out), _read_all(err)]
                os.write(2, self.printed[1])       # the zygote's own log shows them too
        own = before.get("PYTHONPATH", "").split(os.pathsep)
        self.base_path = [entry for entry in sys.path[1:] if entry not in own]
        self.environ = {k: v for k, v in os.environ.items() if before.get(k) != v}


def _text(file):
    return io.TextIOWrapper(open(file.fileno(), "wb", closefd=False), encoding="utf-8",
                            write_through=True)


def _read_all(file):
    file.seek(0)
    return file.read()


def serve(path):
    """Import PRELOAD, listen at ``path``, fork a child per request, report
    each child's exit code on its request's connection; end when standard
    input closes (the test worker that started this ended)."""
    preloaded = Preloaded()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    for end in (wake_r, wake_w):
        end.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)     # only to wake the loop
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    running = {}            # pid -> the connection its exit code goes to
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                _fork(conn, running, [selector, listener, wake_r, wake_w], preloaded)
            elif key.fileobj is wake_r:
                while _drained(wake_r):
                    pass
            elif not os.read(sys.stdin.fileno(), 1):
                return
        _reap(running)


def _drained(sock):
    try:
        return bool(sock.recv(4096))
    except BlockingIOError:
        return False


def _reap(running):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            _answer(conn, {"code": os.waitstatus_to_exitcode(status)})
            conn.close()


def _fork(conn, running, own, preloaded):
    """Start the child ``conn`` asks for and tell it the pid (or why not);
    a request or a test gone wrong costs that request, not the zygote."""
    fds = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
        request = json.loads(data)
        if len(fds) != 3:
            raise ValueError(f"3 standard streams expected, got {len(fds)}")
        # The child closes ``settled`` once it leads its own session (when
        # asked): like Popen's, the pid goes back only then, so a killpg
        # right after works.
        waiting, settled = os.pipe()
        pid = os.fork()
    except (OSError, ValueError) as err:
        _answer(conn, {"error": str(err)})
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    if pid == 0:
        os.close(waiting)
        for sock in [*own, *running.values(), conn]:
            sock.close()
        _become(request, fds, settled, preloaded)       # never returns
    os.close(settled)
    os.read(waiting, 1)              # b"" once the child closed it (or ended)
    os.close(waiting)
    for fd in fds:
        os.close(fd)
    if _answer(conn, {"pid": pid}):
        running[pid] = conn
    else:
        conn.close()                 # the test went away: the child runs on, unwatched


def _answer(conn, message):
    try:
        conn.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _become(request, fds, settled, preloaded):
    """In the forked child: be ``python ARGV`` run in ``cwd`` with ``env``,
    as a fresh interpreter that imported PRELOAD would be (``Preloaded``);
    close ``settled`` once in a session of its own (when asked)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        os.close(settled)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["host"]:
            from hetseq.testing.cluster import enter_host
            enter_host(*request["host"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in preloaded.environ.items():
            os.environ.setdefault(name, value)
        _fresh_streams(bool(os.environ.get("PYTHONUNBUFFERED")))
        for stream, printed in zip((sys.stdout, sys.stderr), preloaded.printed):
            stream.buffer.write(printed)
            stream.flush()
        extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = ["", *extra, *preloaded.base_path]    # [0]: the script's folder (_run)
        code = _run(request["argv"])
    finally:
        os._exit(code)


def _fresh_streams(unbuffered):
    """sys.std* on the new descriptors, buffered as a fresh interpreter's are
    when they are pipes."""
    def stream(fd, mode, **kwargs):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", **kwargs)
    sys.stdin = sys.__stdin__ = stream(0, "r")
    sys.stdout = sys.__stdout__ = stream(1, "w", write_through=unbuffered)
    sys.stderr = sys.__stderr__ = stream(2, "w", errors="backslashreplace", line_buffering=True)


def _run(argv):
    """Run ``argv`` as ``python`` would (a script, or ``-m module``); its exit
    code, after what an interpreter does at exit (threads joined, atexit)."""
    import runpy
    try:
        if argv[0] == "-m":
            # Run as __main__ beside the copy PRELOAD imported, as a fresh
            # interpreter would (and without runpy's warning about it).
            sys.modules.pop(argv[1], None)
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = _exit_code(end.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: B036 -- an interpreter prints any uncaught one
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:         # as python does: end by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


# ------------------------------------------------------------ the test's side

class Zygote:
    """The zygote serving this process; ``popen`` starts a command from it."""

    def __init__(self, timeout=120):
        self._folder = tempfile.mkdtemp(prefix="hetseq-zygote-")     # mode 0700
        self.path = os.path.join(self._folder, "socket")
        self._env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._server = subprocess.Popen([sys.executable, "-m", __name__, self.path],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=self._env)
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
        namespace host to run it on (``cluster.enter_host``)."""
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
            request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env),
                       "new_session": start_new_session, "host": host}
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


if __name__ == "__main__":
    serve(sys.argv[1])
