"""The gate of a job with a secret stays open under a flood (channel.py);
meeting points refuse a taken port, serve IPv6 and never listen everywhere
without a secret (meeting_point.py); sizes read from peers are bounded
(collectives.py). That no other user of a host reaches a store with a
secret is tests/system/test_store.py's."""

import errno
import logging
import os
import socket
import struct
import threading
import time
import types

import pytest

from machinery.relay import relay
import torch

from hetseq.distributed import collectives, meeting_point
from hetseq.base.errors import PeerLost, UserError
from hetseq.store import channel, gate, job_secret

from machinery.settings import free_port, require


SECRET = "c41e9a07d3b25f68e1a4c7093bd2f5e6"


def key(text=SECRET):
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text})


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def open_gate(handshakes=channel.HANDSHAKES, listener=None):
    """A gate on 127.0.0.1 (port) whose ``serve`` echoes one sealed frame back."""
    return echo_gate(listener, handshakes=handshakes)[0]


def echo_gate(listener=None, **caps):
    """(port, the Gate) of an echoing gate on 127.0.0.1 with ``caps``."""
    listener = listener or socket.create_server(("127.0.0.1", 0))

    def echo(sock, send_key, receive_key, where):
        with sock:
            channel.send_frame(sock, send_key, 0, channel.receive_frame(sock, receive_key, 0))
    return listener.getsockname()[1], gate.Gate(listener, key(), echo, **caps)


def echoed(port, patience_s=channel.BUSY_WAIT_S):
    sock, send_key, receive_key, _ = channel.connect_as_client(("127.0.0.1", port), key(), patience_s)
    with sock:
        channel.send_frame(sock, send_key, 0, b"ping")
        return channel.receive_frame(sock, receive_key, 0)


def test_one_address_cannot_take_every_place_in_the_handshake():
    """A machine that holds its handshakes open to the deadline, again and
    again, gets at most PER_SOURCE places: a member from another address
    is greeted at once and gets in while they are held."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    gate.Gate(listener, key(), lambda sock, *_: sock.close(), handshakes=8, per_source=2)
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    for sock in held:
        assert channel._recv_exact(sock, len(channel.MAGIC)) == channel.MAGIC
    with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
        assert channel._recv_exact(third, len(channel.BUSY)) == channel.BUSY
    # 127.0.0.2 is this host too: another source address.
    with socket.create_connection(("127.0.0.1", port), timeout=5,
                                  source_address=("127.0.0.2", 0)) as member:
        member.settimeout(5)
        channel.handshake_as_client(member, key(), time.monotonic() + 5)
    for sock in held:
        sock.close()


class FailingListener:
    """A listener whose first ``failures`` accepts fail with ``error()``
    (by default out of descriptors)."""

    def __init__(self, failures, error=lambda: OSError(errno.EMFILE, os.strerror(errno.EMFILE))):
        self.real, self.failures, self.error = socket.create_server(("127.0.0.1", 0)), \
            failures, error

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise self.error()
        return self.real.accept()

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("error", [lambda: OSError(errno.EMFILE, os.strerror(errno.EMFILE)),
                                   lambda: MemoryError()], ids=["EMFILE", "MemoryError"])
def test_failed_accepts_are_waited_out_and_only_a_close_ends_the_gate(caplog, error):
    """An accept that fails (out of descriptors, or memory while Python
    builds the socket, four times) is logged once and waited out: the gate
    goes on accepting and a member gets in. Only closing the listener ends
    the gate's accept loop."""
    listener = FailingListener(failures=4, error=error)
    before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING, logger=channel.__name__):
        port = open_gate(listener=listener)
        try:
            answer = echoed(port)
        except OSError as err:       # socket.timeout: nothing accepts the connection any more
            pytest.fail(f"after {4 - listener.failures} failed accept(s) the gate no longer "
                        f"accepts: a member got no greeting ({err!r})")
        assert answer == b"ping"
    loops = [t for t in set(threading.enumerate()) - before if t.name == "hetseq-gate"]
    assert len(loops) == 1, f"the gate's accept loop ended before its listener closed: {loops}"
    loop, = loops
    assert listener.failures == 0
    assert caplog.text.count("accepting a connection failed") == 1, caplog.text
    listener.real.close()
    loop.join(timeout=gate.POLL_S + 2)
    assert not loop.is_alive()


def test_an_elastic_member_serves_an_ipv6_address_at_the_urls_port():
    """A meeting point whose URL names an IPv6 address ([::1]) is served
    there, at the URL's port, and a member reaches it."""
    require(socket.has_ipv6, "needs IPv6")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as err:
        require(False, f"needs IPv6 loopback (::1): {err}")
    port = free_port()
    try:
        store, served = meeting_point.serve_meeting_point(f"tcp://[::1]:{port}", "::1", port,
                                                       key(), 10)
    except UserError as err:
        pytest.fail(f"a meeting point on an IPv6 address (::1, where this host listens) "
                    f"was not served: {err}")
    assert served == port
    meeting_point.join_meeting_point(("::1", port), key(), 10).set("k", "v")
    assert store.get("k") == b"v"


def test_a_taken_port_is_an_error_unless_a_node_of_this_job_holds_it(monkeypatch):
    """A port held by another program, or by another job, is an error that
    says how to find the holder; a port held by a node of this job (the same
    secret) is not: a second node of the job on this host takes another port."""
    monkeypatch.setattr(channel, "GREETING_S", 0.5)     # "another program" never greets
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with socket.create_server(("127.0.0.1", port)):          # another program
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use .*"
                                            f"ss -ltnp 'sport = :{port}'"):
            meeting_point.serve_meeting_point(url, "127.0.0.1", port, key(), 10)
    _, served = meeting_point.serve_meeting_point(url, "127.0.0.1", port, key(), 10)
    assert served == port
    other = key("7d2b9f41c6e80a35b1f4d9e27c6a0b83")
    with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
        meeting_point.serve_meeting_point(url, "127.0.0.1", port, other, 10)   # another job's
    try:
        _, second = meeting_point.serve_meeting_point(url, "127.0.0.1", port, key(), 10)
    except UserError as err:
        pytest.fail(f"a second node of this job on this host was refused the port a node of "
                    f"the same job holds, instead of taking another: {err}")
    assert second not in (port, 0)                           # this job's second node here


def test_a_relay_squatting_on_the_meeting_point_is_refused():
    """A forwarder on the URL's port passes a member's proof along, but not
    its address: the gate states where it listens under its proof, so a
    node finds the relay out and refuses to move aside (one line naming
    the port and ss -ltnp), instead of leaving the URL to the squatter."""
    member_port, url_port = free_port(), free_port()
    meeting_point.serve_meeting_point(f"tcp://127.0.0.1:{member_port}", "127.0.0.1", member_port,
                                   key(), 10)
    squatter = relay(url_port, member_port)
    try:
        with pytest.raises(UserError, match=f"port {url_port} on 127.0.0.1 is held by a relay to "
                                            f"a node of this job that listens on 127.0.0.1:"
                                            f"{member_port}.*ss -ltnp 'sport = :{url_port}'"):
            meeting_point.serve_meeting_point(f"tcp://127.0.0.1:{url_port}", "127.0.0.1", url_port,
                                           key(), 10)
    finally:
        squatter.close()
    # Through the relay the client still gets in (an SSH tunnel is a relay
    # too): only the meeting point's holder must be where it says.
    assert channel.connect_as_client(("127.0.0.1", member_port), key())[3] == \
        ("127.0.0.1", member_port)


def test_the_accept_loop_survives_an_error_taking_a_connection(monkeypatch):
    """No thread can be started for one connection (RuntimeError: a process
    at its thread limit): that connection is closed, its handshake place
    given back, and the next one is served."""
    real = threading.Thread.start
    failures = []

    def start(self):
        if self._target.__name__ == "_admit" and not failures:
            failures.append(self)
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    port, door = echo_gate(handshakes=1)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as first:
        first.settimeout(5)
        try:
            assert first.recv(1) == b""                 # closed: no thread for it
        except socket.timeout:
            pytest.fail("the connection no thread could take was left open (the loop died?)")
    try:
        answer = echoed(port, patience_s=2)
    except OSError as err:
        pytest.fail(f"the gate took no connection after an error taking one: {err!r}")
    assert failures and answer == b"ping"
    wait_until(lambda: door._busy == {} and door._serving == 0, 10, "the places given back")


def test_a_member_over_the_served_cap_is_told_full_and_gets_in_when_one_ends():
    """At most ``served`` connections past the handshake (each holds a
    thread): the next one, secret and all, is told FULL with the reason and
    asks again until a place frees."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    release = threading.Event()

    def hold(sock, *_):
        with sock:
            release.wait(30)
    gate.Gate(listener, key(), hold, served=2)
    held = [channel.connect_as_client(("127.0.0.1", port), key())[0] for _ in range(2)]
    with pytest.raises(UserError, match="serves all the connections it takes"):
        channel.check(("127.0.0.1", port), key(), f"tcp://127.0.0.1:{port}", patience_s=0.3)
    threading.Timer(0.5, release.set).start()
    sock, *_ = channel.connect_as_client(("127.0.0.1", port), key(), patience_s=10)
    for each in (sock, *held):
        each.close()


def proof_then_reset(port, secret):
    """A client that proves the secret and resets the connection (SO_LINGER
    0) before the gate answers: the place it was given must come back."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        ns = channel._recv_exact(sock, len(channel.MAGIC) + channel.NONCE)[-channel.NONCE:]
        nc = os.urandom(channel.NONCE)
        sock.sendall(nc + channel._mac(secret.key(), b"client", ns, nc))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_member_that_resets_after_its_proof_gives_its_place_back():
    """However a connection ends after the gate gave it a place (a reset
    before OK, an error in serve), the place is free again: 60 resets on a
    gate of 4 places leave all 4 for the next member."""
    port, door = echo_gate(served=4)
    for _ in range(60):
        proof_then_reset(port, key())
    wait_until(lambda: door._serving == 0 and door._busy == {}, 20, "every place given back")
    assert echoed(port, patience_s=2) == b"ping"


def answered(verdict):
    """What a client makes of a gate (one that knows the secret) whose
    answer after the proof is ``verdict(key, nc, ns)``."""
    client, server = socket.socketpair()
    secret, ns = key(), os.urandom(channel.NONCE)
    server.sendall(channel.MAGIC + ns)
    outcome = {}

    def gate():
        nc = channel._recv_exact(server, channel.NONCE + channel.TAG)[:channel.NONCE]
        server.sendall(verdict(secret.key(), nc, ns))
    thread = threading.Thread(target=gate)
    thread.start()
    try:
        outcome["stated"] = channel.handshake_as_client(client, secret, time.monotonic() + 5)[2]
    except (channel.Refused, OSError) as err:
        outcome["error"] = err
    thread.join()
    client.close()
    server.close()
    return outcome


def stating(where):
    return lambda k, nc, ns: (b"OK" + bytes([len(where)]) + where +
                              channel._mac(k, b"server", nc, ns, where))


@pytest.mark.parametrize("where", ["127.0.0.1 \u00b2".encode(), "127.0.0.1 \u0661\u0662".encode(),
                                   b"127.0.0.1 99999", b"127.0.0.1 0", b"127.0.0.1", b"",
                                   b"\xff\xfe 29500", b"a\x1b[2J 29500", b"h " + b"9" * 200])
def test_a_stated_address_that_is_not_one_is_refused(where):
    """The gate's stated address is a member's word, checked like any value
    from the network: no traceback, no port 12 read from Arabic digits."""
    outcome = answered(stating(where))
    assert isinstance(outcome.get("error"), channel.Refused), outcome
    assert answered(stating(b"127.0.0.1 29500")) == {"stated": ("127.0.0.1", 29500)}


def test_full_is_believed_only_with_the_gates_proof():
    """A squatter without the secret cannot make a member wait by answering
    'full': the answer carries the gate's HMAC."""
    forged = answered(lambda k, nc, ns: channel.FULL + os.urandom(channel.TAG))
    assert isinstance(forged.get("error"), channel.Refused) and \
        not isinstance(forged["error"], channel.Full), forged
    proven = answered(lambda k, nc, ns: channel.FULL + channel._mac(k, b"full", nc, ns))
    assert isinstance(proven.get("error"), channel.Full), proven


def test_a_member_slow_to_greet_still_holds_its_port(monkeypatch):
    """A member busy on a loaded host greets after GREETING_S: a second node
    of the job on that host asks again, and does not take the port for
    another job's. (The member here never greets the first knock and greets
    every later one at once.)"""
    monkeypatch.setattr(channel, "GREETING_S", 1.0)
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    held, served = [], threading.Event()

    def slow_member():
        first, _ = listener.accept()
        held.append(first)                          # never greeted: the knock times out
        while not served.is_set():
            sock, _ = listener.accept()
            held.append(sock)
            try:
                channel.handshake_as_server(sock, key(), time.monotonic() + 30,
                                            ("127.0.0.1", port))
            except OSError:
                pass
    threading.Thread(target=slow_member, daemon=True).start()
    try:
        _, second = meeting_point.serve_meeting_point(f"tcp://127.0.0.1:{port}", "127.0.0.1",
                                                   port, key(), 10)
    except UserError as err:
        pytest.fail(f"a member that greeted late was taken for another job: {err}")
    finally:
        served.set()
        listener.close()
        for sock in held:
            sock.close()
    assert second != port


def test_a_store_never_listens_on_every_address(monkeypatch):
    """A URL naming this host, which resolves to loopback here (Debian's
    127.0.1.1), with ranks on other hosts: rank 0 listens on this host's
    primary address, never on every address (which would hand a store
    without a secret to anyone), and the ranks of its host connect there
    too; --distributed-interface chooses another; localhost is one host."""
    monkeypatch.setattr(socket, "gethostname", lambda: "thishost")
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(meeting_point.interfaces, "resolve", lambda host: "127.0.1.1")
    monkeypatch.setattr(meeting_point.interfaces, "primary_address", lambda: "10.9.8.7")
    monkeypatch.setattr(meeting_point.interfaces, "address_of",
                        lambda name: {"side0": "10.1.1.1"}.get(name))
    url = "tcp://thishost:1"
    for secret in (None, key()):
        access = meeting_point.Access(secret)
        assert meeting_point._listen_address(url, "thishost", access) == "10.9.8.7"
        assert meeting_point._client_address("thishost", access) == "10.9.8.7"
    side = meeting_point.Access(None, "side0")
    assert meeting_point._listen_address(url, "thishost", side) == "10.1.1.1"
    assert meeting_point._client_address("thishost", side) == "10.1.1.1"
    one_host = meeting_point.Access(None, spans_hosts=False)
    assert meeting_point._listen_address(url, "thishost", one_host) == "127.0.1.1"
    assert meeting_point._listen_address("tcp://localhost:1", "localhost",
                                      meeting_point.Access(None)) == "127.0.1.1"
    assert meeting_point._client_address("otherhost", meeting_point.Access(None)) == "otherhost"


def refused(call, announced):
    """``call()`` must raise PeerLost naming the size a peer ``announced``;
    any other exception means that size was used (allocated, sliced,
    unpickled) before it was checked."""
    try:
        with pytest.raises(PeerLost, match=f"rank 1 announced an object of {announced} bytes"):
            call()
    except AssertionError:
        raise
    except Exception as err:
        pytest.fail(f"a size of {announced} bytes announced by a peer was used instead of "
                    f"refused with PeerLost: {type(err).__name__}: {str(err)[:300]}")


def test_sizes_announced_by_peers_are_bounded_before_anything_is_allocated(monkeypatch):
    """A size a peer announces outside 0..MAX_OBJECT_BYTES (too large, or
    negative) is refused with PeerLost before anything is allocated or decoded,
    by all_gather_object and broadcast_from alike."""
    ctx = types.SimpleNamespace(distributed=True, backend="gloo", device=torch.device("cpu"),
                                world_size=2, rank=0, is_main=True)

    def gather(out, mine, group=None):
        out[0].copy_(mine)
        out[1].fill_(announced)
    monkeypatch.setattr(collectives.dist, "all_gather", gather)
    monkeypatch.setattr(collectives.dist, "broadcast", lambda tensor, src, group=None: tensor.fill_(announced))
    for announced in (collectives.MAX_OBJECT_BYTES + 1, -1):
        refused(lambda: collectives.all_gather_object({"x": 1}, ctx), announced)
        refused(lambda: collectives.broadcast_from(1, dict, ctx), announced)


def test_refused_handshakes_are_one_line_per_source_and_interval(caplog):
    """One local client sending 64 zero bytes per connection for a second
    (before: 3,747 warnings in 2 s, relayed over SSH too) makes one line;
    the count comes in one more line per interval."""
    import logging
    port = open_gate()
    caplog.set_level(logging.WARNING, logger="hetseq.store.channel")
    sent, end = 0, time.monotonic() + 1.0
    while time.monotonic() < end:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(bytes(64))
            try:
                while sock.recv(4096):      # until the gate closes it
                    pass
            except OSError:
                pass
        sent += 1
    wait_until(lambda: "refused a connection" in caplog.text, 10, "the first refusal's line")
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert sent >= 20 and len(lines) == 1, (sent, lines)


def test_a_tally_logs_a_source_once_then_its_count_per_interval():
    from hetseq.base.logs import Tally
    tally = Tally(seconds=0.2, sources=2)
    assert tally.add("a", "bad magic") == (True, [])
    assert [tally.add("a", f"bad {i}") for i in range(3)] == [(False, [])] * 3
    assert tally.add("b", "x") == (True, []) and tally.add("c", "y") == (True, [])
    assert tally.add("d", "z") == (False, [])          # beyond 2 sources: counted together
    time.sleep(0.25)
    first, due = tally.add("a", "late")
    assert not first and sorted(due) == [("a", 4, "late"), ("other addresses", 1, "z")], due
    assert tally.add("a", "again") == (True, [])      # a new interval: its first line again
