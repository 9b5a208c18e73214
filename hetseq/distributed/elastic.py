"""Elastic membership (--elastic): who trains in each generation of the job.

Nodes run the same command and are given ranks here. The job lives in
*generations*: a generation is a fixed set of members with one process
group; a member lost, or a node asking to join, ends it at an update
boundary and the members meet again for the next one.

Meeting points. Every member serves a store of its own (behind the job
secret's gate, tunnel.py) on its job address, at the URL's port when that is
free there (so ``tcp://ANY_MEMBER:PORT`` finds the job), else at a port the
OS picks. The member whose store the others meet at is the *leader*, and the
leader is always rank 0. The first leader is the node that serves the URL's
own address. When a generation ends, every member walks the previous
members in rank order and meets at the first whose store answers the
secret's handshake: the lowest-ranked survivor. So losing rank 0's host,
the meeting point, costs one probe, not the job.

One round (generation g, keys ``e/<g>/...`` in the leader's store):
every participant ``add``s itself to ``e/<g>/n`` and writes what it brings
(``e/<g>/who/<i>``: its id, addresses, and how many updates its state
holds). The leader closes the round when all previous members are there,
when ``--max-nodes`` arrived, or, with at least ``--min-nodes``, when nobody
new arrived for ``SETTLE_S`` (the lost never arrive); it writes the members
in rank order (itself first, then the survivors in their old order, then
newcomers) to ``e/<g>/members``. A node that misses a round joins the next
one (``e/join`` tells rank 0, which tells every rank in the update's stats).

What it cannot survive: members that disagree on who is alive (a network
split into halves that each reach some members) may form two jobs, each
continuing from its own state; and a round's leader lost while it closes
the round costs the others one timeout. Nothing here decides by majority.
"""

import dataclasses
import datetime
import json
import logging
import os
import socket
import time
import uuid

import torch.distributed as dist

from hetseq.distributed import identity, interfaces, network, rendezvous, tunnel
from hetseq.errors import UserError
from hetseq.logging import NODE

logger = logging.getLogger(__name__)

SETTLE_S = 3.0     # a round with enough members closes when nobody new came for this long
POLL_S = 0.05


class TooFew(Exception):
    """The round closed below --min-nodes: the job saves and stops."""


class JobDone(Exception):
    """The job finished while this node waited to join."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation: its number, the members in rank order (their JSON
    infos), this node's rank, and the store it met at (the leader's)."""
    number: int
    members: tuple
    rank: int
    store: object

    @property
    def world_size(self):
        return len(self.members)

    def source(self):
        """The rank whose state every member takes: the most updates done
        (each completed update is exact, so any holder of the newest one
        will do), the lowest rank among equals."""
        return max(range(self.world_size), key=lambda r: (self.members[r]["updates"], -r))


def describe(member):
    return f"{member['host']} ({member['addr']}, pid {member['pid']})"


class Membership:
    """This node's side of the elastic job: its own meeting point, the
    members it knows, and the rounds it takes part in."""

    def __init__(self, launch, backend, secret, min_nodes, max_nodes, job_identity=None):
        url = launch.distributed_init_method
        self.url, self.secret, self.timeout_s = url, secret, launch.distributed_timeout
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        host, self.port = rendezvous.url_host_port(url)
        self.binding = network.choose(host, launch.distributed_interface, backend)
        # The URL names this host (which Debian maps to 127.0.1.1): the others
        # reach it at its primary address, and so must this node's store.
        self.names_this_host = host.lower() in {socket.gethostname().lower(),
                                                socket.getfqdn().lower()}
        if self.names_this_host and interfaces.is_loopback(self.binding.address) and \
                not launch.distributed_interface:
            self.binding = network.at(interfaces.primary_address(),
                                      f"this host's primary address ({host} names this host)")
        self.id = uuid.uuid4().hex
        self.store, self.store_port = rendezvous.serve_meeting_point(
            url, self.binding.address, self.port, secret, self.timeout_s)
        self._clients = {}
        self.generation = None
        # Every member's store holds the job's identity (JobConfig.identity()),
        # so that a node with other flags or code is refused wherever it knocks.
        self.identity, self.who = job_identity, f"{socket.gethostname()} pid {os.getpid()}"
        if job_identity is not None:
            identity.present(self.store, job_identity, 0, url, self.who, time.monotonic())
        logger.debug("node %s serves a meeting point at %s:%d", socket.gethostname(),
                    self.binding.address, self.store_port)

    # ---- stores ----

    def _address(self):
        return (self.binding.address, self.store_port)

    def _connect(self, address):
        if address == self._address():
            return self.store
        if address not in self._clients:
            self._clients[address] = rendezvous.join_meeting_point(
                address, self.secret, self.timeout_s)
        return self._clients[address]

    def _alive(self, member):
        address = (member["addr"], member["port"])
        if address == self._address():
            return True
        try:
            tunnel.check(address, self.secret, f"tcp://{address[0]}:{address[1]}")
            return True
        except (UserError, OSError):
            return False

    # ---- finding the leader ----

    def _leader_store(self):
        """The store to meet at: the first live member of the last generation
        (rank order), or for a newcomer where the URL's store points."""
        if self.generation is None:
            return self._entry_store()
        for member in self.generation.members:
            if self._alive(member):
                if member["id"] != self.id:
                    logger.info("meeting at %s", describe(member))
                return self._connect((member["addr"], member["port"]))
        raise UserError("no member of the job answers")  # this node is one of them: unreachable

    def _entry_store(self):
        """A newcomer's store: the URL's, or the leader it names (every member
        writes where the job meets into its own store)."""
        host, port = rendezvous.url_host_port(self.url)
        address = (self.binding.address if self.names_this_host else interfaces.resolve(host),
                   port)
        if address == self._address():
            return self.store
        network.wait_until_reachable(*address, self.timeout_s, lambda reason: (
            f"--elastic: could not reach the job at {self.url} within {self.timeout_s:.0f} s: "
            f"{reason}. Name a member's HOST:PORT; check the address and firewalls"))
        store = self._connect(address)
        if store.check(["e/leader"]):
            leader = json.loads(store.get("e/leader"))
            return self._connect((leader["addr"], leader["port"]))
        return store

    # ---- a round ----

    def meet(self, updates):
        """Take part in the next round; returns the new Generation.
        ``updates``: how many updates the state this node holds has done."""
        me = {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(),
              "addr": self.binding.address, "port": self.store_port, "updates": updates,
              "rank": None if self.generation is None else self.generation.rank}
        deadline = time.monotonic() + 2 * self.timeout_s + SETTLE_S
        missed = False
        while True:
            try:
                store, number, members = self._round(me, missed, deadline)
            except (RuntimeError, OSError) as err:   # the leader was lost during the round
                logger.warning("lost the meeting point during a round (%s); looking for the "
                               "next member", str(err).strip().splitlines()[0][:200])
                self._clients.clear()
                if time.monotonic() > deadline:
                    raise UserError(f"--elastic: no round closed within "
                                    f"{2 * self.timeout_s + SETTLE_S:.0f} s") from None
                continue
            if members.get("done"):
                raise JobDone(members["done"])
            if members.get("stop"):
                raise TooFew(members["stop"])
            ids = [m["id"] for m in members["members"]]
            if self.id in ids:
                break
            logger.info("round %d closed without this node; joining the next", number)
            missed = True
        previous = self.generation
        self.generation = Generation(number, tuple(members["members"]), ids.index(self.id), store)
        leader = members["members"][0]
        self.store.set("e/leader", json.dumps({"addr": leader["addr"], "port": leader["port"]}))
        self._log_change(previous)
        return self.generation

    def _round(self, me, missed, deadline):
        """(store, round number, what the leader published) of one attempt."""
        store = self._leader_store()
        number = self._next_number(store)
        leads = store is self.store
        if not leads and self.identity is not None:
            identity.present(store, self.identity, "this node", self.url, self.who, deadline)
        if not leads and (self.generation is None or missed):
            # Tell rank 0, before arriving: its round then clears the flag
            # only once this arrival is visible to it.
            store.set("e/join", "1")
        index = store.add(f"e/{number}/n", 1)
        store.set(f"e/{number}/who/{index}", json.dumps(me))
        members = self._close(store, number) if leads else \
            self._wait_members(store, number, deadline)
        return store, number, members

    def _next_number(self, store):
        """The round to take part in: one after the leader's last closed one
        (and after this node's own, which a new leader may not have seen)."""
        last = int(store.get("e/gen")) if store.check(["e/gen"]) else 0
        own = self.generation.number if self.generation is not None else 0
        return max(last, own) + 1

    def _close(self, store, number):
        """The leader's side: wait for the members, then write them."""
        expected = set() if self.generation is None else \
            {m["id"] for m in self.generation.members}
        deadline = time.monotonic() + self.timeout_s
        seen, changed = 0, time.monotonic()
        while True:
            arrived = self._arrivals(store, number)
            if len(arrived) != seen:
                seen, changed = len(arrived), time.monotonic()
            ids = {m["id"] for m in arrived}
            enough = len(arrived) >= self.min_nodes
            if (self.max_nodes and len(arrived) >= self.max_nodes) or \
                    (enough and expected and expected <= ids) or \
                    (enough and time.monotonic() - changed >= SETTLE_S):
                break
            if time.monotonic() > deadline:
                return self._stop(store, number, len(arrived))
            time.sleep(POLL_S)
        if store.check(["e/join"]):
            store.delete_key("e/join")
        arrived = self._arrivals(store, number)[:self.max_nodes or None]
        return self._publish(store, number, {"members": self._ordered(arrived)})

    def _stop(self, store, number, arrived):
        """Too few: say so, and keep serving the store until every node
        that arrived has read it (or it would look for a new meeting point)."""
        stop = self._publish(store, number, {"stop": (
            f"only {arrived} of --min-nodes {self.min_nodes} nodes within "
            f"--distributed-timeout {self.timeout_s:.0f} s")})
        deadline = time.monotonic() + self.timeout_s
        while store.add(f"e/{number}/read", 0) < arrived - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return stop

    def _ordered(self, arrived):
        lead = [m for m in arrived if m["id"] == self.id]
        old = sorted((m for m in arrived if m["rank"] is not None and m["id"] != self.id),
                     key=lambda m: m["rank"])
        new = [m for m in arrived if m["rank"] is None and m["id"] != self.id]
        return lead + old + new

    @staticmethod
    def _arrivals(store, number):
        count = store.add(f"e/{number}/n", 0)
        keys = [f"e/{number}/who/{i}" for i in range(1, count + 1)]
        return [json.loads(store.get(key)) for key in keys if store.check([key])]

    @staticmethod
    def _publish(store, number, members):
        store.set(f"e/{number}/members", json.dumps(members))
        store.set("e/gen", str(number))
        return members

    def _wait_members(self, store, number, deadline):
        key = f"e/{number}/members"
        while not store.check([key]):
            if store.check(["e/done"]):
                return {"done": store.get("e/done").decode()}
            if time.monotonic() > deadline:
                raise UserError(f"--elastic: round {number} at {self.url} did not close within "
                                f"{2 * self.timeout_s + SETTLE_S:.0f} s")
            time.sleep(POLL_S)
        members = json.loads(store.get(key))
        if members.get("stop"):
            store.add(f"e/{number}/read", 1)
        return members

    def _log_change(self, previous):
        now = self.generation
        before = {} if previous is None else {m["id"]: m for m in previous.members}
        after = {m["id"]: m for m in now.members}
        left = [describe(m) for i, m in before.items() if i not in after]
        joined = [describe(m) for i, m in after.items() if i not in before]
        # Every node's log says who left and joined (NODE: each node's own lines).
        log = NODE.info if previous is None else logger.warning
        log("generation %d: %d nodes, this node is rank %d; left: %s; joined: %s",
            now.number, now.world_size, now.rank, ", ".join(left) or "none",
            ", ".join(joined) or "none")

    def finish(self, updates):
        """The job is over: a node that still waits to join is told so."""
        if self.generation.rank == 0:
            self.store.set("e/done", f"the job finished after {updates} updates")

    def join_waiting(self):
        """Rank 0 only: whether a node asked to join (read once per update)."""
        return self.generation.rank == 0 and self.store.check(["e/join"])

    def process_group(self, backend):
        """Start this generation's process group (its own key prefix, so a
        round never reads an earlier round's keys)."""
        gen = self.generation
        network.apply(self.binding, backend)
        dist.init_process_group(backend, store=dist.PrefixStore(f"e/{gen.number}/pg", gen.store),
                                rank=gen.rank, world_size=gen.world_size,
                                timeout=datetime.timedelta(seconds=self.timeout_s))

