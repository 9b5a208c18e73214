"""The job's key-value store for jobs with a secret, served only through the
sealed channel (channel.py: encrypted and authenticated): c10d's TCPStore
has no authentication, and a loopback port cannot be kept from other local users without root, so
with a secret no TCPStore runs at all. Both stores are torch Stores with
c10d's semantics and timeouts. torch holds only a Python store's C++ half:
keep the store referenced from Python while torch may call it (its clones
are held by the store they were cloned from). docs/security.md, "The
handshake and the store's protocol".
"""

import datetime
import logging
import re
import select
import socket
import struct
import threading
import time

import torch.distributed as dist

from hetseq.store import channel, gate
from hetseq.store.wire import (ADD, APPEND, CHECK, COMPARE_SET, DELETE_KEY, GET, INVALID, MAX_KEY,
                               MAX_KEYS, MAX_MESSAGE, MAX_VALUE, MULTI_GET, MULTI_SET, NUM_KEYS,
                               OK, REQUEST, RESPONSE, SET, TIMEOUT, WAIT, Malformed, Reader, blob,
                               encode, receive_message, send_message)

logger = logging.getLogger(__name__)

ANSWER_S = 10.0         # a server answers this long after a wait's timeout at the latest
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)   # c10d's default store timeout

# --- the server side ----------------------------------------------------------

def _client_gone(sock):
    """Whether a waiting request's client closed (or, breaking the protocol,
    sent more while its request is in flight): its socket became readable."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _answer(table, request, sock):
    """The response body to one request body; raises Malformed, Gone."""
    if not request or request[0] not in REQUEST:
        raise Malformed(f"unknown op {request[0] if request else None}")
    op = request[0]
    reader = Reader(request)
    reader.take(1)
    args = reader.fields(REQUEST[op])
    try:
        result = execute(table, op, args, lambda: _client_gone(sock))
    except WaitTimeout:
        return bytes([TIMEOUT])
    except ValueError as err:
        return bytes([INVALID]) + blob(str(err).encode()[:MAX_KEY])
    # Measured before it is built: 64 keys naming one 64 MiB value would
    # otherwise make a small request cost 4 GiB here.
    if op == MULTI_GET and sum(len(value) + 4 for value in result) > MAX_MESSAGE:
        return bytes([INVALID]) + blob(b"the answer would exceed the message bound")
    return bytes([OK]) + encode(RESPONSE[op], [result])


def serve_connection(table):
    """The handler the gate calls, in a thread of its own, for each connection
    that passed the handshake: answers requests on ``table`` until the client
    closes. A request that breaks the protocol closes only its connection."""
    def handle(sock, send_key, receive_key, where):    # (keys: channel's cipher.Seals)
        _tune(sock)
        send_seq = receive_seq = 0
        try:
            while True:
                request, receive_seq = receive_message(sock, receive_key, receive_seq)
                if request is None:
                    return
                send_seq = send_message(sock, send_key, send_seq, _answer(table, request, sock))
        except (Malformed, channel.Refused) as err:
            logger.warning("closed a store connection from %s: %s", where, err)
        except (Gone, OSError):
            pass
        except Exception:   # a bug here must not take the serving process down
            logger.exception("closed a store connection from %s after an error", where)
        finally:
            _close(sock)
    return handle


def _tune(sock):
    """Requests are small and answered at once (no Nagle delay); keepalive
    lets a server thread notice, eventually, a client behind a cut link."""
    for level, option in ((socket.IPPROTO_TCP, socket.TCP_NODELAY),
                          (socket.SOL_SOCKET, socket.SO_KEEPALIVE)):
        try:
            sock.setsockopt(level, option, 1)
        except OSError:
            pass


def _close(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# --- the stores ---------------------------------------------------------------

def _key(key):
    data = key.encode() if isinstance(key, str) else bytes(key)
    if len(data) > MAX_KEY:
        raise ValueError(f"a store key of {len(data)} bytes (at most {MAX_KEY})")
    return data


def _value(value):
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > MAX_VALUE:
        raise ValueError(f"a store value of {len(data)} bytes (at most {MAX_VALUE})")
    return data


def _keys(keys):
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one call (at most {MAX_KEYS})")
    return [_key(key) for key in keys]


def _delta(timeout):
    return timeout if isinstance(timeout, datetime.timedelta) else \
        datetime.timedelta(seconds=timeout)


def _seconds(timeout):
    """c10d's timeout as seconds; None for its 0, "no timeout"."""
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None


class _Front(dist.Store):
    """The Store interface on top of ``_request(op, args)``; what is common to
    the serving process's view and a client's."""

    def __init__(self, timeout):
        super().__init__()
        self.set_timeout(_delta(timeout))
        self._clones = []   # see the module docstring: torch holds only their C++ half

    def _waiting(self, op, keys, timeout, label):
        seconds = _seconds(self.timeout if timeout is None else _delta(timeout))
        try:
            return self._request(op, [seconds, keys])
        except WaitTimeout:
            raise dist.DistStoreError(f"wait timeout after {(seconds or 0) * 1000:.0f}ms, "
                                      f"keys: {label}") from None

    def set(self, key, value):
        self._request(SET, [_key(key), _value(value)])

    def get(self, key):
        return self._waiting(GET, _key(key), None, key)

    def add(self, key, amount):
        if not -2**63 <= int(amount) < 2**63:
            raise TypeError(f"add: {amount} is not a 64-bit integer")    # as HashStore
        return self._request(ADD, [_key(key), int(amount)])

    def check(self, keys):
        return self._request(CHECK, [_keys(keys)])

    def wait(self, keys, timeout=None):
        self._waiting(WAIT, _keys(keys), timeout, ", ".join(map(str, keys)))

    def compare_set(self, key, expected, desired):
        return self._request(COMPARE_SET, [_key(key), _value(expected), _value(desired)])

    def delete_key(self, key):
        return self._request(DELETE_KEY, [_key(key)])

    def num_keys(self):
        return self._request(NUM_KEYS, [])

    def append(self, key, value):
        self._request(APPEND, [_key(key), _value(value)])

    def multi_get(self, keys):
        return self._waiting(MULTI_GET, _keys(keys), None, ", ".join(map(str, keys)))

    def multi_set(self, keys, values):
        self._request(MULTI_SET, [_keys(keys), [_value(value) for value in values]])

    # torch's trampoline looks these two up by their C++ names (PrefixStore,
    # gloo and every C++ caller reach them only so).
    getNumKeys = num_keys
    deleteKey = delete_key

    def has_extended_api(self):
        return True      # append, multi_get and multi_set are implemented

    def clone(self):
        """A store on the same data that another thread may use at once (gloo
        and c10d's split/shrink clone stores)."""
        twin = self._twin()
        self._clones.append(twin)
        return twin


class LocalStore(_Front):
    """The serving process's own store: ``table`` directly, no network."""

    def __init__(self, table=None, timeout=DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self.table = Table() if table is None else table

    def _request(self, op, args):
        return execute(self.table, op, args)

    def _twin(self):
        return LocalStore(self.table, self.timeout)


class RemoteStore(_Front):
    """A client of the store served at ``address``: one authenticated
    connection; one request in flight at a time (a lock), a clone for
    concurrent use. Raises channel.Refused when the server does not share the
    secret, DistNetworkError when it cannot be reached or the connection is
    lost, DistStoreError when a wait or an answer takes longer than allowed."""

    def __init__(self, address, secret, timeout=DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self.address = (address[0], address[1])
        self._secret = secret
        self._lock = threading.Lock()
        self._lost = None
        self._sock, self._send_key, self._receive_key = self._connect()
        self._send_seq = self._receive_seq = 0

    def _connect(self):
        """An authenticated connection (channel.connect_as_client: it asks a busy
        gate again for a while); Refused passes through, other failures are
        DistNetworkError like a TCPStore that cannot reach its server."""
        patience = _seconds(self.timeout)
        patience = channel.BUSY_WAIT_S if patience is None else min(patience, channel.BUSY_WAIT_S)
        try:
            sock, send_key, receive_key, _ = channel.connect_as_client(
                self.address, self._secret, patience)
        except OSError as err:
            raise dist.DistNetworkError(f"could not reach the store at {self._where()}: "
                                        f"{err}") from None
        # Blocking from here on: _limit_socket bounds each call instead, since
        # channel.receive_frame's recv(MSG_WAITALL) needs a blocking socket.
        sock.settimeout(None)
        _tune(sock)
        return sock, send_key, receive_key

    def _twin(self):
        return RemoteStore(self.address, self._secret, self.timeout)

    def _request(self, op, args):
        body = bytes([op]) + encode(REQUEST[op], args)
        if len(body) > MAX_MESSAGE:     # refused here, not by the server closing the connection
            raise ValueError(f"a store request of {len(body)} bytes (at most {MAX_MESSAGE})")
        if op in (GET, WAIT, MULTI_GET):    # the server answers by the wait's end
            limit = None if args[0] is None else args[0] + ANSWER_S
        else:
            limit = _seconds(self.timeout)
        if not self._lock.acquire(timeout=-1 if limit is None else limit):
            raise dist.DistStoreError(f"the store at {self._where()} is busy with another call "
                                      f"of this process that did not end within {limit:.0f} s")
        try:
            return self._result(op, self._exchange(body, limit))
        finally:
            self._lock.release()

    def _where(self):
        return "%s:%d" % self.address

    def _exchange(self, body, limit):
        """Send one request and receive its response, within ``limit`` seconds
        per socket operation (SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket:
        channel.receive_frame's MSG_WAITALL needs one). Any failure ends the connection:
        a late answer would be read as the next request's."""
        if self._lost is not None:
            raise dist.DistNetworkError(f"lost the connection to the store at {self._where()}: "
                                        f"{self._lost}")
        try:
            _limit_socket(self._sock, limit)
            self._send_seq = send_message(self._sock, self._send_key, self._send_seq, body)
            response, self._receive_seq = receive_message(self._sock, self._receive_key,
                                                           self._receive_seq)
            if response is None:
                raise ConnectionError("the server closed the connection")
            return response
        except BlockingIOError:
            self._lose("no answer in time")
            raise dist.DistStoreError(f"the store at {self._where()} did not answer within "
                                      f"{limit:.0f} s") from None
        except (OSError, channel.Refused, Malformed) as err:
            self._lose(str(err) or type(err).__name__)
            raise dist.DistNetworkError(f"lost the connection to the store at {self._where()}: "
                                        f"{self._lost}") from None

    def _lose(self, reason):
        self._lost = reason
        _close(self._sock)

    def _result(self, op, response):
        try:
            reader = Reader(response)
            status = reader.take(1)[0]
            if status == TIMEOUT:
                reader.fields("")
                raise WaitTimeout()
            if status == INVALID:
                raise ValueError(reader.fields("v")[0].decode(errors="replace"))
            if status != OK:
                raise Malformed(f"unknown status {status}")
            return reader.fields(RESPONSE[op])[0] if RESPONSE[op] else None
        except Malformed as err:
            self._lose(f"a malformed answer: {err}")
            raise dist.DistNetworkError(f"lost the connection to the store at {self._where()}: "
                                        f"{self._lost}") from None

    def close(self):
        """End the connection (and its clones'); later calls raise
        DistNetworkError, and a call blocked in another thread ends now (no
        lock taken here: that call holds it)."""
        if self._lost is None:
            self._lost = "closed by this process"
        _close(self._sock)
        for twin in self._clones:
            twin.close()


def _limit_socket(sock, seconds):
    """Bound each blocking send and receive on ``sock`` (0: none)."""
    seconds = 0 if seconds is None else max(seconds, 0.001)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# --- serving and connecting ----------------------------------------------------

def serve(listener, secret, timeout=DEFAULT_TIMEOUT):
    """The store of a job with a secret, served on ``listener`` (a listening
    socket on the job's address) behind the gate; the returned
    LocalStore is this process's own view. Keep it referenced for the job."""
    store = LocalStore(Table(), timeout)
    store.gate = gate.Gate(listener, secret, serve_connection(store.table))
    return store


def connect(address, secret, timeout=DEFAULT_TIMEOUT):
    """A client of the store served at ``address`` = (host, port)."""
    return RemoteStore(address, secret, timeout)


# --- the table: the store's data in the serving process, with
# c10d's semantics (HashStore's and TCPStore's: counters in ASCII decimal that
# wrap in int64, compare-and-set, waits with timeouts).
POLL_S = 1.0            # how often a waiting server thread looks for its client's departure
# What the whole table may hold: a fixed job keeps a few hundred small keys
# (rank claims, addresses, the status); an elastic leader adds about two a
# member for each generation (gloo's groups, e/<g>/...), none deleted, so
# 64 members meet 8,000 times before the bound. A member writing without
# end is refused with ValueError, which its call raises, rather than
# filling the serving process's memory.
MAX_TABLE_KEYS = 1 << 20
MAX_TABLE_BYTES = 1 << 30


class WaitTimeout(TimeoutError):
    """Keys a caller waited for were not all set within its timeout."""


class Gone(Exception):
    """The client of a waiting request went away."""


_STOLL = re.compile(rb"\s*([+-]?[0-9]+)")


def _counter(value):
    """A counter's value as c10d reads it (std::stoll: leading blanks, a sign,
    digits, anything after ignored); ValueError like HashStore otherwise."""
    match = _STOLL.match(value)
    if match is None or not -2**63 <= int(match.group(1)) < 2**63:
        raise ValueError("stoll")
    return int(match.group(1))


def _wrap64(number):
    """c10d adds in int64_t, which wraps around."""
    return (number + 2**63) % 2**64 - 2**63


class Table:
    """The store's data in the serving process: bytes -> bytes, and a condition
    that wakes waiters whenever a key changes. Waits take seconds (None: no
    limit) and an optional ``gone()`` that ends a wait whose client left."""

    def __init__(self, max_keys=None, max_bytes=None):
        self._data, self._bytes = {}, 0
        self._changed = threading.Condition()
        self.max_keys = MAX_TABLE_KEYS if max_keys is None else max_keys
        self.max_bytes = MAX_TABLE_BYTES if max_bytes is None else max_bytes

    def _put(self, items):
        """Store ``items`` (key, value) if the table stays within its bounds
        (called holding the condition); else ValueError naming the bound."""
        changes = dict(items)
        new = [k for k in changes if k not in self._data]
        grown = sum(len(v) - len(self._data.get(k, b"")) + (len(k) if k in new else 0)
                    for k, v in changes.items())
        if len(self._data) + len(new) > self.max_keys:
            raise ValueError(f"the job's store holds {len(self._data)} keys, its most is "
                             f"{self.max_keys} (a member that writes keys without end?)")
        if self._bytes + grown > self.max_bytes:
            raise ValueError(f"the job's store holds {self._bytes} bytes, its most is "
                             f"{self.max_bytes} (a member that writes without end?)")
        self._data.update(changes)
        self._bytes += grown
        self._changed.notify_all()

    def _wait_for(self, ready, timeout, gone):
        """Wait (holding the condition) until ``ready()``; WaitTimeout after
        ``timeout`` seconds, Gone as soon as ``gone()`` says so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"wait timeout after {timeout * 1000:.0f}ms")
            if gone is not None:
                if gone():
                    raise Gone()
                left = POLL_S if left is None else min(left, POLL_S)
            self._changed.wait(left)

    def set(self, key, value):
        with self._changed:
            self._put([(key, value)])

    def get(self, key, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: key in self._data, timeout, gone)
            return self._data[key]

    def add(self, key, amount):
        """The counter at ``key`` plus ``amount`` (a missing key counts 0),
        stored as ASCII decimal as TCPStore does."""
        with self._changed:
            value = _wrap64(_counter(self._data.get(key, b"0")) + amount)
            self._put([(key, str(value).encode())])
            return value

    def check(self, keys):
        with self._changed:
            return all(key in self._data for key in keys)

    def wait(self, keys, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: all(key in self._data for key in keys), timeout, gone)

    def compare_set(self, key, expected, desired):
        """c10d's compare-and-set: a missing key is created only when
        ``expected`` is empty; returns the value after the operation (for a
        missing key left alone: ``expected``, as HashStore and TCPStore do)."""
        with self._changed:
            current = self._data.get(key)
            if current is None and expected != b"":
                return expected
            if current is None or current == expected:
                self._put([(key, desired)])
                return desired
            return current

    def delete_key(self, key):
        with self._changed:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._bytes -= len(key) + len(value)
            return True

    def num_keys(self):
        with self._changed:
            return len(self._data)

    def append(self, key, value):
        with self._changed:
            joined = self._data.get(key, b"") + value
            if len(joined) > MAX_VALUE:
                raise ValueError(f"appending would make a value of {len(joined)} bytes "
                                 f"(at most {MAX_VALUE})")
            self._put([(key, joined)])

    def multi_get(self, keys, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: all(key in self._data for key in keys), timeout, gone)
            return [self._data[key] for key in keys]

    def multi_set(self, keys, values):
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        with self._changed:
            self._put(zip(keys, values))


def execute(table, op, args, gone=None):
    """One request's result against ``table``; WaitTimeout, ValueError."""
    if op in (GET, WAIT, MULTI_GET):
        timeout, keys = args
        return getattr(table, {GET: "get", WAIT: "wait", MULTI_GET: "multi_get"}[op])(
            keys, timeout, gone)
    method = {SET: table.set, ADD: table.add, CHECK: table.check, COMPARE_SET: table.compare_set,
              DELETE_KEY: table.delete_key, NUM_KEYS: table.num_keys, APPEND: table.append,
              MULTI_SET: table.multi_set}[op]
    return method(*args)
