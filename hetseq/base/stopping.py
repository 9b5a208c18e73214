"""A stop asked of this node (SIGINT, SIGTERM): kept until the ranks agree on
it in an update's statistics, so that the run saves a checkpoint at that
update's end and exits 128 + the signal; a second signal stops at once.

One ``NodeStop`` per node, in memory shared by the node's processes: the
process that installed it (the command's own, the owner) answers signals
and says within how long the stop will be done (``ANNOUNCED``: the node
wrapper and ``hetseq-launch`` wait that long before they kill); the ranks
read the request, write that bound after each update and the agreed end.
"""

# Why a thread answers in a process that trains: Python runs a signal's
# handler in the main thread between two bytecodes, and a rank's main thread
# spends seconds inside one C++ call (a backward, a collective). The C-level
# handler writes the signal's number to the wakeup descriptor at once, and a
# thread reading it announces the bound and answers a second signal while the
# main thread is busy. A node's first process that starts ranks forks them
# while it has one thread, and it waits in Python meanwhile: its handler runs
# at once there, so it answers without a thread.

import math
import multiprocessing
import os
import re
import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
MARGIN_S = 10.0           # added to twice the measured update and save
MAX_BOUND_S = 3600.0      # what a wrapper or launcher waits at most, whatever a node says
AGAIN_S = 1.0             # a signal this soon after the first is the same one, delivered
                          # twice (a supervisor that signals the group and its child)
ANNOUNCED = re.compile(r"^hetseq: stopping within (\d{1,7}) s: ")
# The slots of the shared array.
REQUESTED, BOUND, SAVES, AGREED, UPDATES, SAVED = range(6)

_node = None


class NodeStop:
    """The node's stop, in ``values`` (a shared array of doubles, or a new one)."""

    def __init__(self, values=None, owner=None):
        self.values = values if values is not None else multiprocessing.RawArray("d", 6)
        self.owner = owner          # the pid that answers signals (None: it only records them)
        self.received, self.first = 0, None
        self.watched = False        # a thread answers (the main thread may be busy)

    def answer(self, signum):
        """One signal received by this process."""
        values = self.values
        if not values[REQUESTED]:
            values[REQUESTED] = signum
        if os.getpid() != self.owner:   # a rank the node's process started: it only records
            return
        if self.first is not None and time.monotonic() - self.first < AGAIN_S:
            return
        self.first = self.first or time.monotonic()
        self.received += 1
        name = signal.Signals(signum).name
        if self.received > 1 or values[BOUND] <= 0:
            why = "a second signal" if self.received > 1 else \
                "before the first update, nothing to save"
            _say(f"hetseq: {name}: stopping at once ({why}); nothing is saved beyond the last "
                 "checkpoint")
            _kill_descendants()
            os._exit(128 + signum)
        again = "Ctrl-C again" if signum == signal.SIGINT else f"a second {name}"
        what = "saves a checkpoint, " if values[SAVES] else "(--no-save: nothing saved) "
        _say(f"hetseq: stopping within {math.ceil(values[BOUND])} s: {name} received; the job "
             f"finishes this update, {what}then exits {128 + signum} ({again} stops at once)")


def _kill_descendants():
    """SIGKILL every process this one started, and theirs (a fork server's
    ranks are not its own children): from /proc where there is one."""
    children = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as stat:
                        parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(parent, []).append(int(entry))
    except OSError:
        pass
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for child in multiprocessing.active_children():     # (no /proc: its own children)
        child.kill()


def _say(text):
    # os.write: a handler may interrupt a print to the same stream.
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _handler(signum, _frame):
    if _node is not None and not _node.watched:
        _node.answer(signum)


def install():
    """In the node's own process, before it starts ranks: this node's stop,
    and the handlers of SIGINT and SIGTERM. Returns the NodeStop."""
    global _node
    _node = NodeStop(owner=os.getpid())
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    return _node


def shared():
    """The array a started rank adopts (None: no stop installed)."""
    return None if _node is None else _node.values


def adopt(values):
    """In a rank the node's process started: record signals in ``values``
    (``shared()``); the node's process answers them."""
    global _node
    if values is None:
        return
    _node = NodeStop(values)
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def answer_from_thread():
    """In the owner, from the main thread, once it starts no more processes
    of its own by fork (a thread would make that unsafe): a thread answers
    signals from now on, whatever the main thread is doing."""
    node = _node
    if node is None or node.watched or os.getpid() != node.owner \
            or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    node.watched = True

    def watch():
        while True:
            for signum in os.read(read, 64):
                if signum in SIGNALS:
                    node.answer(signum)
    threading.Thread(target=watch, daemon=True, name="hetseq stop").start()


def requested():
    """The signal that asked this node to stop (0.0: none)."""
    return 0.0 if _node is None else _node.values[REQUESTED]


def expect(update_s, save_s, saves=True):
    """After an update (or before a validation): a stop asked now takes up
    to ``update_s`` to reach the update's end where the ranks agree and
    ``save_s`` to save (``saves``: False under --no-save); the bound said is
    twice that and MARGIN_S (a loaded machine is slower)."""
    if _node is not None:
        values = _node.values
        values[SAVES] = float(saves)
        values[BOUND] = min(MAX_BOUND_S, 2 * (update_s + (save_s if saves else 0)) + MARGIN_S)


def agreed(signum, updates, saved):
    """The ranks stopped on ``signum`` after ``updates``; ``saved``: this
    process wrote the checkpoint."""
    if _node is not None:
        values = _node.values
        values[AGREED], values[UPDATES] = signum, updates
        values[SAVED] = max(values[SAVED], float(saved))


def outcome():
    """(signal, updates, saved here) of the stop the ranks agreed on, or None."""
    if _node is None or not _node.values[AGREED]:
        return None
    values = _node.values
    return int(values[AGREED]), int(values[UPDATES]), bool(values[SAVED])


def announced_bound(line):
    """The seconds a node's ``ANNOUNCED`` line gives its stop (at most
    MAX_BOUND_S), or None when ``line`` is not one."""
    found = ANNOUNCED.match(line)
    return None if found is None else min(MAX_BOUND_S, float(found.group(1)))
