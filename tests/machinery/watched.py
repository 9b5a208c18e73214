"""A started process whose output is read as it comes, for tests and benchmarks
that wait for a line (a marker) instead of sleeping, and time what they saw."""

import re
import threading
import time


class Watched:
    """``proc``: a Popen with text stdout (stderr merged into it). Each line
    is kept with the moment it was read (``stamped``: [(monotonic s, line)])."""

    def __init__(self, proc):
        self.proc, self.stamped, self.ended = proc, [], False
        self._news = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def lines(self):
        return [line for _, line in self.stamped]

    def _read(self):
        for line in self.proc.stdout:
            with self._news:
                self.stamped.append((time.monotonic(), line))
                self._news.notify_all()
        with self._news:
            self.ended = True
            self._news.notify_all()

    def wait_for(self, pattern, count=1, timeout=120):
        """Until ``pattern`` (a regex) has appeared in ``count`` lines."""
        deadline = time.monotonic() + timeout
        with self._news:
            while sum(bool(re.search(pattern, line)) for line in self.lines) < count:
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    raise AssertionError(f"no {count} lines matching {pattern!r} "
                                         f"({'process ended' if self.ended else 'timed out'}):"
                                         f"\n{self.output()[-3000:]}")
                self._news.wait(left)

    def output(self):
        return "".join(self.lines)

    def finish(self, timeout=120):
        """(exit code, all output) once the process ended."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        with self._news:
            self._news.wait_for(lambda: self.ended, timeout=10)
        return self.proc.returncode, self.output()
