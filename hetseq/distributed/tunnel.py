"""An authenticated door to the job's store, for jobs with a secret.

c10d's TCPStore has no authentication: anyone who reaches its port can read
and write every key (rank claims, the job identity, gloo's addresses). With a
job secret the store is the job's own (store.py), reached only through this
door:

    rank k's RemoteStore == handshake, then sealed frames over the job's network ==>
    Gate on HOST:PORT (the job's interface only) -> the serving process's Table

Handshake (mutual, the secret never travels): the gate sends MAGIC and a
nonce Ns; the client answers with its nonce Nc and HMAC(K, "client" Ns Nc);
the gate checks it and proves itself with HMAC(K, "server" Nc Ns). Each
direction then has its own key, HMAC(K, "c2s"/"s2c" Ns Nc), and every frame
carries HMAC(key, sequence number, data): a frame changed, replayed,
reordered or injected by a process without the secret closes the connection.
Nothing read from the network is unpickled.

The door stays open under a flood: at most HANDSHAKES handshakes at once
(PER_SOURCE from one address), each for at most HANDSHAKE_S, BUSY for the rest, and failed accepts waited
out (Gate, _serve_forever). The secret itself must resist guessing
(read_secret).
"""

import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time

from hetseq.reporting import Tally
from hetseq.errors import UserError
from hetseq.owned_file import read_owned

logger = logging.getLogger(__name__)

MAGIC = b"HETSEQ-SECRET-1\n"
# The gate's answer when HANDSHAKES handshakes are already in progress: as
# long as MAGIC, so that a client reads either with one recv. It costs the
# gate no thread and no descriptor (sent, then closed at once).
BUSY = b"HETSEQ-BUSY----\n"
NONCE = 32
TAG = hashlib.sha256().digest_size
HANDSHAKES = 32           # handshakes in progress at once (each holds a thread and a socket)
# ... and from one source address: one machine that holds its handshakes
# open to the deadline, over and over, must not take every place (members
# come from other addresses). A loopback job's nodes share an address.
PER_SOURCE = 8
# A peer that has not finished the whole handshake (a few dozen bytes each
# way) in this time is dropped: anyone may connect, so each unfinished
# handshake must be cheap and short.
HANDSHAKE_S = 2.0
# The gate greets as soon as it accepts: one round trip. A listener silent for
# this long is a plain TCPStore (a job without a secret).
GREETING_S = 3.0
# How long a client keeps asking a gate that answers "busy" (a flood) before
# it gives up with a message.
BUSY_WAIT_S = 20.0
REFUSALS_LOG_S = 30.0   # refused handshakes: a source's first logged, then one line per interval
PAUSES_S = (0.05, 1.0)    # back-off after a busy answer or a failed accept: doubling, at most
POLL_S = 1.0              # an accept loop notices its listener closed within this
CHUNK = 1 << 16

_WARNED = set()


def _warn_once(kind, message, *args):
    """A warning that would repeat at every connection (a flood, a machine
    without /proc) is logged once per process."""
    if kind not in _WARNED:
        _WARNED.add(kind)
        logger.warning(message, *args)


def _mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock, n, deadline=None):
    """``n`` bytes; with ``deadline`` (time.monotonic()) the whole read must
    end by then (socket.timeout), however slowly the bytes trickle in."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the handshake took too long")
            sock.settimeout(left)
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("connection closed")
        data += got
    return bytes(data)


class Refused(Exception):
    """The other side does not know the secret (or speaks another protocol)."""


class Busy(Refused):
    """The gate has HANDSHAKES handshakes in progress (a flood?): ask again later.
    A Refused, so that code that does not retry fails closed."""


def _session_keys(secret, ns, nc):
    return _mac(secret, b"c2s", ns, nc), _mac(secret, b"s2c", ns, nc)


def handshake_as_client(sock, secret, deadline=None):
    """Returns (send key, receive key); raises Busy, Refused or ConnectionError
    (socket.timeout past ``deadline``, a time.monotonic())."""
    greeting = _recv_exact(sock, len(MAGIC), deadline)
    if greeting == BUSY:
        raise Busy("it has too many connections waiting in the handshake")
    if greeting != MAGIC:
        raise Refused("the other side is not a HetSeq job with a secret")
    ns, nc = _recv_exact(sock, NONCE, deadline), secrets.token_bytes(NONCE)
    sock.sendall(nc + _mac(secret, b"client", ns, nc))
    answer = _recv_exact(sock, 2, deadline)
    if answer != b"OK":
        raise Refused("its secret differs from this node's")
    if not hmac.compare_digest(_recv_exact(sock, TAG, deadline),
                               _mac(secret, b"server", nc, ns)):
        raise Refused("it could not prove that it knows the secret (not the job you meant?)")
    c2s, s2c = _session_keys(secret, ns, nc)
    return c2s, s2c


def handshake_as_server(sock, secret, deadline=None):
    """Returns (send key, receive key); raises Refused or ConnectionError
    (socket.timeout past ``deadline``, a time.monotonic())."""
    ns = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + ns)
    reply = _recv_exact(sock, NONCE + TAG, deadline)
    nc, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", ns, nc)):
        sock.sendall(b"NO")
        raise Refused("wrong secret (or none)")
    sock.sendall(b"OK" + _mac(secret, b"server", nc, ns))
    c2s, s2c = _session_keys(secret, ns, nc)
    return s2c, c2s


def connect_as_client(address, secret, patience_s=BUSY_WAIT_S):
    """A connection to the gate at ``address`` past the handshake: (socket,
    send key, receive key). A busy gate is asked again after a pause that
    doubles (PAUSES_S) until ``patience_s`` have passed, then Busy is raised;
    also Refused, or OSError (socket.timeout: no greeting within GREETING_S)."""
    give_up, pause = time.monotonic() + patience_s, PAUSES_S[0]
    while True:
        sock = socket.create_connection(address, timeout=GREETING_S)
        try:
            send_key, receive_key = handshake_as_client(sock, secret,
                                                        time.monotonic() + GREETING_S)
        except Busy:
            sock.close()
            if time.monotonic() + pause > give_up:
                raise
            time.sleep(pause)
            pause = min(2 * pause, PAUSES_S[1])
            continue
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock, send_key, receive_key


def _seal(sock, key, seq, data):
    sock.sendall(struct.pack(">I", len(data)) + _mac(key, struct.pack(">Q", seq), data) + data)


def _open(sock, key, seq):
    """The next frame's data, or b"" at a clean end; raises Refused if forged.
    Its length is checked (at most CHUNK) before anything is read into memory."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if not head:
        return b""
    if len(head) < 4:
        raise ConnectionError("connection closed mid-frame")
    (length,) = struct.unpack(">I", head)
    if length == 0 or length > CHUNK:
        raise Refused(f"frame of {length} bytes")
    tag, data = _recv_exact(sock, TAG), _recv_exact(sock, length)
    if not hmac.compare_digest(tag, _mac(key, struct.pack(">Q", seq), data)):
        raise Refused("a frame failed authentication")
    return data


def _close(*socks):
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _serve_forever(listener, handle, name, admit=None):
    """Accept connections on ``listener`` and hand each to ``handle(sock, peer)``
    in a thread of its own, until the listener is closed on purpose.
    ``admit(sock)``, called in the accepting thread, may refuse one (it then
    closes it). A failed accept (out of descriptors: EMFILE, ENFILE; a peer
    that reset: ECONNABORTED; ENOBUFS, ENOMEM) is logged once and waited out
    with a growing pause: were it the end of the loop, a flood of idle
    connections would close the door for good."""
    listener.settimeout(POLL_S)   # to notice a close: it does not wake a blocked accept

    def accept():
        pause = PAUSES_S[0]
        while listener.fileno() != -1:
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                continue
            except OSError as err:
                if listener.fileno() == -1:
                    return
                _warn_once((name, err.errno), "%s: accepting a connection failed (%s); it keeps "
                           "trying, with pauses of up to %.0f s", name, err, PAUSES_S[1])
                time.sleep(pause)
                pause = min(2 * pause, PAUSES_S[1])
                continue
            pause = PAUSES_S[0]
            if admit is None or admit(sock):
                threading.Thread(target=handle, args=(sock, peer), daemon=True).start()
    threading.Thread(target=accept, daemon=True, name=name).start()


# Every gate, so that it lives as long as the job whatever holds it (as
# rendezvous._LISTENERS for the sockets under the stores).
_GATES = []


class Gate:
    """A listener on the job's address that authenticates each connection and
    then calls ``serve(sock, send_key, receive_key, where)`` in that
    connection's thread (store.serve_connection: the job's store). At most
    ``handshakes`` handshakes run at once (``per_source`` from one address),
    each for at most HANDSHAKE_S; a connection beyond them is answered BUSY
    and closed at once, so that connections from anyone (no secret needed)
    cannot use up the process's threads or descriptors, and one machine
    cannot keep the members out."""

    def __init__(self, listener, secret, serve, handshakes=HANDSHAKES, per_source=PER_SOURCE):
        self.listener, self.secret, self.serve = listener, secret, serve
        self.handshakes, self.per_source = handshakes, per_source
        self._lock, self._busy = threading.Lock(), {}    # source address: handshakes in progress
        self._refusals = Tally(REFUSALS_LOG_S)
        _GATES.append(self)
        _serve_forever(listener, self._admit, "hetseq-gate", self._take_slot)

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

    def _admit(self, sock, peer):
        where = f"{peer[0]}:{peer[1]}"
        try:
            try:
                keys = handshake_as_server(sock, self.secret, time.monotonic() + HANDSHAKE_S)
            finally:
                self._release(peer[0])
        except Refused as err:
            self._refused(peer[0], where, err)
            sock.close()
            return
        except OSError:       # a reachability probe, a peer that gave up or was too slow
            sock.close()
            return
        sock.settimeout(None)
        try:
            self.serve(sock, *keys, where)
        except OSError as err:
            logger.warning("could not serve a connection from %s: %s", where, err)
            sock.close()


def check(address, secret, url, patience_s=BUSY_WAIT_S):
    """Handshake once before any store call, so that a wrong secret is one
    clear message here (exit 2) and not a closed connection inside TCPStore."""
    try:
        sock, _, _ = connect_as_client(address, secret, patience_s)
        sock.close()
    except Busy:
        raise UserError(f"the job at {url} answered 'busy' for {patience_s:.0f} s: its port is "
                        f"flooded (more than {HANDSHAKES} connections at once waiting in the "
                        "secret handshake, a scan or an attack?); try again, and let only the "
                        "job's nodes reach the port (a firewall)") from None
    except Refused as err:
        raise UserError(f"the job at {url} refused this node: {err}. Every node of a job needs "
                        "the same secret (HETSEQ_JOB_SECRET or --job-secret-file)") from None
    except ConnectionRefusedError:
        raise                   # nothing listens at that port: the caller says what it means
    except ConnectionError:
        raise UserError(f"the job at {url} closed the connection during the secret handshake: "
                        "it runs without a job secret (start this node without one) or it is "
                        "not a HetSeq job") from None
    except socket.timeout:
        raise UserError(f"the job at {url} did not start the secret handshake within "
                        f"{GREETING_S:.0f} s: it runs without a job secret (start this node "
                        "without HETSEQ_JOB_SECRET and --job-secret-file)") from None


def asks_for_secret(address):
    """Whether the listener at ``address`` greets with the handshake (a job
    with a secret, busy or not); a plain TCPStore says nothing until asked."""
    try:
        with socket.create_connection(address, timeout=HANDSHAKE_S) as sock:
            sock.settimeout(GREETING_S / 6)
            return sock.recv(len(MAGIC), socket.MSG_WAITALL) in (MAGIC, BUSY)
    except OSError:
        return False


SECRET_VARIABLE = "HETSEQ_JOB_SECRET"
MAKE_ONE = "hetseq-secret"   # hetseq/distributed/secret.py; also python -m hetseq.distributed.secret
MIN_BITS = 128
MIN_DISTINCT = 8
MAX_RUN = 8
MAX_FILE = 4096
HEX = set(b"0123456789abcdef")
# What generators print: hex, base64 and its URL-safe variant (hetseq-secret,
# openssl rand -hex/-base64, secrets.token_urlsafe, uuidgen, pwgen -s).
GENERATED = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_")
WORD = re.compile(rb"[a-z]+|[0-9]+")
RULE = (f"a secret needs {MIN_BITS} bits counted conservatively (4 per character when all are "
        "hex digits, else 6) in the characters generators print (letters, digits, + / = - _), "
        f"{MIN_DISTINCT} different characters, and nothing typed: no character {MAX_RUN} times "
        "in a row, no counting run, no repeated part, not lowercase words")


def weakness(text):
    """Why the secret ``text`` (bytes) could be guessed, or None. The count is
    what a random secret of that alphabet would hold; hand-typed text holds
    far less, hence the other rules. The secret's strength is the whole
    protection: a recorded handshake lets anyone test guesses offline at the
    speed of HMAC-SHA-256, and no key stretching makes a weak secret safe."""
    if not text:
        return "it is empty"
    bits = len(text) * (4 if set(text.lower()) <= HEX else 6)
    if bits < MIN_BITS:
        return f"it has {len(text)} characters, about {bits} bits"
    if len(set(text)) < MIN_DISTINCT:
        return f"it uses only {len(set(text))} different characters"
    if any(text[i:i + MAX_RUN] == text[i:i + 1] * MAX_RUN for i in range(len(text))):
        return f"a character repeats {MAX_RUN} times in a row"
    if not set(text) <= GENERATED:
        return "it has spaces or punctuation that generators do not print (typed words?)"
    if any(all(text[i + k + 1] - text[i + k] == 1 for k in range(MAX_RUN - 1))
           for i in range(len(text) - MAX_RUN + 1)):
        return f"it counts up for {MAX_RUN} characters (like 12345678 or abcdefgh)"
    if any(text == (text[:k] * (len(text) // k + 1))[:len(text)]
           for k in range(1, len(text) // 2 + 1)):
        return "it is a shorter part repeated"
    parts = re.split(rb"[-_]", text)
    if (text.isalpha() and text.islower()) or \
            (len(parts) >= 3 and all(WORD.fullmatch(part) for part in parts)):
        return "it is lowercase words (like my-job-secret-2024)"
    return None


def read_secret(path, env=os.environ):
    """The job secret's key, from --job-secret-file (a file only its owner can
    read) or HETSEQ_JOB_SECRET; None when neither is given. The key is a hash
    of the secret, so the secret's text is never held or logged."""
    text = secret_text(path, env)
    return None if text is None else hashlib.sha256(b"hetseq job secret\0" + text).digest()


def secret_text(path, env=os.environ):
    """The job secret's text, checked, from --job-secret-file or
    HETSEQ_JOB_SECRET (None when neither is given): for the key above, and
    for hetseq-launch, which hands it to its nodes."""
    if path is not None:
        text, where = _read_secret_file(path), f"--job-secret-file {path}"
    elif SECRET_VARIABLE in env:
        text, where = env[SECRET_VARIABLE].strip().encode(), SECRET_VARIABLE
        if not text:
            raise UserError(f"{SECRET_VARIABLE} is set but empty: unset it for a job without a "
                            f"secret, or give one made with {MAKE_ONE}")
    else:
        return None
    why = weakness(text)
    if why is not None:
        raise UserError(f"{where}: the secret could be guessed ({why}); {RULE}. Make one "
                        f"with: {MAKE_ONE} (or python -m hetseq.distributed.secret)")
    return text


def _read_secret_file(path):
    """The stripped text of the secret file: yours, private, no link."""
    return read_owned(path, f"--job-secret-file {path}", private=True, limit=MAX_FILE).strip()
