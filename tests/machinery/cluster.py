"""Several "hosts" on one Linux machine: network namespaces on a switch.

For tests and benchmarks of what crosses a network (root and iproute2
needed). Each host is a network namespace with its own ``eth0`` and address
in 10.213.0.0/24, joined to a bridge in a switch namespace by a veth pair
whose two ends are rate-limited by a token bucket (``tc tbf``). Commands run
in a host with their own hostname (``unshare --uts``) and their own
``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts``): the host
resolves its own name to 127.0.1.1 as Debian does, and the other hosts'
names to their addresses, as a cluster's DNS would. Nothing is routed
outside the namespaces; ``close`` removes everything it made (and puts
back the kernel's ARP table limits, raised for clusters of more than 22
hosts), and ``remove_stale`` what a killed run left behind.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

from machinery.zygote import run as run_forked

PREFIX = "hetseq-net-"
SUBNET = "10.213.0"
DEAD_END_SUBNET = "10.213.99"    # addresses no host has a route to
# The kernel's ARP table is one for every namespace; past gc_thresh3 entries
# (1024 by default) it drops new neighbours, and packets with them.
NEIGHBOURS = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


def _sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def available():
    """(True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return False, f"needs '{tool}' (Debian packages iproute2, util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "del", probe)
    except (subprocess.SubprocessError, OSError) as err:
        return False, f"cannot create a network namespace: {err}"
    return True, ""


def remove_stale():
    """Delete namespaces of earlier runs whose process is gone."""
    listed = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def host_name(index):
    """hostA ... hostZ, hostAA, hostAB, ...: valid hostnames for any count."""
    letters, index = "", index + 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("A") + rest) + letters
    return f"host{letters}"


def _burst(rate):
    """tbf needs a bucket of at least one timer tick of traffic; 4 ms of it."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return max(64 * 1024, int(float(rate[:-len(unit)]) * scale / 8 * 0.004))
    raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit")


class VirtualCluster:
    """``with VirtualCluster(3, rate="1gbit") as cluster: cluster.popen(0, argv)``."""

    def __init__(self, hosts=2, rate="1gbit", zygote=None):
        """``zygote``: a machinery/zygote.py Zygote that python commands fork
        from (entering their host themselves, namespace_host.py) instead of
        starting anew."""
        self.size, self.rate, self.zygote = hosts, rate, zygote
        self.tag = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.switch = f"{self.tag}-sw"
        self.names = [host_name(i) for i in range(hosts)]
        self.namespaces = [f"{self.tag}-{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.procs = []
        self._neighbours = None       # the ARP table's limits before start(), when raised

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        self._make_room_for_neighbours()
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index in range(self.size):
            self._add_host(index)
        self.set_rate(self.rate)

    def _make_room_for_neighbours(self):
        """Every host may talk to every other (gloo's full mesh): 64 hosts
        need 64 x 63 ARP entries, four times the default limit. Raised for
        the cluster's life when too small (restored by close)."""
        needed = 2 * self.size * self.size
        try:
            limits = [int(open(NEIGHBOURS.format(i)).read()) for i in (1, 2, 3)]
        except (OSError, ValueError):
            return
        if limits[2] >= needed:
            return
        self._neighbours = limits
        for i, value in zip((1, 2, 3), (limits[0], needed // 2, needed)):
            with open(NEIGHBOURS.format(i), "w") as f:
                f.write(str(max(value, limits[i - 1])))

    def _add_host(self, index):
        ns, port = self.namespaces[index], f"p{index}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[index]}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as hosts:
            hosts.write("127.0.0.1 localhost\n::1 localhost\n")
            for other, (name, address) in enumerate(zip(self.names, self.addresses)):
                # Its own name on loopback, as Debian's installer writes it.
                hosts.write(f"{'127.0.1.1' if other == index else address} {name}\n")

    def set_rate(self, rate):
        """A token bucket of ``rate`` on both ends of every host's link."""
        self.rate = rate
        for index in range(self.size):
            self.set_host_rate(index, rate)

    def set_host_rate(self, index, rate):
        """A token bucket of ``rate`` on both ends of host ``index``'s link
        (a machine behind a slower line than the others)."""
        ns = self.namespaces[index]
        for where, dev in ((ns, "eth0"), (self.switch, f"p{index}")):
            _sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root",
                "tbf", "rate", rate, "burst", str(_burst(rate)), "latency", "100ms")

    def cut(self, index):
        """Unplug host ``index`` from the switch (its processes keep running)."""
        _sh("ip", "-n", self.switch, "link", "set", f"p{index}", "down")

    def split(self, *apart):
        """Cut the network in two: hosts ``apart`` on a switch of their own,
        reaching each other but none of the rest (and the rest not them)."""
        _sh("ip", "-n", self.switch, "link", "add", "br1", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br1", "up")
        for index in apart:
            _sh("ip", "-n", self.switch, "link", "set", f"p{index}", "master", "br1")

    def signal_host(self, index, sig):
        """Send ``sig`` to every process on host ``index`` (SIGKILL: the machine
        is switched off; SIGSTOP: it hangs)."""
        pids = _sh("ip", "netns", "pids", self.namespaces[index], check=False).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass

    def plug(self, index):
        """Plug host ``index`` back into the switch. Addresses that failed to
        resolve while it was out are forgotten on every host: a FAILED
        neighbour entry left by the outage answers a new connection with 'No
        route to host' for seconds (a node retries and says so in a line that
        a test counting a node's lines would not expect)."""
        _sh("ip", "-n", self.switch, "link", "set", f"p{index}", "up")
        for ns in self.namespaces:
            _sh("ip", "-n", ns, "neigh", "flush", "all", check=False)

    def add_dead_end_interface(self, index, name="side0"):
        """An interface on host ``index`` whose address no other host can reach
        (a VPN or container bridge of one machine); returns the address."""
        ns, dead = self.namespaces[index], f"{self.tag}-x{index}"
        address = f"{DEAD_END_SUBNET}.{index + 1}"
        _sh("ip", "netns", "add", dead)
        self.namespaces.append(dead)
        _sh("ip", "link", "add", name, "netns", ns, "type", "veth", "peer", "name", "eth0",
            "netns", dead)
        _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", name)
        _sh("ip", "-n", ns, "link", "set", name, "up")
        _sh("ip", "-n", dead, "link", "set", "eth0", "up")
        return address

    def command(self, index, argv):
        """``argv`` as run on host ``index``, under its own hostname."""
        return ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.names[index], *map(str, argv)]

    def _forks(self, argv, env):
        """Whether ``argv`` (with ``env``) is a python command the zygote runs."""
        return (self.zygote is not None and str(argv[0]) == sys.executable
                and self.zygote.serves(os.environ if env is None else env))

    def popen(self, index, argv, cwd=None, env=None, **kwargs):
        if self._forks(argv, env):
            proc = self.zygote.popen(argv[1:], cwd or os.getcwd(),
                                     os.environ if env is None else env,
                                     start_new_session=True, host=self.host(index), **kwargs)
        else:
            proc = subprocess.Popen(self.command(index, argv), start_new_session=True, cwd=cwd,
                                    env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, index, argv, timeout=60):
        if self._forks(argv, None):
            return run_forked(self.zygote, argv[1:], os.getcwd(), os.environ, timeout, self.host(index))
        return subprocess.run(self.command(index, argv), capture_output=True, text=True,
                              timeout=timeout)

    def host(self, index):
        """(network namespace, hostname) of host ``index``."""
        return self.namespaces[index], self.names[index]

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for ns in [self.switch, *self.namespaces]:
            _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        try:
            os.rmdir("/etc/netns")      # only when no other namespace keeps files there
        except OSError:
            pass
        if self._neighbours is not None:
            for i, value in zip((1, 2, 3), self._neighbours):
                with open(NEIGHBOURS.format(i), "w") as f:
                    f.write(str(value))
            self._neighbours = None

