"""Which address each rank's collectives bind to, and a check that peers reach it.

gloo (and nccl's socket bootstrap) bind to whatever the hostname resolves
to, often an address the other hosts cannot reach, and the job then hangs.
So each rank picks the interface that routes to the master (``choose``),
corrects that guess from the addresses the ranks registered (``reconcile``),
checks before the backend connects that every peer reaches it
(``check_reachability``), and sets the backend's variable (``apply``).
docs/nodes.md, "The manual way: one command per node" (network interface).
"""

import concurrent.futures
import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time

from hetseq.distributed import interfaces
from hetseq.base.errors import UserError
from hetseq.base.logs import NODE, Every

logger = logging.getLogger(__name__)

IFNAME_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
PROBE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Binding:
    address: str
    interface: str | None   # None: no interface holds it (left to the backend)
    reason: str             # why this address, for the start-up log
    source: str = "auto"    # "auto", "flag" or the variable the user set


def _variable(backend):
    return IFNAME_VARIABLE.get(backend, "GLOO_SOCKET_IFNAME")


def choose(master_host, flag, backend, env=os.environ):
    """This rank's first choice, before it knows the peers."""
    variable = _variable(backend)
    name, source = (flag, "flag") if flag else (env.get(variable, "").split(",")[0], variable)
    if name:
        what = "--distributed-interface" if source == "flag" else variable
        address = interfaces.address_of(name)
        if address is None:
            known = sorted({iface for iface, *_ in interfaces.list_addresses()})
            raise UserError(f"{what} {name}: this host has no interface of that name with an "
                            f"address (interfaces here: {', '.join(known) or 'none found'}); "
                            "name one that the other hosts can reach")
        return Binding(address, name, f"set by {what}", source)
    if master_host:
        try:
            target = interfaces.resolve(master_host)
            shown = master_host if target == master_host else f"{master_host} ({target})"
            return _route_to(target, f"routes to the master {shown}")
        except OSError:
            pass   # opening the store already named an unreachable master
    return at(interfaces.primary_address(), "this host's primary address (no master address)")


def at(address, reason):
    return Binding(address, interfaces.interface_of(address), reason)


def _route_to(target, reason):
    return at(interfaces.route_source(target), reason)


def reconcile(binding, rank, peers, master_known):
    """The final choice, given every rank's registered first choice."""
    if binding.source != "auto":
        return binding
    first = peers[0]["addr"]
    if not master_known and rank != 0 and not interfaces.is_loopback(first):
        return _route_to(first, f"routes to rank 0's address {first}")
    remote = [info["addr"] for _, info in sorted(peers.items())
              if not interfaces.is_loopback(info["addr"])]
    if not interfaces.is_loopback(binding.address) or not remote:
        return binding
    why = "the master's name resolves to loopback on this host"
    for address in remote:
        try:
            return _route_to(address, f"{why}; routes to the peer address {address}")
        except OSError:     # no route from here: the reachability check will say so
            continue
    return at(interfaces.primary_address(), f"{why} and no peer address routes from here; "
                                             "this host's primary address")


def apply(binding, backend, env=os.environ):
    """Hand the interface to the backend (gloo and nccl read these variables
    when the process group is created). A variable the user set is kept."""
    if binding.interface is None or binding.source not in ("auto", "flag"):
        return
    names = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if backend == "nccl" else [])
    for name in names:
        if binding.source == "flag" or name not in env:
            env[name] = binding.interface


class _Listener:
    """Answers every connection with this rank's number, so a peer knows it
    reached this process and not whatever else listens there."""

    def __init__(self, address, rank):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((address, 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self._answer = struct.pack("!I", rank)
        threading.Thread(target=self._serve, name="hetseq-reach", daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:          # closed
                return
            with conn:
                try:
                    conn.sendall(self._answer)
                except OSError:
                    pass

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _reach(address, port, rank, timeout):
    """None when rank ``rank`` answers at address:port, else why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            answer = b""
            while len(answer) < 4:
                chunk = conn.recv(4 - len(answer))
                if not chunk:
                    break
                answer += chunk
    except socket.timeout:
        return f"no answer within {timeout:.0f} s"
    except OSError as err:
        return err.strerror or str(err)
    if len(answer) < 4 or struct.unpack("!I", answer)[0] != rank:
        return "another process answered there"
    return None


def check_reachability(store, rank, world_size, binding, peers, wait):
    """Every rank checks that it reaches every other address; returns ``peers``
    with the final addresses, or raises one UserError on every rank."""
    listener = _Listener(binding.address, rank)
    try:
        store.set(f"hetseq/net/{rank}", json.dumps(
            {"addr": binding.address, "port": listener.port, "iface": binding.interface}))
        nets = wait("hetseq/net")
        targets = {}
        for other, net in sorted(nets.items()):
            if net["addr"] != binding.address:
                targets.setdefault(net["addr"], (other, net["port"]))
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets) or 1)) as pool:
            why = dict(zip(targets, pool.map(
                lambda item: _reach(item[0], item[1][1], item[1][0], PROBE_TIMEOUT_S),
                targets.items())))
        failed = [[rank, targets[addr][0], addr, targets[addr][1], reason]
                  for addr, reason in why.items() if reason]
        store.set(f"hetseq/net-failed/{rank}", json.dumps(failed))
        failures = [row for rows in wait("hetseq/net-failed").values() for row in rows]
    finally:
        listener.close()
    final = {r: {**info, "addr": nets[r]["addr"], "iface": nets[r]["iface"]}
             for r, info in peers.items()}
    if failures:
        raise UserError(_unreachable_message(failures, final))
    return final


def _who(rank, peers):
    info = peers.get(rank, {})
    return f"rank {rank} ({info.get('host', '?')}, {info.get('addr', '?')})"


def _unreachable_message(failures, peers):
    lines = [f"{_who(src, peers)} cannot reach rank {dst} at {addr}:{port} "
             f"(host {peers[dst]['host']}, interface {peers[dst]['iface']}): {reason}"
             for src, dst, addr, port, reason in failures[:8]]
    more = f" (and {len(failures) - 8} more)" if len(failures) > 8 else ""
    return ("ranks cannot reach each other's addresses: " + "; ".join(lines) + more +
            ". The collectives connect to the address each rank binds to, so every host must "
            "reach every other host's address: on the host named, pass --distributed-interface "
            "NAME (or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) with an interface the others "
            "can reach, and let TCP through any firewall between the hosts")


def describe(peers):
    """One line: which ranks bind to which address, host by host."""
    groups = {}
    for rank, info in sorted(peers.items()):
        key = (info["host"], info["addr"], info.get("iface"))
        groups.setdefault(key, []).append(rank)
    return "; ".join(f"{host} {addr} ({iface or 'no interface'}): "
                     f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranges(ranks)}"
                     for (host, addr, iface), ranks in groups.items())


def _ranges(ranks):
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def wait_until_reachable(host, port, timeout_s, describe_failure):
    """Connect to host:port ourselves until it accepts, before a TCPStore client
    tries: its own retries are silent and end in a C++ stack dump. The reason a
    connection fails (other than 'refused': the master is not up yet) is logged
    once, so a wrong or unreachable address shows at once, not at the deadline."""
    deadline, said, reminder = time.monotonic() + timeout_s, None, Every()
    while True:
        remaining = deadline - time.monotonic()
        attempt = max(0.2, min(5.0, remaining))
        try:
            with socket.create_connection((host, port), timeout=attempt):
                return
        except socket.gaierror as err:
            reason = f"the name does not resolve ({err.strerror})"
        except socket.timeout:
            # A wait cut short by the deadline says less than the last reason.
            reason = said if said and attempt < 5.0 else \
                "no answer (packets dropped: host down or a firewall)"
        except OSError as err:
            reason = err.strerror or str(err)
        if time.monotonic() >= deadline:
            raise UserError(describe_failure(reason))
        if reason != said and not reason.startswith("Connection refused"):
            logger.warning("cannot reach %s:%d yet: %s; retrying for up to %.0f s",
                           host, port, reason, remaining)
            said = reason
        if reminder.due():
            NODE.info("waiting for the master at %s:%d (%s): %.0f s left before "
                      "--distributed-timeout", host, port, reason, remaining)
        time.sleep(min(0.5, max(0.0, remaining)))
