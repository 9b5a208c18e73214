#!/usr/bin/env python
"""What the memory-hard key (hetseq/store/job_secret.py) costs a job
and an attacker, on this machine.

- An offline guess against a recorded handshake: before, one SHA-256 of the
  guess and one HMAC; now the same plus scrypt (N=2^15, r=8, 32 MiB). The
  ratio is what the key stretching multiplies a guesser's work by.
- A join: a client's first connection to a gate (it derives the key for
  its job id's salt) against a later one (the key kept), on 127.0.0.1; the
  gate derives its own key once when it opens. A node makes a first
  connection once per process.
- A frame: sealing and opening one frame with ChaCha20-Poly1305 (every
  frame since issue 58: encrypted and authenticated) against the HMAC-SHA256
  frames before it (authenticated only), at 64 B, 4 KiB and 64 KiB.
- hetseq-status's look: a connection (key kept) and one get of a 4 KiB
  status value through the gate, sealed frames both ways.

    python bench/secret_cost.py [--repeats N] [--out FILE]
"""

import argparse
import hashlib
import hmac
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drift import timed  # noqa: E402  (median seconds of repeated calls)
from output import emit  # noqa: E402

from hetseq.store import channel, cipher, gate, job_secret, secret  # noqa: E402
from hetseq.store import server as job_store  # noqa: E402

URL = "tcp://127.0.0.1:29500/bench-secret-cost"      # its job id: the salt
FRAMES = {"64B": 64, "4KiB": 4 << 10, "64KiB": channel.CHUNK}


def guess_before(guess, ns, nc):
    """What checking one guess cost before: the key was a hash of the secret."""
    key = hashlib.sha256(b"hetseq job secret\0" + guess).digest()
    return hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()


def guess_now(guess, salt, ns, nc):
    digest = hashlib.sha256(b"hetseq job secret\0" + guess).digest()
    key = hashlib.scrypt(digest, salt=b"hetseq job key\0" + salt, **job_secret.SCRYPT)
    return hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()


def fresh_secret(text):
    """A JobSecret as a new process reads it: no key derived yet."""
    job_secret.stretch.cache_clear()
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text}, URL)


def hmac_frame(key, seq, data):
    """A frame as it was before issue 58: length, HMAC-SHA256, data in clear."""
    return struct.pack(">I", len(data)) + hmac.new(key, struct.pack(">Q", seq) + data,
                                                    hashlib.sha256).digest() + data


def hmac_open(key, seq, frame):
    tag, data = frame[4:4 + 32], frame[4 + 32:]
    if not hmac.compare_digest(tag, hmac.new(key, struct.pack(">Q", seq) + data,
                                             hashlib.sha256).digest()):
        raise ValueError("forged")
    return data


def sealed_frame(seal, seq, data):
    head = struct.pack(">I", len(data))
    return head + seal.seal(seq, head, data)


def sealed_open(seal, seq, frame):
    data = seal.open(seq, frame[:4], frame[4:])
    if data is None:
        raise ValueError("forged")
    return data


def frame_costs(repeats):
    """Microseconds to make and check one frame (both ends' work), and MB/s."""
    key, seal = os.urandom(32), cipher.Seal(os.urandom(32))
    out = {}
    for name, size in FRAMES.items():
        data, calls = os.urandom(size), max(20, (4 << 20) // size)

        def old():
            for seq in range(calls):
                hmac_open(key, seq, hmac_frame(key, seq, data))

        def new():
            for seq in range(calls):
                sealed_open(seal, seq, sealed_frame(seal, seq, data))
        hmac_s, sealed_s = timed(old, repeats) / calls, timed(new, repeats) / calls
        out[name] = {"hmac_frame_us": round(hmac_s * 1e6, 2),
                     "sealed_frame_us": round(sealed_s * 1e6, 2),
                     "sealed_over_hmac": round(sealed_s / hmac_s, 2),
                     "sealed_mb_per_s": round(size / sealed_s / 1e6, 1)}
    return out


def status_look_s(repeats):
    """hetseq-status's look, key kept: connect, pass the gate, get 4 KiB."""
    text = secret.make()
    listener = socket.create_server(("127.0.0.1", 0))
    served = job_store.serve(listener, fresh_secret(text))
    served.set("hetseq/status", b"x" * (4 << 10))
    kept = fresh_secret(text)
    address = listener.getsockname()[:2]

    def look():
        viewer = job_store.connect(address, kept)
        viewer.get("hetseq/status")
        viewer.close()
    look()
    return timed(look, repeats)


def join_costs(repeats):
    text = secret.make()
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    opened = time.perf_counter()
    gate.Gate(listener, fresh_secret(text), lambda sock, *_: sock.close())
    gate_s = time.perf_counter() - opened

    def first():
        channel.connect_as_client(address, fresh_secret(text))[0].close()
    kept = fresh_secret(text)

    def later():
        channel.connect_as_client(address, kept)[0].close()
    later()
    return {"gate_opens_s": gate_s, "first_connection_s": timed(first, repeats),
            "later_connection_s": timed(later, repeats)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    guess, salt, ns, nc = b"a guess", os.urandom(16), os.urandom(32), os.urandom(32)
    before = timed(lambda: [guess_before(guess, ns, nc) for _ in range(1000)], args.repeats) / 1000
    now = timed(lambda: guess_now(guess, salt, ns, nc), args.repeats)
    joins = join_costs(args.repeats)
    emit({
        "what": "the job secret's key: an offline guess and a join; its sealed frames "
                "against the HMAC frames before them; hetseq-status's look (127.0.0.1)",
        "scrypt": {k: v for k, v in job_secret.SCRYPT.items() if k != "maxmem"},
        "guess_before_s": before, "guess_now_s": now,
        "guess_cost_ratio": now / before,
        **joins,
        "first_over_later_connection": joins["first_connection_s"] /
        joins["later_connection_s"],
        "frame": frame_costs(args.repeats),
        "status_look_s": status_look_s(max(args.repeats, 21)),
    }, args.out)


if __name__ == "__main__":
    main()
