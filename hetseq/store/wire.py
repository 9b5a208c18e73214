"""The wire protocol of the job's store (server.py), inside channel.py's sealed
frames: length-prefixed messages of fixed fields, every length bounded
(MAX_KEY, MAX_VALUE, MAX_KEYS, MAX_MESSAGE) before anything is gathered or
sliced, nothing unpickled or evaluated. docs/security.md, "The handshake and
the store's protocol", gives the layout.
"""

import struct

from hetseq.store import channel

MAX_KEY = 4 << 10
MAX_VALUE = 64 << 20
MAX_KEYS = 1 << 12
MAX_MESSAGE = MAX_VALUE + (1 << 20)    # one value at its largest, plus keys and headers

SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE_KEY, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = \
    range(1, 12)
OK, TIMEOUT, INVALID = range(3)

# The fields of each op's request and of its OK response: k key, v value,
# i signed 64-bit integer, t timeout, b boolean, K list of keys, V list of values.
REQUEST = {SET: "kv", GET: "tk", ADD: "ki", CHECK: "K", WAIT: "tK", COMPARE_SET: "kvv",
           DELETE_KEY: "k", NUM_KEYS: "", APPEND: "kv", MULTI_GET: "tK", MULTI_SET: "KV"}
RESPONSE = {SET: "", GET: "v", ADD: "i", CHECK: "b", WAIT: "", COMPARE_SET: "v",
            DELETE_KEY: "b", NUM_KEYS: "i", APPEND: "", MULTI_GET: "V", MULTI_SET: ""}


class Malformed(Exception):
    """A message that breaks the protocol or its bounds."""


def blob(data):
    return struct.pack(">I", len(data)) + data


def encode(kinds, values):
    """Fields ``values`` laid out as ``kinds`` says (see REQUEST)."""
    out = []
    for kind, value in zip(kinds, values):
        if kind in "kv":
            out.append(blob(value))
        elif kind in "KV":
            out.append(struct.pack(">I", len(value)) + b"".join(map(blob, value)))
        elif kind == "i":
            out.append(struct.pack(">q", value))
        elif kind == "b":
            out.append(b"\1" if value else b"\0")
        else:   # t: seconds or None -> milliseconds, 0 for none
            out.append(struct.pack(">Q", 0 if value is None else max(1, round(value * 1000))))
    return b"".join(out)


class Reader:
    """Fields of a received body; every length is checked against its bound
    and against what is left before anything is sliced."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, n):
        if n > len(self.data) - self.at:
            raise Malformed(f"a field of {n} bytes runs past the message's end")
        self.at += n
        return self.data[self.at - n:self.at]

    def blob(self, limit, what):
        (n,) = struct.unpack(">I", self.take(4))
        if n > limit:
            raise Malformed(f"a {what} of {n} bytes (at most {limit})")
        return self.take(n)

    def field(self, kind):
        if kind == "k":
            return self.blob(MAX_KEY, "key")
        if kind == "v":
            return self.blob(MAX_VALUE, "value")
        if kind in "KV":
            (n,) = struct.unpack(">I", self.take(4))
            if n > MAX_KEYS:
                raise Malformed(f"a list of {n} items (at most {MAX_KEYS})")
            return [self.field(kind.lower()) for _ in range(n)]
        if kind == "i":
            return struct.unpack(">q", self.take(8))[0]
        if kind == "b":
            flag = self.take(1)
            if flag not in (b"\0", b"\1"):
                raise Malformed("a boolean that is neither 0 nor 1")
            return flag == b"\1"
        (ms,) = struct.unpack(">Q", self.take(8))
        return ms / 1000 if ms else None

    def fields(self, kinds):
        values = [self.field(kind) for kind in kinds]
        if self.at != len(self.data):
            raise Malformed(f"{len(self.data) - self.at} bytes after the last field")
        return values


def send_message(sock, key, seq, body):
    """Send ``body`` as one message over sealed frames; returns the next seq."""
    data = struct.pack(">I", len(body)) + body
    for start in range(0, len(data), channel.CHUNK):
        channel.send_frame(sock, key, seq, data[start:start + channel.CHUNK])
        seq += 1
    return seq


def receive_message(sock, key, seq):
    """(body, next seq) of the next message; body None at a clean end.
    Raises Malformed for a message over MAX_MESSAGE (read from its header,
    before gathering it), channel.Refused for a forged frame, OSError."""
    first = channel.receive_frame(sock, key, seq)
    if not first:
        return None, seq
    seq += 1
    if len(first) < 4:
        raise Malformed("a message without its length")
    (total,) = struct.unpack(">I", first[:4])
    if total > MAX_MESSAGE:
        raise Malformed(f"a message of {total} bytes (at most {MAX_MESSAGE})")
    body = bytearray(first[4:])
    while len(body) < total:
        more = channel.receive_frame(sock, key, seq)
        if not more:
            raise ConnectionError("connection closed mid-message")
        seq += 1
        body += more
    if len(body) != total:
        raise Malformed(f"a message of {len(body)} bytes announced as {total}")
    return bytes(body), seq
