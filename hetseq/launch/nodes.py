"""The nodes of a launched job as local processes (ssh, or the node wrapper
itself): each started in a session of its own with the environment on its
standard input, its output relayed line by line with its host in front,
and stopped through that input: ``stop`` (its job saves first) or ``kill``
(node.py stops everything it started). The launcher holds the only write
end of each input, so a launcher that dies, even by SIGKILL, closes them
too, which is a stop as well (ssh passes the end of input on, and a
dropped connection ends it).
"""

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from hetseq.launch.node import KILL, STARTED, exit_code
from hetseq.base.stopping import announced_bound
from hetseq.base.logs import printable

LINE_LIMIT = 1 << 16       # a longer line is cut (a node's output is not trusted to be sane)
CHUNK = 1 << 16
POLL_S = 0.5
AFTER_EXIT_S = 2.0


@dataclasses.dataclass
class Outcome:
    code: int | None = None
    reached: bool = False     # the wrapper started on its host
    stopped: bool = False     # the launcher asked it to stop
    bound: float | None = None  # the seconds its stop takes, once it said (base/stopping.py)
    last_line: str = ""       # what it said last (ssh's reason when it never started)
    seconds: float = 0.0


class RunningNode:
    """One node's local process; ``events`` receives the node once it ended
    (always: whatever happens to its output)."""

    def __init__(self, plan, command, cwd, env, events, out=sys.stdout, lock=None):
        self.plan, self.events, self.out = plan, events, out
        self.lock = lock or threading.Lock()
        self.outcome = Outcome()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self.proc.stdin.write((json.dumps({"env": env}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass               # it ended at once (ssh refused): its output says why
        threading.Thread(target=self._relay, daemon=True, name=f"relay {plan.label}").start()

    def _relay(self):
        """Its output, line by line, until it ends, or until the process has
        been gone for AFTER_EXIT_S (a process it left behind may hold the
        pipe open: its end is the process's, not the pipe's)."""
        pending, fd, gone = b"", self.proc.stdout.fileno(), None
        try:
            while True:
                if select.select([fd], [], [], POLL_S)[0]:
                    chunk = os.read(fd, CHUNK)
                    if not chunk:
                        break
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        self._line(line)
                    if len(pending) > LINE_LIMIT:
                        self._line(pending[:LINE_LIMIT])
                        pending = b""
                elif self.proc.poll() is not None:
                    gone = gone or time.monotonic()
                    if time.monotonic() - gone > AFTER_EXIT_S:
                        break
        finally:
            if pending:
                self._line(pending)
            self.outcome.seconds = time.monotonic() - self.started
            self.outcome.code = exit_code(self.proc.wait())   # last: "ended" from here on
            self.events.put(self)

    def _line(self, raw):
        # (A node's words reach the user's terminal: no escape sequences.)
        line = printable(raw.decode("utf-8", "replace").rstrip("\r"))
        if line.startswith(STARTED) and not self.outcome.reached:
            self.outcome.reached = True
            return
        if line:
            self.outcome.last_line = line
        bound = announced_bound(line)
        if bound is not None:
            self.outcome.bound = max(self.outcome.bound or 0.0, bound)
        self.show(f"{self.plan.label}: {line}")

    def show(self, text):
        """Print a line; one that cannot be printed (a closed or non-UTF-8
        terminal) is dropped, and the node's output is still read to its end."""
        with self.lock:
            try:
                print(text, file=self.out, flush=True)
            except UnicodeEncodeError:
                encoding = getattr(self.out, "encoding", None) or "ascii"
                print(text.encode(encoding, "replace").decode(encoding), file=self.out,
                      flush=True)
            except (OSError, ValueError):
                pass

    def stop(self, now=False):
        """Tell its wrapper to stop its processes: SIGTERM, and SIGKILL once
        the time their save takes has passed, or at once (``now``)."""
        self.outcome.stopped = True
        try:
            self.proc.stdin.write(KILL + b"\n" if now else b"stop\n")
            self.proc.stdin.flush()
            if now:
                self.proc.stdin.close()
        except (OSError, ValueError):
            pass            # it ended already, or was told (a closed input)

    def kill(self):
        """The local process itself (ssh): the remote wrapper sees its input end."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def running(self):
        return self.outcome.code is None
