"""The gate: the listener on the job's address that takes each connection
through channel.py's handshake before the job's store serves it, and stays
open under a flood: handshakes and served connections are capped (per
address too), a connection over a cap costs no thread, an accept error costs
one connection at most, and refusals are logged once per source and
interval. channel.py has the caps' numbers and the client's side;
docs/security.md, "Who is kept out", what each cap keeps out.
"""

import logging
import socket
import threading
import time

from hetseq.store.channel import (BUSY, HANDSHAKE_S, HANDSHAKES, PAUSES_S, PER_SOURCE,
                                       SERVED, Refused, handshake_as_server)
from hetseq.base.logs import Tally

logger = logging.getLogger(__name__)

REFUSALS_LOG_S = 30.0   # refused handshakes: a source's first logged, then one line per interval
POLL_S = 1.0              # an accept loop notices its listener closed within this

_WARNED: set[str] = set()


def _warn_once(kind, message, *args):
    """A warning that would repeat at every connection (a flood, a machine
    without /proc) is logged once per process."""
    if kind not in _WARNED:
        _WARNED.add(kind)
        logger.warning(message, *args)


def _serve_forever(listener, handle, name, admit=None, dropped=None):
    """Accept connections on ``listener`` and hand each to ``handle(sock, peer)``
    in a thread of its own, until the listener is closed on purpose.
    ``admit(sock)``, called in the accepting thread, may refuse one (it then
    closes it). A failed accept (out of descriptors: EMFILE, ENFILE; a peer
    that reset: ECONNABORTED; ENOBUFS, ENOMEM) is logged once and waited out
    with a growing pause, as is any other error of accept (MemoryError),
    and any error while taking one connection (no
    thread can be started) costs that connection only: were either the end
    of the loop, a flood would close the door for good."""
    listener.settimeout(POLL_S)   # to notice a close: it does not wake a blocked accept

    def accept():
        pause = PAUSES_S[0]
        while listener.fileno() != -1:
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                continue
            except Exception as err:      # EMFILE, ECONNABORTED, MemoryError: never the end
                if listener.fileno() == -1:
                    return
                _warn_once((name, getattr(err, "errno", type(err))),
                           "%s: accepting a connection failed (%s); it keeps "
                           "trying, with pauses of up to %.0f s", name, err, PAUSES_S[1])
                time.sleep(pause)
                pause = min(2 * pause, PAUSES_S[1])
                continue
            pause = PAUSES_S[0]
            try:
                if admit is None or admit(sock):
                    _start(handle, sock, peer, dropped)
            except Exception as err:        # out of threads, a bug: this connection only
                _warn_once((name, type(err)), "%s: could not take a connection from %s (%s); "
                           "it goes on taking the next ones", name, peer[0], err)
                sock.close()
                time.sleep(pause)
    threading.Thread(target=accept, daemon=True, name=name).start()


def _start(handle, sock, peer, dropped):
    """``handle(sock, peer)`` in a thread of its own; ``dropped(peer)`` gives
    back what ``admit`` took when no thread can be started (RuntimeError)."""
    try:
        threading.Thread(target=handle, args=(sock, peer), daemon=True).start()
    except BaseException:
        if dropped is not None:
            dropped(peer)
        raise


# Every gate, so that it lives as long as the job whatever holds it (as
# meeting_point._LISTENERS for the sockets under the stores).
_GATES: list["Gate"] = []


class Gate:
    """A listener on the job's address that authenticates each connection and
    then calls ``serve(sock, send_key, receive_key, where)`` in that
    connection's thread (server.serve_connection: the job's store). At most
    ``handshakes`` handshakes run at once (``per_source`` from one address),
    each for at most HANDSHAKE_S; a connection beyond them is answered BUSY
    and closed at once, so that connections from anyone (no secret needed)
    cannot use up the process's threads or descriptors, and one machine
    cannot keep the members out."""

    def __init__(self, listener, secret, serve, handshakes=HANDSHAKES, per_source=PER_SOURCE,
                 served=SERVED):
        self.listener, self.secret, self.serve = listener, secret, serve
        self.handshakes, self.per_source, self.served = handshakes, per_source, served
        self._lock, self._busy = threading.Lock(), {}    # source address: handshakes in progress
        self._serving = 0                                # connections past the handshake
        self._where = listener.getsockname()[:2]
        secret.key()              # derived once, before the first member waits for it
        self._refusals = Tally(REFUSALS_LOG_S)
        _GATES.append(self)
        _serve_forever(listener, self._admit, "hetseq-gate", self._take_slot,
                       lambda peer: self._release(peer[0]))

    def _take_slot(self, sock):
        """Whether ``sock`` may start its handshake: fewer than ``handshakes``
        in progress, and fewer than ``per_source`` from its address."""
        try:
            source = sock.getpeername()[0]
        except OSError:
            sock.close()
            return False
        with self._lock:
            if sum(self._busy.values()) < self.handshakes and \
                    self._busy.get(source, 0) < self.per_source:
                self._busy[source] = self._busy.get(source, 0) + 1
                return True
        _warn_once(("busy", id(self)), "more than %d connections at once (or %d from one "
                   "address) are in the secret handshake of the job's port %s (a flood?): the "
                   "others are answered 'busy'", self.handshakes, self.per_source,
                   self.listener.getsockname()[1])
        try:
            sock.setblocking(False)
            sock.send(BUSY)
        except OSError:
            pass
        sock.close()
        return False

    def _refused(self, source, where, why):
        """One line for a source's first refusal, then one per source and
        REFUSALS_LOG_S with the count: anyone can cause these."""
        first, due = self._refusals.add(source, str(why))
        if first:
            logger.warning("refused a connection to the job's store from %s: %s (more from "
                           "it are counted: one line every %.0f s)", where, why, REFUSALS_LOG_S)
        for other, count, last in due:
            logger.warning("refused %d more connections to the job's store from %s in the "
                           "last %.0f s (the last: %s)", count, other, REFUSALS_LOG_S, last)

    def _release(self, source):
        with self._lock:
            self._busy[source] -= 1
            if not self._busy[source]:
                del self._busy[source]

    def _room(self, placed):
        """Takes a place among the ``served`` connections, if one is free
        (``placed`` then holds it, to give it back whatever happens next)."""
        with self._lock:
            if self._serving >= self.served:
                return False
            self._serving += 1
        placed.append(True)
        return True

    def _admit(self, sock, peer):
        where, placed, keys = f"{peer[0]}:{peer[1]}", [], None
        try:
            try:
                keys = handshake_as_server(sock, self.secret, time.monotonic() + HANDSHAKE_S,
                                           self._where, lambda: self._room(placed))
            finally:
                self._release(peer[0])
            sock.settimeout(None)
            self.serve(sock, *keys, where)
        except Refused as err:
            self._refused(peer[0], where, err)
            sock.close()
        except OSError as err:
            # Before the handshake ended: a reachability probe, a peer that
            # gave up, reset or was too slow. After it: worth a line.
            if keys is not None:
                logger.warning("could not serve a connection from %s: %s", where, err)
            sock.close()
        finally:
            if placed:        # however the connection ended, its place is free again
                with self._lock:
                    self._serving -= 1
