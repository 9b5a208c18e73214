"""An elastic member does not wait for --distributed-timeout to learn that
another member is lost: a member whose heartbeat stood still for
--heartbeat-timeout is lost, and each process shuts down its TCP connections
to that member's address (``cut``), so a collective blocked on it fails at
once, as had it been killed (gloo's own abort does not unblock a waiting
collective). A rank whose collective failed tells the others, who shut down
their process group's connections too. docs/elastic.md, "How it works".
"""

import ipaddress
import json
import logging
import os
import socket
import threading
import time

from hetseq.distributed.health import INTERVAL_S, within

logger = logging.getLogger(__name__)


class Watchdog:
    """An elastic generation's heartbeats (``beat/<rank>``), in the leader's
    ``store`` under ``prefix``. Rank 0, whose process serves the store, reads
    every beat and publishes the ranks silent for ``timeout_s`` (``lost``);
    the others read only rank 0's beat, ``lost`` and ``ended``, so the store's
    work grows linearly with the ranks. A rank cuts its connections to the
    ranks found lost. ``ended`` (``end``): a rank's collective failed; every
    rank then cuts its connections to the members' hosts but the stores', and
    silence is no longer loss: the members are meeting. docs/elastic.md,
    "How it works"."""

    def __init__(self, store, rank, addresses, own_address, timeout_s, prefix="e/0", spare=()):
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.addresses, self.own_address = list(addresses), own_address
        self.spare = frozenset(spare)      # store ports: their connections are never cut
        self.beats = [f"{prefix}/beat/{r}" for r in range(len(self.addresses))]
        self.lost_key, self.ended_key = f"{prefix}/lost", f"{prefix}/ended"
        self.watched = self.beats if rank == 0 else self.beats[:1]
        self.lost, self.ended = [], False
        # A first beat now: the generation's first update needs every rank,
        # so no rank completes one before every rank's beat exists (a rank
        # frozen before its first timed beat was never told silent).
        try:
            within(timeout_s, lambda: store.set(self.beats[rank], "0"))
        except Exception:           # the thread's first query tells the same
            pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetseq-watchdog", daemon=True)
        self._thread.start()

    def _run(self):
        beats, silence = 0, Silence(len(self.watched), self.timeout_s, time.monotonic())
        while True:
            waited_from = time.monotonic()
            if self._stop.wait(INTERVAL_S / 2):
                return
            beats += 1
            silence.woke(waited_from, time.monotonic())
            try:
                counts, published, ended = within(self.timeout_s, lambda: self._beat(beats))
            except Exception:       # the leader's store: silent (paused, cut off) or gone
                counts, published, ended = None, [], False
            # The counts are as of now, after the query: a store that did not
            # answer was silent all through it (timed before the query, the
            # leader was told lost a whole timeout late, after the collective's
            # own --distributed-timeout had ended the generation anyway).
            now = time.monotonic()
            if self._stop.is_set() or self.ended:
                continue
            # The leader's word first: the next meeting need not wait for them.
            # Silence counts only before the generation ended (then the
            # members stop beating to meet); a rank that never beat is silent
            # since this watchdog started.
            heard = [] if ended else silence.lost(counts, now)
            found = sorted({r for r in heard + published if r != self.rank} - set(self.lost))
            self.lost += found
            if found and self.rank == 0:
                # Published before the cut: a rank that reads the end the cut
                # causes (``ended``, read first in _beat) reads these too.
                self._publish()
            for r in found:
                try:
                    self._give_up(r)
                except OSError as err:    # /proc unreadable: the timeout still tells
                    logger.warning("could not cut rank %d's connections: %s", r, err)
            if ended:
                self._end_here()

    def _beat(self, beats):
        """Beat; (the watched counts, None for a rank that never beat: it
        stays silent since the watchdog started; the ranks the leader
        published lost; whether a rank's collective failed)."""
        store = self.store
        store.set(self.beats[self.rank], str(beats))
        ended = store.add(self.ended_key, 0) > 0
        if store.check(self.watched):
            counts = [bytes(v).decode() for v in store.multi_get(self.watched)]
        else:   # one key each, only until every rank beat once
            counts = [bytes(store.get(k)).decode() if store.check([k]) else None
                      for k in self.watched]
        published = [] if self.rank == 0 or not store.check([self.lost_key]) else \
            self._ranks(store.get(self.lost_key))
        return counts, published, ended

    def _ranks(self, value):
        """The leader's list of lost ranks, as far as it is one (a member's
        word: only ranks of this generation count)."""
        try:
            said = json.loads(bytes(value))
        except ValueError:
            return []
        size = len(self.addresses)
        return [r for r in said if type(r) is int and 0 <= r < size] \
            if isinstance(said, list) else []

    def _publish(self):
        try:
            within(self.timeout_s, lambda: self.store.set(self.lost_key, json.dumps(self.lost)))
        except Exception as err:    # its own store: only a stopping process gets here
            logger.warning("could not publish the lost ranks %s: %s", self.lost, err)

    def end(self):
        """This rank's collective failed: tell every rank, from a thread of
        its own (the leader's store may be the reason, and the rank must not
        wait for it before it meets again)."""
        def tell():
            try:
                self.store.add(self.ended_key, 1)
            except Exception:     # the store is gone: the others' heartbeats tell
                pass
        threading.Thread(target=tell, name="hetseq-ended", daemon=True).start()

    def _end_here(self):
        self.ended = True
        closed = cut(set(self.addresses), self.spare)
        logger.info("a rank's collective failed: closed this process's %d process-group "
                    "connection(s)", closed)

    def _give_up(self, rank):
        address = self.addresses[rank]
        if address == self.own_address:
            logger.warning("no heartbeat from rank %d for %.0f s; it shares this host's address "
                           "%s, so its connections cannot be told apart: waiting for "
                           "--distributed-timeout", rank, self.timeout_s, address)
            return
        closed = cut(address, self.spare)
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
        (a count None: that member never beat; ``counts`` None: the leader's
        store did not answer, and only the leader, whose process serves it,
        can then be told silent)."""
        for r, count in enumerate(counts or ()):
            if count != self.seen.get(r):
                self.seen[r], self.heard[r] = count, now
        watched = self.heard if counts is not None else [0]
        return [r for r in watched if now - self.heard[r] > self.timeout_s]


ESTABLISHED = "01"      # /proc/net/tcp's state column


def cut(address, spare=()):
    """Shut down this process's established TCP connections to ``address``
    (one, or a set: the members' hosts), except those on a port in
    ``spare`` at either end (the stores: a member meeting again keeps
    them); how many. A blocked recv on one of them returns at once (end of
    stream)."""
    targets = {ipaddress.ip_address(a) for a in ([address] if isinstance(address, str)
                                                  else address)}
    sockets = _socket_fds()
    closed = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode not in sockets or fields[3] != ESTABLISHED:
                continue
            if _proc_port(fields[1]) in spare or _proc_port(fields[2]) in spare:
                continue
            if _proc_address(fields[2]) not in targets:
                continue
            if _shut(sockets[inode], inode):
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


def _proc_port(field):
    return int(field.split(":")[1], 16)


def _proc_address(field):
    """The IP address of /proc/net/tcp's ``HEX:PORT`` (each 32-bit word in
    host order); an IPv4-mapped IPv6 address as its IPv4 address."""
    raw = bytes.fromhex(field.split(":")[0])
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip
