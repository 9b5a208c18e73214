"""Logging basics that every layer may use, start-up included: the set-up
(rank 0 at INFO, the others at WARNING), the node's own lines (NODE),
helpers that keep waiting and refusals from flooding the log, and the
files a run writes for people to read (BestEffort): a full disk stops them
with one line, never the run."""

import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

_FORMAT = "%(asctime)s | {label} | %(levelname)s | %(name)s | %(message)s"


# Lines every node prints, from its first process, whatever --log-all-ranks:
# joining, waiting at start-up, ending. Other INFO lines come from rank 0 only.
NODE = logging.getLogger("hetseq.node")
WAIT_LINE_S = 12.0     # how often a waiting node says what it waits for


def printable(text, replacement="?"):
    """``text`` safe for a terminal: every character that is not printable
    (escapes, carriage returns, other control characters) replaced. For
    text that others wrote (a peer's store entry, a node's output): an
    escape sequence could rewrite the screen or what a terminal sends. A tab
    stays."""
    return "".join(c if c.isprintable() or c == "\t" else replacement for c in str(text))


def rank_ranges(ranks):
    """'0-3' or '1, 4' for a set of ranks."""
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class Every:
    """True from ``due()`` once every ``seconds`` (the first time after ``seconds``)."""

    def __init__(self, seconds=WAIT_LINE_S):
        self.seconds, self.next = seconds, time.monotonic() + seconds

    def due(self):
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.seconds
        return True


class Tally:
    """Warnings that anyone can cause (refused connections), kept from
    flooding the log: the first from a source is logged at once, the rest
    counted and summed up in one line per source once ``seconds`` have
    passed (at the next one after them). At most ``sources`` are told apart;
    the others are counted together."""

    def __init__(self, seconds=30.0, sources=64):
        self.seconds, self.sources = seconds, sources
        self._lock = threading.Lock()
        self._counts = {}        # source -> [not yet logged, the last reason]
        self._next = time.monotonic() + seconds

    def add(self, source, why):
        """Count one; returns (whether to log this one, [(source, count,
        last reason)] to log as a summary now)."""
        with self._lock:
            if source not in self._counts and len(self._counts) >= self.sources:
                source = "other addresses"
            first = source not in self._counts
            entry = self._counts.setdefault(source, [0, why])
            if not first:
                entry[0] += 1
            entry[1] = why
            due, now = [], time.monotonic()
            if now >= self._next:
                due = [(s, n, w) for s, (n, w) in self._counts.items() if n]
                self._counts, self._next = {}, now + self.seconds
        return first, due


def setup_logging(rank=0, all_ranks=False, node_first=False, label=None):
    """Log INFO on rank 0 and only WARNING and above elsewhere (unless all_ranks);
    the node's lines (``NODE``) at INFO on each node's first process. Each
    line says ``label``, by default 'rank RANK' (a node's own process, before
    its ranks start: 'rank 2-3', or 'node' before they are known)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_hetseq", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._hetseq = True
    handler.setFormatter(logging.Formatter(_FORMAT.format(label=label or f"rank {rank}"),
                                           "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    NODE.setLevel(logging.INFO if rank == 0 or all_ranks or node_first else logging.WARNING)


# Errors that say the disk (or the user's quota on it) has no room left.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def os_error(err: BaseException | None) -> OSError | None:
    """The OSError ``err`` is, or that it was raised from or while handling
    (TensorBoard's writer thread hands a failed write on in an error of its
    own), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception it came from) says there is no room
    left: ENOSPC or EDQUOT. torch.save's own writer reports a full disk only
    in words ('No space left on device', inside a RuntimeError)."""
    found = os_error(err)
    if found is not None:
        return found.errno in DISK_FULL
    seen = set()
    while err is not None and id(err) not in seen:
        if "No space left" in str(err) or "quota exceeded" in str(err).lower():
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


# How torch.save says that writing to a path failed: in words, with no errno
# (its C++ stream hides the OS's error; a full disk reads the same).
_TORCH_WRITE_FAILED = ("iostream error", "unexpected pos", "PytorchStreamWriter failed")


def write_failed(err: BaseException | None) -> bool:
    """Whether ``err`` says a file could not be written: an OSError in its
    chain, or torch.save's words for a failed write."""
    if os_error(err) is not None or disk_full(err):
        return True
    seen = set()
    while err is not None and id(err) not in seen:
        if any(words in str(err) for words in _TORCH_WRITE_FAILED):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} bytes"
    value, unit = count / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.1f} {unit}"


def disk_of(path: str) -> str:
    """The disk that holds ``path``, for a message: 'the disk mounted at /data
    (0 bytes of 256.0 KiB free)'. The file, or its folder, may be gone: the
    nearest folder above it that exists is the one measured."""
    place = os.path.abspath(path)
    while not os.path.exists(place) and os.path.dirname(place) != place:
        place = os.path.dirname(place)
    mount = os.path.realpath(place)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        stats = os.statvfs(place)
    except OSError:
        return f"the disk mounted at {mount}"
    return (f"the disk mounted at {mount} ({_size(stats.f_bavail * stats.f_frsize)} of "
            f"{_size(stats.f_blocks * stats.f_frsize)} free)")


def why_not_written(err: BaseException) -> str:
    """Why a write failed, in a few words: the OS's reason when there is one."""
    found = os_error(err)
    if found is not None and found.strerror:
        return found.strerror
    if disk_full(err):
        return "No space left on device"
    if write_failed(err):       # torch.save's words, which hide the OS's reason
        return "the write failed"
    text = str(err).strip()
    return text.splitlines()[-1][:200] if text else type(err).__name__


_T = TypeVar("_T")


class BestEffort:
    """A file written for people to read while the run trains (balance.jsonl,
    valid.jsonl, TensorBoard's events): none of it is in a checkpoint, and
    losing it must not cost the updates since the last save. A write that
    fails (a full disk, a quota, a folder that went away, any OSError) stops
    the file: one warning names it, the reason and its disk, and nothing more
    is written to it; training goes on. ``path`` None: writes nothing."""

    def __init__(self, path: str | None, what: str,
                 log: logging.Logger | None = None) -> None:
        self.path, self.what = path, what
        self.stopped = False
        self._log = log or logging.getLogger("hetseq.run")

    @property
    def writing(self) -> bool:
        return self.path is not None and not self.stopped

    def attempt(self, write: Callable[[], _T]) -> _T | None:
        """``write()``'s result, or None when the file is stopped or the write
        fails with an OSError (then it stops, with its one warning)."""
        if not self.writing:
            return None
        try:
            return write()
        except OSError as err:
            self.stop(err)
            return None

    def stop(self, err: BaseException) -> None:
        """Stop writing the file, saying why, once."""
        if self.stopped or self.path is None:
            return
        self.stopped = True
        self._log.warning("%s: cannot write to %s (%s; %s); training goes on without it",
                          self.what, self.path, why_not_written(err), disk_of(self.path))
