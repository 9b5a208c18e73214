"""Interface selection rules, the reachability check and the master wait, in one process.
(The same code across real namespace hosts: test_multihost.py.)"""

import socket
import time
import threading

import pytest
import torch.distributed as dist

from hetseq.distributed import interfaces, network
from hetseq.distributed.rendezvous import wait_for_ranks
from hetseq.base.errors import UserError


def test_apply_sets_the_backend_variable_but_keeps_the_users():
    auto = network.Binding("10.0.0.1", "eth7", "why")
    env = {}
    network.apply(auto, "nccl", env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7"}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    network.apply(auto, "gloo", env)
    assert env == {"GLOO_SOCKET_IFNAME": "ib0"}
    network.apply(network.Binding("10.0.0.1", "eth7", "why", "flag"), "gloo", env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth7"}


@pytest.fixture
def fake_routes(monkeypatch):
    """Host A holds 10.1.0.1 on eth0; routes to 10.1.0.0/24 leave from it."""
    monkeypatch.setattr(interfaces, "route_source",
                        lambda target: "10.1.0.1" if target.startswith("10.1.0.") else "127.0.0.1")
    monkeypatch.setattr(interfaces, "interface_of",
                        lambda address: "eth0" if address == "10.1.0.1" else "lo")


def peers(*addresses):
    return {rank: {"host": f"h{rank}", "addr": addr} for rank, addr in enumerate(addresses)}


def test_master_name_on_loopback_reroutes_to_a_peer(fake_routes):
    first = network.Binding("127.0.1.1", "lo", "routes to the master hostA")
    final = network.reconcile(first, 0, peers("127.0.1.1", "127.0.1.1", "10.1.0.2"), True)
    assert (final.address, final.interface) == ("10.1.0.1", "eth0")
    assert "peer address 10.1.0.2" in final.reason


def test_single_host_job_stays_on_loopback(fake_routes):
    first = network.Binding("127.0.0.1", "lo", "x")
    assert network.reconcile(first, 1, peers("127.0.0.1", "127.0.0.1"), True) is first


def test_file_rendezvous_routes_to_rank_zero(fake_routes):
    first = network.Binding("192.168.5.5", "wlan0", "primary")
    final = network.reconcile(first, 2, peers("10.1.0.9", "10.1.0.1", "192.168.5.5"), False)
    assert final.address == "10.1.0.1" and "rank 0's address 10.1.0.9" in final.reason
    # rank 0 keeps its own choice; a user's choice is never changed
    assert network.reconcile(first, 0, peers("192.168.5.5", "10.1.0.1"), False) is first
    chosen = network.Binding("127.0.0.1", "lo", "set", "flag")
    assert network.reconcile(chosen, 1, peers("10.1.0.9", "127.0.0.1"), False) is chosen


def test_describe_groups_ranks_by_host():
    table = {r: {"host": h, "addr": a, "iface": "eth0"}
             for r, (h, a) in enumerate([("A", "1"), ("A", "1"), ("A", "1"), ("B", "2")])}
    assert network.describe(table) == "A 1 (eth0): ranks 0-2; B 2 (eth0): rank 3"
    assert network._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def _check(store, rank, address, out):
    binding = network.Binding(address, "lo", "test")
    registered = peers("127.0.0.1", "127.0.0.2")
    try:
        out[rank] = network.check_reachability(
            store, rank, 2, binding, registered,
            lambda prefix: wait_for_ranks(store, prefix, 2, time.monotonic() + 20, "test"))
    except UserError as err:
        out[rank] = err


def test_reachability_check_between_two_addresses():
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_check, args=(store, r, f"127.0.0.{r + 1}", out))
               for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert out[0] == out[1]
    assert [out[0][r]["addr"] for r in (0, 1)] == ["127.0.0.1", "127.0.0.2"]


def test_reach_names_why_and_detects_another_process():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        threading.Thread(target=lambda: other.accept()[0].sendall(b"\0\0\0\7"), daemon=True).start()
        assert network._reach("127.0.0.1", port, 3, 5) == "another process answered there"
    assert "refused" in network._reach("127.0.0.1", port, 3, 5)


def test_waiting_for_an_absent_master_ends_with_the_reason():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]        # bound, not listening: refused
        with pytest.raises(UserError, match=f"master at 127.0.0.1:{port}: Connection refused"):
            network.wait_until_reachable("127.0.0.1", port, 1.0,
                                         lambda why: f"master at 127.0.0.1:{port}: {why}")
    with socket.socket() as up:
        up.bind(("127.0.0.1", 0))
        up.listen()
        network.wait_until_reachable("127.0.0.1", up.getsockname()[1], 1.0, str)
