"""Jobs across hosts: each host a network namespace with its own address and
hostname (which it resolves to 127.0.1.1, as Debian does), on a rate-limited
switch. No interface flag or variable is given unless a test says so."""

import subprocess
import time

import pytest

from hetseq.testing import cluster as netns

from conftest import ROOT, child_env, final_params, max_diff, train_cmd
from test_parity import COMMON, reference

AVAILABLE, WHY = netns.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"namespace hosts: {WHY}")

_ports = iter(range(29500, 29600))


def next_port():
    """Each namespace is new and empty, so any port is free there; a counter
    keeps one test's TIME_WAIT sockets away from the next test's store."""
    return next(_ports)


@pytest.fixture(scope="module")
def hosts():
    netns.remove_stale()
    with netns.VirtualCluster(2, rate="1gbit") as cluster:
        yield cluster


@pytest.fixture
def fresh_hosts():
    """For tests that cut links or add interfaces."""
    with netns.VirtualCluster(2, rate="1gbit") as cluster:
        yield cluster


def start(cluster, layout, url, *extra, world=None, first=0):
    """One train.py per host; ``layout`` lists (host, processes, batch per process)
    for ranks ``first``, ``first + 1``, ... of a job of ``world`` ranks."""
    world, procs = world or sum(n for _, n, _ in layout), []
    for host, nprocs, batch in layout:
        argv = train_cmd("--distributed-world-size", world, "--distributed-rank", first,
                         "--distributed-gpus", nprocs, "--distributed-init-method", url,
                         "--max-sentences", batch, *extra)
        procs.append(cluster.popen(host, argv, cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   env=child_env()))
        first += nprocs
    return procs


def finish(procs, timeout=120):
    return [(proc.communicate(timeout=timeout)[0], proc.returncode) for proc in procs]


def assert_ok(results):
    for out, code in results:
        assert code == 0, out[-3000:]


def test_tcp_by_hostname_two_plus_one_processes_match_one_process(hosts, tmp):
    # tcp://hostA: on host A the name resolves to 127.0.1.1, which gloo alone
    # would advertise to host B (the hang this guards against).
    out = tmp / "split"
    results = finish(start(hosts, [(0, 2, 8), (1, 1, 16)], f"tcp://hostA:{next_port()}",
                           *COMMON, "--save-dir", out))
    assert_ok(results)
    assert "network: hostA 10.213.0.1 (eth0): ranks 0-1; hostB 10.213.0.2 (eth0): rank 2" \
        in results[0][0], results[0][0][-3000:]
    assert max_diff(reference(tmp), final_params(out)) < 1e-5


def test_file_rendezvous_one_plus_two_processes_match_one_process(hosts, tmp):
    out = tmp / "split"
    results = finish(start(hosts, [(0, 1, 24), (1, 2, 4)], f"file://{tmp / 'meet'}",
                           *COMMON, "--save-dir", out))
    assert_ok(results)
    assert "hostB 10.213.0.2 (eth0): ranks 1-2" in results[0][0], results[0][0][-3000:]
    assert max_diff(reference(tmp), final_params(out)) < 1e-5


def test_cut_link_both_sides_name_the_lost_rank_and_its_host(fresh_hosts):
    timeout = 10
    procs = start(fresh_hosts, [(0, 2, 8), (1, 1, 8)], f"tcp://hostA:{next_port()}",
                  "--task", "toy", "--user-dir", ROOT / "tests" / "tasks", "--max-update", 10**6,
                  "--no-save", "--disable-validation", "--log-interval", 1000,
                  "--toy-slow-rank", 0, "--toy-slow-ms", 2, "--distributed-timeout", timeout)
    time.sleep(10)                                    # well into training
    assert procs[0].poll() is None and procs[1].poll() is None
    fresh_hosts.cut(1)
    cut = time.monotonic()
    # Host A keeps the store and sees rank 2's heartbeat stop; host B loses
    # the store with the link and names rank 0, whose store it was.
    for proc, lost in zip(procs, ["lost rank 2 (host hostB, 10.213.0.2",
                                  "lost rank 0 (host hostA, 10.213.0.1"]):
        out, code = finish([proc], timeout=60)[0]
        assert code == 3, out[-3000:]
        assert time.monotonic() - cut < timeout + 8, out[-3000:]
        assert lost in out, out[-3000:]


def test_unreachable_master_at_start_is_named(fresh_hosts):
    fresh_hosts.cut(0)
    start_time = time.monotonic()
    procs = start(fresh_hosts, [(1, 1, 8)], f"tcp://hostA:{next_port()}", *COMMON,
                  "--no-save", "--distributed-timeout", 6, world=2, first=1)
    out, code = finish(procs, timeout=60)[0]
    assert code == 2, out[-3000:]
    assert time.monotonic() - start_time < 6 + 10
    assert "could not reach the master at hostA (10.213.0.1):" in out, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]


def test_peer_address_that_others_cannot_reach_is_named(fresh_hosts):
    dead = fresh_hosts.add_dead_end_interface(1, "side0")
    url, start_time = f"tcp://hostA:{next_port()}", time.monotonic()
    procs = start(fresh_hosts, [(0, 1, 8)], url, *COMMON, "--no-save", "--distributed-timeout",
                  60, world=2)
    procs += start(fresh_hosts, [(1, 1, 8)], url, *COMMON, "--no-save", "--distributed-timeout",
                   60, "--distributed-interface", "side0", world=2, first=1)
    results = finish(procs, timeout=90)
    for out, code in results:
        assert code == 2, out[-3000:]
        assert f"cannot reach rank 1 at {dead}:" in out and "side0" in out, out[-3000:]
    assert time.monotonic() - start_time < 40   # the probe's 10 s, not the 60 s timeout
