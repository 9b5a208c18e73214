"""One node of a ``hetseq-launch`` job, as the launcher starts it on its
host (transport.node_command): ``... hetseq.launch.node -- PYTHON train.py
FLAGS``. It reads the job secret and the forwarded variables as one JSON
line on standard input (never a command line), runs the command in a
session of its own, relays its output through a bounded buffer, and stops
that session when its input says ``stop`` or closes: SIGTERM, then SIGKILL
once the time the command announced for its save has passed (``STOP_S``
when it said none), or at once when the input says ``kill``. It exits with
the command's code (128 + N after signal N). docs/nodes.md.
"""

# The buffer is on the node's own host: a launcher that is paused (Ctrl-Z)
# or slow to read never blocks the command (rank 0 would block writing its
# log line, and the whole job with it); past BUFFER_BYTES the oldest lines
# are dropped and counted, and the count is said once the launcher reads
# again. The wrapper refuses a folder another user could change
# (owned_file.py): the command's Python imports from it.

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

from hetseq.base.owned_file import others_can_change
from hetseq.base.stopping import announced_bound

STARTED = "hetseq-launch node started"   # the launcher reads (and hides) this line
STOP_S = 5.0              # after SIGTERM, until the command says how long its stop takes
KILL = b"kill"            # on standard input: stop at once (the launcher's second Ctrl-C)
PR_SET_PDEATHSIG = 1
ENV_LIMIT = 1 << 20
BUFFER_BYTES = 4 << 20    # the command's output held while nobody reads it
LINE_BYTES = 1 << 16      # a longer line is cut here (the launcher cuts there too)
FLUSH_S = 10.0            # at the end, how long the launcher gets to read what is held
AFTER_EXIT_S = 2.0        # after the command, how long its output may take to end
POLL_S = 0.1
NOT_OURS = 2              # exit code: the folder could be changed by another user


def read_env(stream):
    """The variables of the first line of ``stream`` (bounded, checked), and
    what was read past it (the launcher's word to stop, when it came at once)."""
    line = b""
    while b"\n" not in line and len(line) < ENV_LIMIT:
        chunk = os.read(stream.fileno(), 1 << 16)
        if not chunk:
            break
        line += chunk
    line, _, rest = line.partition(b"\n")
    try:
        env = json.loads(line.decode("utf-8"))["env"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"hetseq.launch.node: expected a JSON line {{\"env\": {{...}}}} on "
                         f"standard input from hetseq-launch, got {len(line)} bytes that are not")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise SystemExit("hetseq.launch.node: 'env' must map names to strings")
    return env, rest


def die_with_parent():
    """In the command before exec: SIGKILL when this wrapper dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG; this wrapper forks from its main
    thread, which lives as long as it does). Elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def stop(proc, relay, now):
    """SIGTERM to the command's session; SIGKILL once the bound the command
    announced has passed (it saves first: base/stopping.py), STOP_S when it
    announced none, or when ``now`` (an Event) is set."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    began = time.monotonic()
    while not now.is_set() and time.monotonic() < began + (relay.bound or 0) + STOP_S:
        try:
            proc.wait(POLL_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Relay:
    """The command's output to this wrapper's standard output through a
    buffer of at most ``limit`` bytes: one thread reads the command (never
    blocked by the reader downstream), one writes (blocked as long as the
    launcher does not read); when a line finds the buffer full, the oldest
    lines held are dropped and counted, and the count is written before the
    next line that gets through."""

    def __init__(self, source, out_fd=1, limit=BUFFER_BYTES):
        self.source, self.out_fd, self.limit = source, out_fd, limit
        self.lines, self.held, self.dropped = collections.deque(), 0, 0
        self.bound = None      # seconds the command said its stop takes, once it said so
        self.cond, self.ended = threading.Condition(), False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.reader.start()
        self.writer.start()

    def _read(self):
        pending = b""
        while True:
            try:
                chunk = os.read(self.source, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > LINE_BYTES:
                lines.append(pending[:LINE_BYTES])
                pending = b""
            for line in lines:
                self._seen(line)
                self._hold(line[:LINE_BYTES] + b"\n")
        if pending:
            self._hold(pending + b"\n")
        with self.cond:
            self.ended = True
            self.cond.notify()

    def _seen(self, line):
        bound = announced_bound(line[:200].decode("utf-8", "replace"))
        if bound is not None:
            self.bound = max(self.bound or 0.0, bound)

    def _hold(self, line):
        with self.cond:
            # The oldest lines go first: the newest (where the job is now,
            # how it ended) are what someone who looks again wants.
            while self.lines and self.held + len(line) > self.limit:
                self.held -= len(self.lines.popleft())
                self.dropped += 1
            self.lines.append(line)
            self.held += len(line)
            self.cond.notify()

    def _write(self):
        while True:
            with self.cond:
                while not self.lines and not self.ended:
                    self.cond.wait()
                if not self.lines:
                    return
                line, dropped = self.lines.popleft(), self.dropped
                self.held -= len(line)
                self.dropped = 0
            if dropped:
                line = (f"hetseq.launch.node: {dropped} line(s) of output dropped: nobody read "
                        f"them (the launcher was paused or slow) while {self.limit} bytes were "
                        "held\n").encode() + line
            try:
                while line:
                    line = line[os.write(self.out_fd, line):]
            except OSError:
                return            # nobody reads this node any more: the rest is dropped

    def finish(self, timeout=FLUSH_S):
        """Once the command is gone: waits AFTER_EXIT_S for its output to end
        (a process that left its session, a daemon, may hold the pipe open
        for ever: its end is the command's, not the pipe's), then at most
        ``timeout`` seconds for a launcher that does not read."""
        self.reader.join(AFTER_EXIT_S)
        if self.reader.is_alive():
            with self.cond:
                self.ended = True            # the writer writes what is held, then stops
                self.cond.notify()
        self.writer.join(timeout)


def refused_folder(argv, cwd=None):
    """Why the command must not run here, or None: its working folder, or
    the folder of the script it runs, could be changed by another user."""
    cwd = cwd or os.getcwd()
    places = [("the launch folder", cwd)]
    if len(argv) > 1 and os.path.isfile(os.path.join(cwd, argv[1])):
        places.append(("the script", os.path.join(cwd, argv[1])))
    for what, path in places:
        why = others_can_change(path)
        if why:
            return (f"hetseq.launch.node: {what} {path} is not yours alone: {why}; whoever can "
                    "change it chooses the code the job runs, with its secret; run the job "
                    "from a folder of your own (mkdir -m 700 DIR; --remote-dir DIR)")
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m hetseq.launch.node -- COMMAND... (started by "
                         "hetseq-launch, which sends the environment on standard input)")
    refused = refused_folder(argv)
    if refused:
        print(refused, file=sys.stderr, flush=True)
        os._exit(NOT_OURS)
    given, early = read_env(sys.stdin)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **given}
    # Listening before the command starts: a stop that comes while it
    # starts still reaches it (ending.wait returns at once).
    ending, now = threading.Event(), threading.Event()

    def on_signal(*_):
        ending.set()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)

    def heard(chunk):
        if KILL in chunk:
            now.set()
        if not chunk or KILL in chunk or b"stop" in chunk:
            ending.set()
    if early:
        heard(early)

    def hold_stdin():
        # "stop", or EOF (the launcher let go of this node, or its connection
        # dropped): the command stops and saves; "kill": at once. (The
        # descriptor itself: the buffered reader's lock, held by this thread,
        # would stop the interpreter's exit.)
        while True:
            chunk = os.read(sys.stdin.fileno(), 4096)
            heard(chunk)
            if not chunk:
                return
    threading.Thread(target=hold_stdin, daemon=True).start()
    if ending.is_set():
        os._exit(exit_code(-signal.SIGTERM))
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)
    try:
        print(f"{STARTED} (pid {proc.pid})", flush=True)
    except OSError:
        ending.set()          # nobody reads this node any more
    relay = Relay(proc.stdout.fileno())
    threading.Thread(target=lambda: (proc.wait(), ending.set()), daemon=True).start()
    ending.wait()
    if proc.poll() is None:
        stop(proc, relay, now)
    # The command is done; what it left running in its session goes too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    relay.finish()
    try:
        sys.stdout.flush()
    except OSError:
        pass
    os._exit(exit_code(proc.wait()))


if __name__ == "__main__":
    main()
