#!/usr/bin/env python
"""What the memory-hard key (hetseq/store/job_secret.py) costs a job
and an attacker, on this machine.

- An offline guess against a recorded handshake: before, one SHA-256 of the
  guess and one HMAC; now the same plus scrypt (N=2^15, r=8, 32 MiB). The
  ratio is what the key stretching multiplies a guesser's work by.
- A join: a client's first connection to a gate (it derives the key for the
  gate's salt) against a later one (the key kept), on 127.0.0.1; the gate
  derives its own key once when it opens. A node makes a first connection
  once per process.

    python bench/secret_cost.py [--repeats N] [--out FILE]
"""

import argparse
import hashlib
import hmac
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drift import timed  # noqa: E402  (median seconds of repeated calls)
from output import emit  # noqa: E402

from hetseq.store import channel, gate, job_secret, secret  # noqa: E402


def guess_before(guess, ns, nc):
    """What checking one guess cost before: the key was a hash of the secret."""
    key = hashlib.sha256(b"hetseq job secret\0" + guess).digest()
    return hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()


def guess_now(guess, salt, ns, nc):
    digest = hashlib.sha256(b"hetseq job secret\0" + guess).digest()
    key = hashlib.scrypt(digest, salt=b"hetseq job key\0" + salt, **job_secret.SCRYPT)
    return hmac.new(key, b"client" + ns + nc, hashlib.sha256).digest()


def fresh_secret(text, identity):
    """A JobSecret as a new process reads it: no key derived yet."""
    job_secret.stretch.cache_clear()
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text}, identity)


def join_costs(repeats):
    text = secret.make()
    identity = {"bench": "secret_cost"}
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    opened = time.perf_counter()
    gate.Gate(listener, fresh_secret(text, identity), lambda sock, *_: sock.close())
    gate_s = time.perf_counter() - opened

    def first():
        channel.connect_as_client(address, fresh_secret(text, None))[0].close()
    kept = fresh_secret(text, None)

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
        "what": "the job secret's key: an offline guess and a join (127.0.0.1)",
        "scrypt": {k: v for k, v in job_secret.SCRYPT.items() if k != "maxmem"},
        "guess_before_s": before, "guess_now_s": now,
        "guess_cost_ratio": now / before,
        **joins,
        "first_over_later_connection": joins["first_connection_s"] /
        joins["later_connection_s"],
    }, args.out)


if __name__ == "__main__":
    main()
