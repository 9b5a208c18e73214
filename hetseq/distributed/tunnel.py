"""An authenticated path to the job's store, for jobs with a secret.

c10d's TCPStore has no authentication: anyone who reaches its port can read
and write every key (rank claims, the job identity, gloo's addresses). With a
job secret the store is reached only through this tunnel:

    rank k's TCPStore client -> 127.0.0.1:local (ClientRelay, same user only)
        == authenticated frames over the job's network ==>
    Gate on HOST:PORT (rank 0, the job's interface only) -> TCPStore on 127.0.0.1

Handshake (mutual, the secret never travels): the gate sends MAGIC and a
nonce Ns; the client answers with its nonce Nc and HMAC(K, "client" Ns Nc);
the gate checks it and proves itself with HMAC(K, "server" Nc Ns). Each
direction then has its own key, HMAC(K, "c2s"/"s2c" Ns Nc), and every frame
carries HMAC(key, sequence number, data): a frame changed, replayed,
reordered or injected by a process without the secret closes the connection.
Nothing read from the network is unpickled; the payload is TCPStore's own
byte protocol.
"""

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading

from hetseq.errors import UserError

logger = logging.getLogger(__name__)

MAGIC = b"HETSEQ-SECRET-1\n"
NONCE = 32
TAG = hashlib.sha256().digest_size
HANDSHAKE_S = 10.0        # a peer that does not finish the handshake in this time is dropped
# The gate greets as soon as it accepts: one round trip. A listener silent for
# this long is a plain TCPStore (a job without a secret).
GREETING_S = 3.0
CHUNK = 1 << 16


def _mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock, n):
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("connection closed")
        data += got
    return bytes(data)


class Refused(Exception):
    """The other side does not know the secret (or speaks another protocol)."""


def _session_keys(secret, ns, nc):
    return _mac(secret, b"c2s", ns, nc), _mac(secret, b"s2c", ns, nc)


def handshake_as_client(sock, secret):
    """Returns (send key, receive key); raises Refused or ConnectionError."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE)
    if not hello.startswith(MAGIC):
        raise Refused("the other side is not a HetSeq job with a secret")
    ns, nc = hello[len(MAGIC):], secrets.token_bytes(NONCE)
    sock.sendall(nc + _mac(secret, b"client", ns, nc))
    answer = _recv_exact(sock, 2)
    if answer != b"OK":
        raise Refused("its secret differs from this node's")
    if not hmac.compare_digest(_recv_exact(sock, TAG), _mac(secret, b"server", nc, ns)):
        raise Refused("it could not prove that it knows the secret (not the job you meant?)")
    c2s, s2c = _session_keys(secret, ns, nc)
    return c2s, s2c


def handshake_as_server(sock, secret):
    """Returns (send key, receive key); raises Refused or ConnectionError."""
    ns = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + ns)
    reply = _recv_exact(sock, NONCE + TAG)
    nc, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", ns, nc)):
        sock.sendall(b"NO")
        raise Refused("wrong secret (or none)")
    sock.sendall(b"OK" + _mac(secret, b"server", nc, ns))
    c2s, s2c = _session_keys(secret, ns, nc)
    return s2c, c2s


def _seal(sock, key, seq, data):
    sock.sendall(struct.pack(">I", len(data)) + _mac(key, struct.pack(">Q", seq), data) + data)


def _open(sock, key, seq):
    """The next frame's data, or b"" at a clean end; raises Refused if forged."""
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


def _pump_plain_to_sealed(plain, sealed, key, stop):
    seq = 0
    try:
        while not stop.is_set():
            data = plain.recv(CHUNK)
            if not data:
                break
            _seal(sealed, key, seq, data)
            seq += 1
    except OSError:
        pass
    finally:
        stop.set()
        _close(plain, sealed)


def _pump_sealed_to_plain(sealed, plain, key, stop, where):
    seq = 0
    try:
        while not stop.is_set():
            data = _open(sealed, key, seq)
            if not data:
                break
            plain.sendall(data)
            seq += 1
    except Refused as err:
        logger.warning("closed a store connection from %s: %s", where, err)
    except OSError:
        pass
    finally:
        stop.set()
        _close(plain, sealed)


def _close(*socks):
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _relay(plain, sealed, send_key, receive_key, where):
    """Pump both ways until either side closes."""
    stop = threading.Event()
    for target, args in ((_pump_plain_to_sealed, (plain, sealed, send_key, stop)),
                         (_pump_sealed_to_plain, (sealed, plain, receive_key, stop, where))):
        threading.Thread(target=target, args=args, daemon=True).start()


def _serve_forever(listener, handle, name):
    """Accept connections on ``listener`` and hand each to ``handle(sock, peer)``
    in a thread of its own, until the listener is closed."""
    def accept():
        while True:
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(sock, peer), daemon=True).start()
    threading.Thread(target=accept, daemon=True, name=name).start()


class Gate:
    """Rank 0's listener on the job's address: authenticates each connection,
    then relays it to the store on 127.0.0.1:``store_port``."""

    def __init__(self, listener, store_port, secret):
        self.listener, self.store_port, self.secret = listener, store_port, secret
        _serve_forever(listener, self._admit, "hetseq-gate")

    def _admit(self, sock, peer):
        where = f"{peer[0]}:{peer[1]}"
        sock.settimeout(HANDSHAKE_S)
        try:
            send_key, receive_key = handshake_as_server(sock, self.secret)
        except Refused as err:
            logger.warning("refused a connection to the job's store from %s: %s", where, err)
            sock.close()
            return
        except OSError:       # a reachability probe, or a peer that gave up
            sock.close()
            return
        sock.settimeout(None)
        store = socket.create_connection(("127.0.0.1", self.store_port))
        _relay(store, sock, send_key, receive_key, where)


class ClientRelay:
    """A listener on 127.0.0.1 for this process's TCPStore client: each
    connection is carried to the gate at ``address`` through the handshake.
    Only processes of this user may use it (the gate trusts whoever it lets in)."""

    def __init__(self, address, secret):
        self.address, self.secret = address, secret
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        _serve_forever(self.listener, self._carry, "hetseq-relay")

    def _carry(self, sock, peer):
        if not same_user(peer, self.port):
            logger.warning("refused a local connection from port %d: another user", peer[1])
            sock.close()
            return
        try:
            remote = socket.create_connection(self.address, timeout=HANDSHAKE_S)
            send_key, receive_key = handshake_as_client(remote, self.secret)
            remote.settimeout(None)
        except (OSError, Refused) as err:
            logger.warning("could not carry a store connection to %s:%d: %s", *self.address, err)
            sock.close()
            return
        _relay(sock, remote, send_key, receive_key, "%s:%d" % self.address)


def same_user(peer, local_port):
    """Whether the loopback connection from ``peer`` to ``local_port`` belongs to
    a process of this user (Linux: /proc/net/tcp and tcp6 list each socket's
    uid; TCPStore connects over IPv6, with IPv4-mapped loopback addresses)."""
    ends = (f":{peer[1]:04X}", f":{local_port:04X}")
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        found = True
        for row in rows:
            if row[1].endswith(ends[0]) and row[2].endswith(ends[1]):
                return int(row[7]) == os.geteuid()
    return not found      # no /proc: nothing to check with


def check(address, secret, url):
    """Handshake once before any store call, so that a wrong secret is one
    clear message here (exit 2) and not a closed connection inside TCPStore."""
    try:
        with socket.create_connection(address, timeout=GREETING_S) as sock:
            handshake_as_client(sock, secret)
    except Refused as err:
        raise UserError(f"the job at {url} refused this node: {err}. Every node of a job needs "
                        "the same secret (HETSEQ_JOB_SECRET or --job-secret-file)") from None
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
    with a secret); a plain TCPStore says nothing until asked."""
    try:
        with socket.create_connection(address, timeout=HANDSHAKE_S) as sock:
            sock.settimeout(GREETING_S / 6)
            return sock.recv(len(MAGIC), socket.MSG_WAITALL) == MAGIC
    except OSError:
        return False


SECRET_VARIABLE = "HETSEQ_JOB_SECRET"
MIN_SECRET = 16
MAKE_ONE = "python -c \"import secrets; print(secrets.token_hex(32))\""


def read_secret(path, env=os.environ):
    """The job secret's key, from --job-secret-file (a file only its owner can
    read) or HETSEQ_JOB_SECRET; None when neither is given. The key is a hash
    of the secret, so the secret's text is never held or logged."""
    if path is not None:
        try:
            info = os.stat(path)
            with open(path, "rb") as f:
                text = f.read().strip()
        except OSError as err:
            raise UserError(f"--job-secret-file {path}: {err.strerror}") from None
        if info.st_mode & 0o077 or info.st_uid != os.geteuid():
            raise UserError(f"--job-secret-file {path}: readable by others (mode "
                            f"{info.st_mode & 0o777:o}, owner uid {info.st_uid}); it must be "
                            f"yours and private: chmod 600 {path}")
        where = f"--job-secret-file {path}"
    elif env.get(SECRET_VARIABLE):
        text, where = env[SECRET_VARIABLE].strip().encode(), SECRET_VARIABLE
    else:
        return None
    if len(text) < MIN_SECRET:
        raise UserError(f"{where}: the secret has {len(text)} characters, expected at least "
                        f"{MIN_SECRET} (a short one can be guessed from a recorded handshake); "
                        f"make one with: {MAKE_ONE}")
    return hashlib.sha256(b"hetseq job secret\0" + text).digest()
