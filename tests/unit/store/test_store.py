"""The store of jobs with a secret (hetseq/store/server.py): served only
through the channel's handshake, never on an unauthenticated listener."""

import datetime
import gc
import logging
import secrets
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from hetseq.store import channel, cipher, gate, job_secret
from hetseq.store import server as store
from hetseq.store import server as store_table
from hetseq.store.secret import make as make_secret


SECRET = make_secret()


OTHER = make_secret()


def key(text):
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text})


KEY = key(SECRET)


class Served:
    """A store served on 127.0.0.1 behind gate.Gate, with each connection's
    socket and thread recorded (to see one end)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.table = store.Table()
        self.local = store.LocalStore(self.table, 10)
        self.sockets, self.threads, self.clients = [], [], []
        handle = store.serve_connection(self.table)

        def tracked(sock, send_key, receive_key, where):
            self.sockets.append(sock)
            self.threads.append(threading.current_thread())
            handle(sock, send_key, receive_key, where)
        self.gate = gate.Gate(self.listener, KEY, tracked)

    def client(self, timeout=10, secret_key=KEY):
        remote = store.connect(self.address, secret_key, timeout)
        self.clients.append(remote)
        return remote

    def go_away(self):
        """The serving side ends: no listener, every connection shut."""
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def served():
    server = Served()
    try:
        yield server
    finally:
        for remote in server.clients:
            remote.close()
        server.go_away()


def logged(caplog, text, within=3.0):
    """Whether ``text`` is logged within ``within`` s (servers log from their threads)."""
    deadline = time.monotonic() + within
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    return text in caplog.text


def outcome(call):
    try:
        return repr(call())
    except Exception as err:
        return type(err).__name__


def script(s):
    """What a sequence of calls returns (or raises) on store ``s``."""
    s.set_timeout(datetime.timedelta(seconds=0.1))
    calls = [
        lambda: s.num_keys(),
        lambda: s.get("missing"),
        lambda: s.wait(["missing"], datetime.timedelta(seconds=0.05)),
        lambda: s.set("a", "text"), lambda: s.get("a"),
        lambda: s.set("b", b"\x00\xff"), lambda: s.get("b"),
        lambda: s.set("e", b""), lambda: s.get("e"),
        lambda: s.add("c", 5), lambda: s.add("c", -7), lambda: s.get("c"),
        lambda: s.add("a", 1),                        # not a number
        lambda: s.set("n", " 7x"), lambda: s.add("n", 1),
        lambda: s.add("big", 2**62), lambda: s.add("big", 2**62),   # int64 wraps
        lambda: s.check(["a", "c"]), lambda: s.check(["a", "zz"]), lambda: s.check([]),
        lambda: s.wait(["a", "c"]),
        lambda: s.compare_set("k", "", "v1"), lambda: s.get("k"),
        lambda: s.compare_set("k2", "x", "v2"), lambda: s.check(["k2"]),
        lambda: s.compare_set("k", "wrong", "v3"), lambda: s.compare_set("k", "v1", "v3"),
        lambda: s.compare_set("k", "", "v4"), lambda: s.compare_set("e", "", "q"),
        lambda: s.num_keys(),
        lambda: s.delete_key("a"), lambda: s.delete_key("a"), lambda: s.check(["a"]),
        lambda: s.num_keys(),
        lambda: s.append("ap", b"12"), lambda: s.append("ap", "34"), lambda: s.get("ap"),
        lambda: s.multi_set(["m1", "m2"], [b"1", "2"]), lambda: s.multi_get(["m1", "m2"]),
        lambda: s.multi_get(["m1", "zz"]),
        lambda: s.set("", b"empty key"), lambda: s.get(""),
        lambda: s.num_keys(),
    ]
    return [outcome(call) for call in calls]


@pytest.mark.parametrize("kind", ["local", "remote", "local-prefix", "remote-prefix"])
def test_semantics_match_hashstore(served, kind):
    reference = dist.HashStore()
    mine = served.local if kind.startswith("local") else served.client()
    if kind.endswith("prefix"):
        reference, mine = dist.PrefixStore("pg", reference), dist.PrefixStore("pg", mine)
    expected = script(reference)
    assert "'DistStoreError'" not in expected and "DistStoreError" in expected
    assert script(mine) == expected


def test_large_values_span_frames_and_bounds_hold(served):
    remote = served.client()
    value = secrets.token_bytes(3 * channel.CHUNK + 7)
    remote.set("big", value)
    assert remote.get("big") == value and served.local.get("big") == value
    with pytest.raises(ValueError):
        remote.set("x" * (store.MAX_KEY + 1), b"v")        # refused before sending
    with pytest.raises(ValueError):
        remote.set("huge", bytes(store.MAX_VALUE + 1))
    assert remote.get("big") == value                      # the connection lives on


def test_wrong_secret_gets_nothing_and_others_are_served(served, caplog):
    served.local.set("hetseq/claim/0", b"mine")
    with caplog.at_level(logging.WARNING, logger="hetseq.store.channel"):
        with pytest.raises(channel.Refused):
            store.connect(served.address, key(OTHER), 5)
        assert logged(caplog, "wrong secret")
    assert served.client().get("hetseq/claim/0") == b"mine"


def bounded(call, within=5.0):
    """(what ``call()`` raised, seconds it took); fails if it takes over
    ``within`` s (so that a call that would hang ends the test instead)."""
    box = {}

    def run():
        start = time.monotonic()
        try:
            call()
        except Exception as err:
            box["error"] = err
        box["took"] = time.monotonic() - start
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"still blocked after {within} s"
    return box.get("error"), box["took"]


def elapsed(call):
    error, took = bounded(call)
    assert isinstance(error, dist.DistStoreError), repr(error)
    return took


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_get_and_wait_time_out_with_dist_store_error(served, kind):
    s = served.local if kind == "local" else served.client()
    s.set_timeout(datetime.timedelta(seconds=0.3))
    assert 0.25 < elapsed(lambda: s.get("never")) < 3
    assert 0.15 < elapsed(lambda: s.wait(["never"], datetime.timedelta(seconds=0.2))) < 3
    assert 0.25 < elapsed(lambda: s.multi_get(["never"])) < 3
    prefixed = dist.PrefixStore("pg", s)            # through c10d's C++ side
    prefixed.set_timeout(datetime.timedelta(seconds=0.2))
    assert 0.15 < elapsed(lambda: prefixed.get("never")) < 3
    s.set("late", b"1")
    assert s.get("late") == b"1"                    # the connection outlives a timeout


def test_a_server_that_goes_away_ends_a_blocked_call(served):
    remote = served.client(timeout=30)
    threading.Timer(0.3, served.go_away).start()
    error, took = bounded(lambda: remote.get("never"))
    assert isinstance(error, dist.DistNetworkError) and took < 3, repr(error)
    error, _ = bounded(lambda: remote.set("k", b"v"))
    assert isinstance(error, dist.DistNetworkError), repr(error)


def test_a_frozen_server_does_not_hang_a_call():
    """A server that takes requests but never answers (a frozen rank 0, a cut
    link): a call ends after the store's timeout."""
    listener = socket.create_server(("127.0.0.1", 0))

    def frozen(sock, send_key, receive_key, where):
        while sock.recv(1 << 16):
            pass
    gate.Gate(listener, KEY, frozen)
    remote = store.connect(listener.getsockname()[:2], KEY, 0.3)
    try:
        error, took = bounded(lambda: remote.set("k", b"v"))
        assert isinstance(error, dist.DistStoreError) and 0.25 < took < 3, repr(error)
        error, _ = bounded(lambda: remote.add("k", 1))
        assert isinstance(error, dist.DistNetworkError), repr(error)    # that connection is done
    finally:
        remote.close()
        listener.close()


def test_a_waiting_server_thread_ends_when_its_client_leaves(served):
    remote = served.client(timeout=60)
    errors = []

    def blocked():
        try:
            remote.get("never")
        except dist.DistError as err:
            errors.append(err)
    waiter = threading.Thread(target=blocked)
    waiter.start()
    time.sleep(0.3)
    remote._sock.shutdown(socket.SHUT_RDWR)        # the client process goes away
    waiter.join(5)
    assert not waiter.is_alive() and isinstance(errors[0], dist.DistNetworkError)
    served.threads[0].join(store_table.POLL_S + 2)
    assert not served.threads[0].is_alive()


def test_a_blocked_get_does_not_block_other_connections(served):
    waiting, setter = served.client(), served.client()
    got = []
    reader = threading.Thread(target=lambda: got.append(waiting.get("late")))
    reader.start()
    time.sleep(0.2)
    assert setter.add("counter", 2) == 2
    setter.set("late", b"here")
    reader.join(5)
    assert got == [b"here"]


def test_clones_have_their_own_connection_and_outlive_python_references(served):
    remote = served.client()
    clone = dist.PrefixStore("x", remote).clone()   # c10d's C++ side calls RemoteStore.clone
    gc.collect()
    clone.set("a", b"1")
    assert remote.get("x/a") == b"1"
    assert type(clone.underlying_store) is store.RemoteStore
    assert clone.underlying_store is not remote and len(served.sockets) == 2


def message(body, total=None):
    """A message's first frame: its length (``total`` to lie about it), then ``body``."""
    return struct.pack(">I", len(body) if total is None else total) + body


def blob(data):
    return struct.pack(">I", len(data)) + data


MALFORMED = {
    "unknown op": message(b"\xee"),
    "empty request": message(b""),
    "oversized message": message(b"\x01", total=store.MAX_MESSAGE + 1),
    "oversized key": message(bytes([store.SET]) + blob(b"k" * (store.MAX_KEY + 1)) + blob(b"")),
    "too many keys": message(bytes([store.CHECK]) + struct.pack(">I", store.MAX_KEYS + 1)
                             + blob(b"") * (store.MAX_KEYS + 1)),
    "field past the end": message(bytes([store.DELETE_KEY]) + struct.pack(">I", 100) + b"abcd"),
    "trailing bytes": message(bytes([store.DELETE_KEY]) + blob(b"a") + b"!"),
    "longer than announced": message(bytes([store.NUM_KEYS]) + b"\0\0\0\0", total=1),
    "a counter of 9 bytes": message(bytes([store.ADD]) + blob(b"n") + b"\0" * 9),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_close_only_their_connection(served, case, caplog):
    """A malformed request (see MALFORMED; a message over MAX_MESSAGE is
    refused from its header) closes its connection at once, unanswered, with
    one warning; other connections and the store go on."""
    other = served.client()
    other.set("kept", b"yes")
    sock, send_key, receive_key, _ = channel.connect_as_client(served.address, KEY)
    try:
        with caplog.at_level(logging.WARNING, logger="hetseq.store.server"):
            channel.send_frame(sock, send_key, 0, MALFORMED[case])
            sock.settimeout(5)
            try:
                answer = sock.recv(1 << 16)
            except socket.timeout:
                pytest.fail(f"{case}: the server neither closed the connection nor answered "
                            "within 5 s: it did not refuse the request")
            assert answer == b""                # closed, nothing answered
            assert logged(caplog, "closed a store connection from 127.0.0.1")
        assert caplog.text.count("closed a store connection") == 1
    finally:
        sock.close()
    assert other.get("kept") == b"yes" and served.client().get("kept") == b"yes"


def test_a_forged_frame_closes_the_connection(served):
    sock, send_key, receive_key, _ = channel.connect_as_client(served.address, KEY)
    try:
        channel.send_frame(sock, cipher.Seal(key(OTHER).key()), 0,
                           message(bytes([store.NUM_KEYS])))
        sock.settimeout(5)
        assert sock.recv(1 << 16) == b""
    finally:
        sock.close()


def test_a_small_request_cannot_make_the_server_build_a_huge_answer(served):
    """multi_get of one large value named 64 times: refused from the sizes
    it would have, before the answer is built (it would be 256 MiB here)."""
    import tracemalloc
    big = secrets.token_bytes(4 << 20)
    served.local.set("big", big)
    client = served.client()
    tracemalloc.start()
    try:
        try:
            with pytest.raises(ValueError, match="exceed the message bound"):
                client.multi_get(["big"] * 64)
        except dist.DistError as err:
            pytest.fail("the server built the answer before measuring it (peak "
                        f"{tracemalloc.get_traced_memory()[1] >> 20} MiB here) and lost the "
                        f"connection sending it, instead of refusing the request: {err}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak
    assert client.multi_get(["big"] * 2) == [big, big]      # the connection goes on


def test_the_table_is_bounded_and_says_so_to_the_member_that_fills_it(served):
    """A member writing keys without end is refused with ValueError naming
    the bound, on every write that grows the table; what was there stays, a
    deleted key frees its place, and other members go on."""
    served.table.max_keys, served.table.max_bytes = 4, 64
    writer, reader = served.client(), served.client()
    for n in range(4):
        writer.set(f"k{n}", b"v")
    for grow in (lambda: writer.set("k4", b"v"), lambda: writer.add("k4", 1),
                 lambda: writer.compare_set("k4", b"", b"v"),
                 lambda: writer.multi_set(["k0", "k4"], [b"v", b"v"])):
        with pytest.raises(ValueError, match="the job's store holds 4 keys, its most is 4"):
            grow()
    with pytest.raises(ValueError, match="holds 12 bytes, its most is 64"):
        writer.append("k0", b"x" * 60)
    assert reader.get("k0") == b"v" and reader.num_keys() == 4
    writer.delete_key("k3")
    writer.set("k4", b"w" * 40)
    assert reader.get("k4") == b"w" * 40 and served.table._bytes == 3 * 3 + 42
