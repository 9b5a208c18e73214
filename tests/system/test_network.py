"""Interface selection rules, the reachability check and the master wait, in one process.
(The same code across real namespace hosts: test_multihost.py.)

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/distributed/test_network.py."""


import pytest

from hetseq.distributed import interfaces, network
from hetseq.base.errors import UserError


def test_interface_list_has_loopback():
    rows = interfaces.list_addresses()
    assert ("lo", "127.0.0.1", True, True) in rows
    assert interfaces.interface_of("127.0.0.1") == "lo"
    assert interfaces.interface_of("127.0.1.1") == "lo"     # Debian's hostname address
    assert interfaces.interface_of("203.0.113.7") is None    # not held here


def test_route_to_loopback_master_binds_loopback():
    binding = network.choose("127.0.0.1", None, "gloo", env={})
    assert (binding.address, binding.interface, binding.source) == ("127.0.0.1", "lo", "auto")
    assert "routes to the master 127.0.0.1" in binding.reason


def test_flag_wins_over_variable_and_names_missing_interfaces():
    env = {"GLOO_SOCKET_IFNAME": "nope0"}
    assert network.choose("127.0.0.1", "lo", "gloo", env=env).source == "flag"
    with pytest.raises(UserError, match=r"GLOO_SOCKET_IFNAME nope0: .*interfaces here: .*lo"):
        network.choose("127.0.0.1", None, "gloo", env=env)
    with pytest.raises(UserError, match="--distributed-interface nope1"):
        network.choose(None, "nope1", "nccl", env={})
    # nccl reads its own variable; gloo's does not count for it.
    assert network.choose("127.0.0.1", None, "nccl", env={"NCCL_SOCKET_IFNAME": "lo"}).source \
        == "NCCL_SOCKET_IFNAME"
