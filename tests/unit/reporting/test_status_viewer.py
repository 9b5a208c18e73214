"""hetseq-status is bounded (issue 48, item 2): a silent service at the URL
costs --timeout, Ctrl-C ends it at any moment, and whatever value the store
holds (anyone may write it in a job without a secret) gives a status or one
line, never a traceback."""

import json
import math
import random
import re
import socket
import threading

import pytest
import torch.distributed as dist

from hetseq.base.errors import UserError
from hetseq.reporting import status
from hetseq.store import job_secret, server as job_store


def test_a_peer_that_keeps_going_silent_ends_the_watch():
    """--watch looks again after a silent read, but the threads left waiting
    are bounded: the MAX_STUCK-th still waiting ends it."""
    never = threading.Event()
    try:
        for _ in range(status.MAX_STUCK):
            with pytest.raises(UserError, match="did not answer within 0.1 s"):
                status.bounded(never.wait, "tcp://h:1", 0.1)
        with pytest.raises(UserError, match=f"went silent {status.MAX_STUCK} times"):
            status.bounded(lambda: "answer", "tcp://h:1", 0.1)
    finally:
        never.set()
    for worker in status._workers:
        worker.join(10)
    assert status.bounded(lambda: "answer", "tcp://h:1", 5) == "answer"


class Member(job_store.LocalStore):
    """A member's store as the viewer holds it: closed once it moved on."""
    closed = False

    def close(self):
        self.closed = True


def test_the_viewer_follows_the_leader_with_the_job_id_it_was_given():
    """Under --elastic any member's address shows the job: the viewer
    follows e/leader, an address only, and passes the leader's gate with the
    key of the job id in the URL it was given; a leader at that same
    address is the store it holds already."""
    secret = job_secret.read_secret(None, {job_secret.SECRET_VARIABLE:
                                           "c41e9a07d3b25f68e1a4c7093bd2f5e6"},
                                    "tcp://127.0.0.1:9/7a0f3e")
    listener = socket.create_server(("127.0.0.1", 0))
    leader_port = listener.getsockname()[1]
    leader = job_store.serve(listener, secret)
    leader.set(status.KEY, "the leader's")
    member = Member()
    member.set("e/leader", json.dumps({"addr": "127.0.0.1", "port": leader_port}))
    try:
        there, url = status.leader_store(member, "tcp://127.0.0.1:9/7a0f3e", secret)
        assert url == f"tcp://127.0.0.1:{leader_port}" and there.get(status.KEY) == \
            b"the leader's"
        there.close()
        assert member.closed
        here = f"tcp://127.0.0.1:{leader_port}/7a0f3e"
        member.closed = False
        assert status.leader_store(member, here, secret) == (member, here) and not member.closed
    finally:
        listener.close()


NASTY = [0, -1, 1, 2.5, 1e308, -1e308, 10**400, -10**400, 10**15, 1e15 + 1, math.nan,
         math.inf, -math.inf, True, False, None, "", "8", "\x1b[2J", "\ud800", "\u202e",
         "a\x07b" * 3000, "\n\t\r", [], {}]


FIELDS = ["state", "generation", "update", "planned", "left_s", "left", "loss", "samples_per_s",
          "time", "ranks", "checkpoint", "rank", "host", "batch", "wait_s", "path"]


def fuzzed(rng, depth=0):
    """A JSON-ish value: mostly dicts with the viewer's own keys, nested."""
    pick = rng.random()
    if depth < 4 and pick < 0.45:
        return {rng.choice(FIELDS): fuzzed(rng, depth + 1) for _ in range(rng.randrange(8))}
    if depth < 4 and pick < 0.6:
        return [fuzzed(rng, depth + 1) for _ in range(rng.randrange(6))]
    if pick < 0.75:
        return rng.choice([rng.uniform(-1e18, 1e18), rng.randrange(-10**20, 10**20),
                           rng.random(), -rng.randrange(100), rng.randrange(100)])
    return rng.choice(NASTY)


def fuzzed_status(rng):
    """A status's shape (rows of ranks), each field fuzzed."""
    rows = [{f: fuzzed(rng, 3) for f in ("rank", "host", "batch", "wait_s", "samples_per_s")
             if rng.random() < 0.8} for _ in range(rng.randrange(6))]
    return {**{f: fuzzed(rng, 3) for f in FIELDS if rng.random() < 0.5}, "ranks": rows}


def test_clean_and_render_take_any_value():
    """3000 values: each draws, with no escape and every share within 0-100%."""
    rng = random.Random(48)
    shares = 0
    for i in range(3000):
        value = fuzzed(rng) if i % 2 else fuzzed_status(rng)
        view = value if isinstance(value, dict) else {"ranks": [value], "checkpoint": value}
        try:
            text = "\n".join(status.render(status.clean(view), "tcp://h:1", now=1e9))
        except Exception as err:          # the promise: never a traceback
            pytest.fail(f"value {i} ({value!r:.200}) raised {err!r}")
        assert "\x1b" not in text and "\x07" not in text and "\ud800" not in text, i
        for share in re.findall(r"(-?\d+)% ", text):
            assert 0 <= int(share) <= 100, (i, value)
            shares += int(share) > 0
    assert shares > 100        # the fuzz does reach the rank rows


@pytest.mark.parametrize("leader", [
    b'{"addr": "10.0.0.1", "port": 1e999}', b'{"addr": "10.0.0.1", "port": 70000}',
    b'{"addr": ' + b"[" * 100000 + b"}", b'{"addr": "\\u001b]0;PWNED\\u0007", "port": 29500}',
    b'{"addr": "a b", "port": 29500}', b'{"addr": 5, "port": 29500}', b'["10.0.0.1", 1]',
    b'{"addr": "' + b"a" * (2 << 20) + b'", "port": 1}'])
def test_a_crafted_leader_address_gives_one_line(leader):
    """e/leader, which --elastic members write and the viewer follows, is
    read with the status's own bounds: one line, no escape, no traceback."""
    store = job_store.LocalStore()
    store.set("e/leader", leader)
    secret = job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: "c41e9a07d3b25f68e1a4c7093bd2f5e6"})
    try:
        status.leader_store(store, "tcp://10.0.0.2:29500", secret)
    except UserError as err:
        message = str(err)
    except Exception as err:       # the promise: never a traceback
        pytest.fail(f"{leader[:60]!r} raised {err!r}")
    else:
        pytest.fail(f"{leader[:60]!r} was followed")
    assert "\n" not in message and "\x1b" not in message and "PWNED" not in message, message


class MadeUp:
    """A store client whose answers a hostile service made up: c10d's client
    fails in C++ on them (a length no store sends)."""

    def __init__(self, error):
        self.error = error

    def check(self, keys):
        return True

    def get(self, key):
        raise self.error


@pytest.mark.parametrize("error", [
    MemoryError("std::bad_alloc"), ValueError("cannot create std::vector larger than "
                                              "max_size()"), RuntimeError("unexpected reply")])
def test_store_answers_no_store_sends_give_one_line(error):
    try:
        status.read(MadeUp(error))
    except status.BadValue as err:
        assert f"no HetSeq store sends ({type(error).__name__}" in str(err), err
    except Exception as err:             # the traceback a user would have seen
        pytest.fail(f"a made-up answer raised {err!r}, not one line")
    else:
        pytest.fail("a made-up answer read as a status")
    with pytest.raises(dist.DistError):                # a lost connection stays one
        status.read(MadeUp(dist.DistError("connection closed")))
