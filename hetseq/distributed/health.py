"""Naming the rank that stopped answering, and not waiting for it.

A collective whose peer died raises within a second (gloo: connection
closed) or, for a frozen peer, after --distributed-timeout; neither says
which rank it was. Every rank therefore bumps a counter in the rendezvous
store once a second from a daemon thread. When a collective fails, the
survivors watch the counters for a few seconds: the ranks whose counters
stand still are the lost ones, named with the host and pid they registered.

An elastic member does not wait for the timeout (``Watchdog``): a member
whose counter stood still for --heartbeat-timeout is lost, and this process
shuts down its TCP connections to that member's address (``cut``). A
collective blocked on the member then fails at once, as it would had the
member been killed (gloo's own abort does not unblock a waiting collective:
measured with torch 2.13, ../shared/PLATFORM_NOTES.md).
"""

import ipaddress
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from hetseq.errors import PeerLost

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0


def beat_key(rank):
    return f"hetseq/beat/{rank}"


class Heartbeat:
    def __init__(self, store, rank):
        self.store, self.rank = store, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetseq-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.store.add(beat_key(self.rank), 1)
            except Exception:   # the store is gone: the failure is reported elsewhere
                return
            self._stop.wait(INTERVAL_S)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2 * INTERVAL_S)


def within(seconds, query):
    """``query()``, or TimeoutError after ``seconds``: TCPStore.add has no
    deadline of its own, and a store whose host became unreachable (a cut
    link, a frozen rank 0) would block it forever. The abandoned daemon
    thread ends with the process."""
    box = {}

    def run():
        try:
            box["value"] = query()
        except Exception as err:   # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="hetseq-store-query", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def silent_ranks(store, world_size, watch_s=3 * INTERVAL_S):
    """Ranks whose heartbeat does not advance over ``watch_s``; None when the
    store itself is unreachable (its server, rank 0, is gone)."""
    def counters():
        return [store.add(beat_key(r), 0) for r in range(world_size)]
    try:
        before = within(watch_s, counters)
        time.sleep(watch_s)
        after = within(watch_s, counters)
    except Exception:
        return None
    return [r for r in range(world_size) if after[r] == before[r]]


class Watchdog:
    """Beats for this member in the generation's ``store`` and watches every
    member's beats there (one check and one multi-get a beat: 2 requests a
    second per member at the leader's store). A member silent for
    ``timeout_s`` is lost: its connections are cut. The leader's store
    silent that long means the leader is lost."""

    def __init__(self, store, rank, addresses, own_address, timeout_s, key="beat"):
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.addresses, self.own_address = list(addresses), own_address
        self.keys = [f"{key}/{r}" for r in range(len(self.addresses))]
        self.lost = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetseq-watchdog", daemon=True)
        self._thread.start()

    def _run(self):
        beats, silence = 0, Silence(len(self.keys), self.timeout_s, time.monotonic())
        while True:
            waited_from = time.monotonic()
            if self._stop.wait(INTERVAL_S / 2):
                return
            beats += 1
            silence.woke(waited_from, time.monotonic())
            try:
                counts = within(self.timeout_s, lambda: self._beat(beats))
            except Exception:       # the leader's store: silent (paused, cut off) or gone
                counts = None
            # The counts are as of now, after the query: a store that did not
            # answer was silent all through it (timed before the query, the
            # leader was told lost a whole timeout late, after the collective's
            # own --distributed-timeout had ended the generation anyway).
            now = time.monotonic()
            if counts == [] or self._stop.is_set():   # nothing to compare; or stopped meanwhile
                continue
            for r in silence.lost(counts, now):
                if r != self.rank and r not in self.lost:
                    self.lost.append(r)
                    try:
                        self._give_up(r)
                    except OSError as err:    # /proc unreadable: the timeout still tells
                        logger.warning("could not cut rank %d's connections: %s", r, err)

    def _beat(self, beats):
        self.store.set(self.keys[self.rank], str(beats))
        if not self.store.check(self.keys):     # a member has not beaten yet
            return []
        return [bytes(v).decode() for v in self.store.multi_get(self.keys)]

    def _give_up(self, rank):
        address = self.addresses[rank]
        if address == self.own_address:
            logger.warning("no heartbeat from rank %d for %.0f s; it shares this host's address "
                           "%s, so its connections cannot be told apart: waiting for "
                           "--distributed-timeout", rank, self.timeout_s, address)
            return
        closed = cut(address)
        logger.warning("no heartbeat from rank %d (%s) for %.0f s: lost; closed %d connection(s) "
                       "to it", rank, address, self.timeout_s, closed)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2 * INTERVAL_S)


class Silence:
    """When each member's beat last changed, as a watchdog sees it; which
    members stood still for ``timeout_s``. A watchdog that did not run for a
    while (its process paused with SIGSTOP, or starved of CPU) cannot tell
    the others' silence from its own: it gives every member a fresh window
    (``woke``). Without that, a paused member waking up would find every
    other member silent (they went on without it) and cut them all, then
    never look for the generation they went on in."""

    def __init__(self, size, timeout_s, now):
        self.timeout_s = timeout_s
        self.seen, self.heard = {}, dict.fromkeys(range(size), now)

    def woke(self, waited_from, now):
        """The watchdog slept from ``waited_from`` to ``now``; over half the
        timeout is a stall of its own."""
        if now - waited_from > self.timeout_s / 2:
            self.heard = dict.fromkeys(self.heard, now)

    def lost(self, counts, now):
        """The members silent for ``timeout_s``, given their beat ``counts``
        (None: the leader's store did not answer; only the leader, whose
        process serves it, can then be told silent)."""
        for r, count in enumerate(counts or ()):
            if count != self.seen.get(r):
                self.seen[r], self.heard[r] = count, now
        watched = self.heard if counts is not None else [0]
        return [r for r in watched if now - self.heard[r] > self.timeout_s]


def cut(address):
    """Shut down every TCP connection of this process to ``address``; how
    many. A blocked recv on one of them returns at once (end of stream)."""
    target = ipaddress.ip_address(address)
    sockets = _socket_fds()
    closed = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote, inode = _proc_address(fields[2]), int(fields[9])
            if inode in sockets and remote == target and _shut(sockets[inode], inode):
                closed += 1
    return closed


def _shut(fd, inode):
    """Shut down the connection of socket ``inode`` at ``fd``, unless another
    thread closed it meanwhile (or ``fd`` now names another socket)."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(duplicate).st_ino != inode:
            return False
        sock = socket.socket(fileno=duplicate)
        duplicate = None            # the socket object owns it now
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.close()            # the duplicate only; the connection is shut for both
    finally:
        if duplicate is not None:
            os.close(duplicate)


def _socket_fds():
    """{socket inode: fd} of this process."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


def _proc_address(field):
    """The IP address of /proc/net/tcp's ``HEX:PORT`` (each 32-bit word in
    host order); an IPv4-mapped IPv6 address as its IPv4 address."""
    raw = bytes.fromhex(field.split(":")[0])
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def is_communication_error(err):
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        word in text for word in ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset",
                                  "Timed out", "timed out", "timeout", "pair closure"))


def _where(info):
    return f"host {info.get('host', '?')}, {info.get('addr', '?')}, pid {info.get('pid', '?')}"


def peer_lost(err, store, rank, world_size, peers):
    """The PeerLost to raise for a failed collective, naming the lost ranks."""
    silent = silent_ranks(store, world_size) if store is not None else None
    if silent is None:
        lost = [0]
        how = "rank 0 serves the rendezvous store and it is unreachable"
    else:
        lost = [r for r in silent if r != rank]
        how = "its heartbeat stopped" if lost else "no rank's heartbeat stopped"
    names = ", ".join(f"rank {r} ({_where(peers.get(r, {}))})" for r in lost) or "no rank identified"
    cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return PeerLost(f"lost {names}: {how}. Rank {rank} stops too. Collective error: {cause}")
