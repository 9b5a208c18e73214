"""The sealed channel to the job's store, for jobs with a secret: c10d's
TCPStore lets anyone who reaches its port read and write every key, so with
a secret each rank reaches the job's own store (server.py) only through a
mutual HMAC handshake (the secret never travels) and frames encrypted and
authenticated with keys of that connection (cipher.py). Each end stretches
the secret with the salt of its own job id, never with one the other end
sends. Nothing read from the network is unpickled. The listener's side is
gate.py; the secret's rules and salt, job_secret.py. docs/security.md, "The
handshake and the store's protocol".
"""

import hashlib
import hmac
import secrets
import socket
import struct
import time

from hetseq.base.errors import UserError
from hetseq.store import cipher
from hetseq.store.job_secret import job_words

# Version 3: no salt in the greeting, frames encrypted. A node of version 2
# meets it as "not a HetSeq job with a secret of this version".
MAGIC = b"HETSEQ-SECRET-3\n"
# The gate's answer when HANDSHAKES handshakes are already in progress: as
# long as MAGIC, so that a client reads either with one recv. It costs the
# gate no thread and no descriptor (sent, then closed at once).
BUSY = b"HETSEQ-BUSY----\n"
OK, NO, FULL = b"OK", b"NO", b"FL"     # the gate's verdict on a client's proof
NONCE = 32
TAG = hashlib.sha256().digest_size
HANDSHAKES = 32           # handshakes in progress at once (each holds a thread and a socket)
# Connections past the handshake served at once (each holds a thread): a
# member that opens connections without end is told FULL, not served.
SERVED = 1024
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
PAUSES_S = (0.05, 1.0)    # back-off after a busy answer or a failed accept: doubling, at most
CHUNK = 1 << 16

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


class Full(Busy):
    """The gate serves SERVED connections already: the client knows the
    secret, but no more connections are taken until one ends."""


def _session_seals(key, ns, nc):
    """(client to server, server to client): each direction's cipher, keyed
    from the stretched key and both nonces, so that every connection and
    direction has keys of its own (cipher.Seal numbers frames from 0)."""
    return cipher.Seal(_mac(key, b"c2s", ns, nc)), cipher.Seal(_mac(key, b"s2c", ns, nc))


def _where_bytes(address):
    """The gate's listening address as it states it: "HOST PORT"."""
    return f"{address[0]} {address[1]}".encode()[:255]


def _stated(where):
    """(host, port) from the gate's proven "HOST PORT"; Refused if it is not
    one (a member is trusted, but its words are still checked)."""
    host, _, port = where.decode("ascii", errors="replace").rpartition(" ")
    if not (host and host.isascii() and host.isprintable() and port.isdigit()
            and 1 <= int(port[:6]) <= 65535):
        raise Refused("it stated no address it listens on")
    return host, int(port)


def handshake_as_client(sock, secret, deadline=None):
    """(send seal, receive seal, (host, port) the gate says it listens on);
    raises Busy, Full, Refused or ConnectionError (socket.timeout past
    ``deadline``, a time.monotonic()). The key is ``secret`` stretched with
    the salt of this node's own job id (job_secret.job_id): the gate sends
    none, so a fake service cannot choose the salt of a table it made in
    advance. A gate of another secret or job id answers NO."""
    greeting = _recv_exact(sock, len(MAGIC), deadline)
    if greeting == BUSY:
        raise Busy("it has too many connections waiting in the handshake")
    if greeting != MAGIC:
        raise Refused("the other side is not a HetSeq job with a secret of this version")
    ns = _recv_exact(sock, NONCE, deadline)
    key, nc = secret.key(), secrets.token_bytes(NONCE)
    sock.sendall(nc + _mac(key, b"client", ns, nc))
    verdict = _recv_exact(sock, len(OK), deadline)
    if verdict == FULL:
        # Believed only with the gate's proof: a squatter must not make a
        # member wait, and blame another member, by answering "full".
        if not hmac.compare_digest(_recv_exact(sock, TAG, deadline),
                                   _mac(key, b"full", nc, ns)):
            raise Refused("it answered 'full' without proving that it knows the secret")
        raise Full("it serves all the connections it takes (a member that opens "
                   "connections without closing them?)")
    if verdict != OK:
        raise Refused(f"its secret differs from this node's, or its job id does (this node "
                      f"has {job_words(secret.job)})")
    where = _recv_exact(sock, _recv_exact(sock, 1, deadline)[0], deadline)
    if not hmac.compare_digest(_recv_exact(sock, TAG, deadline),
                               _mac(key, b"server", nc, ns, where)):
        raise Refused("it could not prove that it knows the secret (not the job you meant?)")
    c2s, s2c = _session_seals(key, ns, nc)
    return c2s, s2c, _stated(where)


def handshake_as_server(sock, secret, deadline, where, room=None):
    """(send seal, receive seal); raises Refused (Full when ``room()``, asked
    once the client proved the secret, says no) or ConnectionError
    (socket.timeout past ``deadline``, a time.monotonic()). ``where``: the
    listening address this gate states, under its proof, so that a relay in
    front of it shows (meeting_point._holder). The key is the gate's own
    (``secret``'s job id): it never stretches anything a client sends."""
    ns, key = secrets.token_bytes(NONCE), secret.key()
    sock.sendall(MAGIC + ns)
    reply = _recv_exact(sock, NONCE + TAG, deadline)
    nc, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"client", ns, nc)):
        sock.sendall(NO)
        raise Refused("wrong secret or job id (or none)")
    if room is not None and not room():
        sock.sendall(FULL + _mac(key, b"full", nc, ns))
        raise Full("it knows the secret, but all the connections the gate takes are served")
    stated = _where_bytes(where)
    sock.sendall(OK + bytes([len(stated)]) + stated + _mac(key, b"server", nc, ns, stated))
    c2s, s2c = _session_seals(key, ns, nc)
    return s2c, c2s


def connect_as_client(address, secret, patience_s=BUSY_WAIT_S):
    """A connection to the gate at ``address`` past the handshake: (socket,
    send seal, receive seal, the address the gate states). A busy or full
    gate is asked again after a pause that doubles (PAUSES_S) until
    ``patience_s`` have passed, then Busy (Full) is raised; also Refused,
    or OSError (socket.timeout: no greeting within GREETING_S)."""
    give_up, pause = time.monotonic() + patience_s, PAUSES_S[0]
    while True:
        sock = socket.create_connection(address, timeout=GREETING_S)
        try:
            send_key, receive_key, stated = handshake_as_client(
                sock, secret, time.monotonic() + GREETING_S)
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
        return sock, send_key, receive_key, stated


def send_frame(sock, seal, seq, data):
    """Send ``data`` (at most CHUNK bytes) as frame ``seq``: its length, then
    the data encrypted and authenticated with ``seal`` (a cipher.Seal),
    length included."""
    head = struct.pack(">I", len(data))
    sock.sendall(head + seal.seal(seq, head, data))


def receive_frame(sock, seal, seq):
    """Frame ``seq``'s data, or b"" at a clean end; raises Refused if it was
    forged, changed, replayed or reordered (it then fails to open). Its
    length is checked (at most CHUNK) before anything is read into memory."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if not head:
        return b""
    if len(head) < 4:
        raise ConnectionError("connection closed mid-frame")
    (length,) = struct.unpack(">I", head)
    if length == 0 or length > CHUNK:
        raise Refused(f"frame of {length} bytes")
    data = seal.open(seq, head, _recv_exact(sock, length + cipher.TAG))
    if data is None:
        raise Refused("a frame failed authentication")
    return data


def _close(*socks):
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def check(address, secret, url, patience_s=BUSY_WAIT_S):
    """Handshake once before any store call, so that a wrong secret is one
    clear message here (exit 2) and not a closed connection inside TCPStore."""
    try:
        connect_as_client(address, secret, patience_s)[0].close()
    except Full:
        raise UserError(f"the job at {url} serves all the connections it takes (up to "
                        f"{SERVED}: a member that opens connections without closing them?); "
                        f"this node waited {patience_s:.0f} s for one to end") from None
    except Busy:
        raise UserError(f"the job at {url} answered 'busy' for {patience_s:.0f} s: its port is "
                        f"flooded (more than {HANDSHAKES} connections at once waiting in the "
                        "secret handshake, a scan or an attack?); try again, and let only the "
                        "job's nodes reach the port (a firewall)") from None
    except Refused as err:
        raise UserError(f"the job at {url} refused this node: {err}. Every node of a job needs "
                        "the same secret (HETSEQ_JOB_SECRET or --job-secret-file) and the same "
                        "job id: the /JOB_ID that ends the URL hetseq-launch prints "
                        "(tcp://HOST:PORT/JOB_ID), or none, and then the same port, on every "
                        "node") from None
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
