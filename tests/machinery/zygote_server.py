"""The test zygote's own process (machinery/zygote.py starts it): it imported
PRELOAD once and forks a child per request that runs the command as
``python`` would.

What a child shares with the zygote, and why that does not change what the
tests see:
- modules imported before its flags were read: HetSeq reads its flags and
  environment at run time, not at import; what the imports did to the
  environment and printed, a child does again (``Preloaded``); a command
  whose variables read at start (zygote.AT_START) differ from the zygote's
  gets a process of its own (``Zygote.serves``);
- Python's hash seed (the same in every child; ranks forked from a fork
  server share theirs already); ``random`` reseeds itself after a fork and
  torch's generators start from their fixed seed in any fresh process;
- the zygote never runs an OpenMP region, so a fork is safe (the fork
  server's rule, spawn.start_method).
On a namespace host the child enters the host itself (namespace_host.py).
"""

import atexit
import gc
import io
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import threading
import traceback

from machinery.namespace_host import enter_host

# What every train.py imports before its first update, hetseq first as its
# entry points do (hetseq/__init__.py sets a variable only before torch loads);
# not quick_exit (its atexit would end every child with code 0).
PRELOAD = ("hetseq", "torch", "torch._dynamo", "torch.distributed.fsdp", "hetseq.app.main",
           "hetseq.run.loop", "hetseq.elastic.agent")
MESSAGE = 1 << 20          # one request (arguments and environment) at most, in bytes


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
        # os.environ may have changed since (a test's process that calls this).
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
    # What the imports made goes to the collector's permanent generation: a
    # child's collections never walk it, so the kernel never copies the pages
    # it sits on into the child (as spawn._frozen_for does for ranks).
    gc.collect()
    gc.freeze()
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


if __name__ == "__main__":
    serve(sys.argv[1])
