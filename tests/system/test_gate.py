"""The gate of a job with a secret stays open under a flood (channel.py);
meeting points refuse a taken port, serve IPv6 and never listen everywhere
without a secret (meeting_point.py); sizes read from peers are bounded
(collectives.py).

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/store/test_gate.py."""

import os
import resource
import socket
import subprocess
import threading
import time

import pytest


from hetseq.distributed import meeting_point
from hetseq.base.errors import UserError
from hetseq.store import channel, job_secret

from machinery.commands import RUN_DIR, node_commands, train_cmd
from machinery.settings import UPDATE_LINE, child_env, free_port, require
from machinery.watched import Watched
from machinery.parity import COMMON
from unit.store.test_gate import SECRET, echoed, key, open_gate


FLOOD = 2000


SOFT_LIMIT = 1024        # most hosts' default soft limit of open files


HELD = 40                # sockets a flood may hold in rank 0: channel.HANDSHAKES (32), and slack


def test_a_handshake_that_trickles_is_dropped_at_its_deadline():
    """HANDSHAKE_S bounds the whole handshake, not each read: a byte every
    0.2 s would otherwise hold the slot for 64 x 0.2 s."""
    port = open_gate()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert channel._recv_exact(sock, len(channel.MAGIC) + channel.NONCE).startswith(channel.MAGIC)
        start, sent = time.monotonic(), 0
        sock.settimeout(0.2)
        while time.monotonic() - start < channel.HANDSHAKE_S + 3:
            try:
                if sock.recv(1) == b"":
                    break                          # the gate closed it
            except socket.timeout:
                sock.sendall(b"x")
                sent += 1
            except ConnectionResetError:
                break
        took = time.monotonic() - start
    assert took < channel.HANDSHAKE_S + 1 and sent < channel.NONCE + channel.TAG, (took, sent)


def test_over_its_cap_the_gate_answers_busy_at_once_and_a_member_gets_its_turn():
    """Over its cap of handshakes the gate answers 'busy' at once and keeps
    no thread for it; a member that cannot wait is told why, and one told
    'busy' asks again until its patience (BUSY_WAIT_S) ends, so it gets in
    once a slot frees."""
    port = open_gate(handshakes=2)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    for sock in idle:                                # both hold a handshake slot
        assert channel._recv_exact(sock, len(channel.MAGIC)) == channel.MAGIC
    threads = threading.active_count()
    over = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    for sock in over:                                # answered and closed, no thread kept
        sock.settimeout(5)
        assert channel._recv_exact(sock, len(channel.BUSY)) == channel.BUSY
        assert sock.recv(1) == b""
    assert threading.active_count() <= threads + 1
    # A member that cannot wait is told what happened, not "no secret".
    with pytest.raises(UserError, match="answered 'busy' for 0 s: its port is flooded"):
        channel.check(("127.0.0.1", port), key(), f"tcp://127.0.0.1:{port}", patience_s=0.3)
    # One that can gets in once a slot frees (the idle ones' deadline).
    start = time.monotonic()
    try:
        answer = echoed(port)
    except channel.Busy as err:
        pytest.fail(f"a member told 'busy' gave up after {time.monotonic() - start:.1f} s instead "
                    f"of asking again for up to {channel.BUSY_WAIT_S} s: {err}")
    assert answer == b"ping"
    assert time.monotonic() - start < channel.HANDSHAKE_S + 2
    for sock in idle + over:
        sock.close()


def open_files(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:      # it ended (the test then says why)
        return 0


def sample(pid, peak, flood):
    """Append ``pid``'s number of open files to ``peak`` every 5 ms while
    the flood is opened and for HANDSHAKE_S after (60 s at most)."""
    end, give_up = None, time.monotonic() + 60
    while time.monotonic() < (end or give_up):
        peak.append(open_files(pid))
        if end is None and len(flood) == FLOOD:
            end = time.monotonic() + channel.HANDSHAKE_S
        time.sleep(0.005)


def test_a_flood_of_idle_connections_neither_stops_the_job_nor_shuts_its_door():
    """A 2-rank job with a secret, its rank 0 (the gate) under a soft limit of
    1024 open files; 2000 idle connections from a process without the secret
    are opened and held. The job keeps training, rank 0 holds at most HELD
    sockets more than before (its handshakes in progress), and while the flood is
    still held a member with the secret gets in and uses the store."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    require(hard == resource.RLIM_INFINITY or hard >= FLOOD + 100,
            f"needs {FLOOD + 100} open files in the test process (ulimit -n)")
    port = free_port()
    commands = node_commands([*COMMON, "--max-update", 10**6, "--no-save", "--toy-sample-ms", 2,
                              "--distributed-timeout", 30], [["--max-sentences", 16]] * 2,
                             f"tcp://127.0.0.1:{port}")
    options = dict(cwd=RUN_DIR, env=child_env({job_secret.SECRET_VARIABLE: SECRET}), text=True,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_LIMIT, hard))  # noqa: E731
    rank0 = Watched(subprocess.Popen(train_cmd(*commands[0]), preexec_fn=limit, **options))
    rank1 = Watched(subprocess.Popen(train_cmd(*commands[1]), **options))
    flood = []
    try:
        rank0.wait_for(UPDATE_LINE, timeout=60)
        before = open_files(rank0.proc.pid)
        peak = [before]
        sampler = threading.Thread(target=sample, args=(rank0.proc.pid, peak, flood), daemon=True)
        sampler.start()
        for _ in range(FLOOD):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError as err:
                pytest.fail(f"the gate stopped accepting after {len(flood)} idle connections "
                            f"({err})\n{rank0.output()[-3000:]}")
        updates = len([line for line in rank0.lines if "| update" in line])
        deadline = time.monotonic() + 20
        while len([line for line in rank0.lines if "| update" in line]) < updates + 20:
            assert time.monotonic() < deadline and rank0.proc.poll() is None, \
                rank0.output()[-3000:]
            time.sleep(0.05)
        sampler.join(timeout=channel.HANDSHAKE_S + 5)
        assert max(peak) <= before + HELD, (before, max(peak))
        # The flood is still held: a member with the secret gets in.
        member = meeting_point.join_meeting_point(
            ("127.0.0.1", port), key().for_url(f"tcp://127.0.0.1:{port}"), 10)
        member.set("test/member", "in")
        assert member.get("test/member") == b"in"
        assert "Too many open files" not in rank0.output(), rank0.output()[-3000:]
    finally:
        for sock in flood:
            sock.close()
        for node in (rank0, rank1):
            if node.proc.poll() is None:
                node.proc.kill()
            node.finish(timeout=30)
