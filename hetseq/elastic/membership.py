"""Elastic membership (--elastic): who trains in each generation of the job.
Nodes run the same command and are given ranks here, over the network:
every member serves a store of its own, and when a generation ends the
members meet at the first previous member that answers. The rules are
generations.py's, a round as its leader runs it rounds.py's. docs/elastic.md,
"How it works" (meeting points, the keys of a round), tells the story.
"""

import concurrent.futures
import json
import logging
import os
import socket
import time
import uuid

from hetseq.distributed import identity, interfaces, meeting_point, network
from hetseq.distributed.topology import node_name
from hetseq.elastic import rounds
from hetseq.elastic.generations import Generation
from hetseq.elastic.rounds import (POLL_S, SETTLE_S, FollowRound, LeadRound, Moved, NoRound,
                                   describe)
from hetseq.base.errors import UserError
from hetseq.base.logs import NODE
from hetseq.store import channel

logger = logging.getLogger(__name__)

PROBE_THREADS = 16
ANSWERS, REFUSED, SILENT = "answers", "refused", "silent"   # a previous member, probed


class TooFew(Exception):
    """The round closed below --min-nodes or without a quorum: the job saves and stops."""


class JobDone(Exception):
    """The job finished while this node waited to join."""


class Membership:
    """This node's side of the elastic job: its own meeting point, the
    members it knows, and the rounds it takes part in."""

    def __init__(self, launch, backend, secret, min_nodes, max_nodes, job_identity=None,
                 ranks=1):
        url = launch.distributed_init_method
        self.ranks = ranks        # this node's processes (--distributed-gpus)
        self.url, self.secret, self.timeout_s = url, secret, launch.distributed_timeout
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        host, self.port = meeting_point.url_host_port(url)
        self.binding = network.choose(host, launch.distributed_interface, backend)
        # The URL names this host (which Debian maps to 127.0.1.1): the others
        # reach it at its primary address, and so must this node's store.
        self.names_this_host = interfaces.names_this_host(host)
        if self.names_this_host and interfaces.is_loopback(self.binding.address) and \
                not launch.distributed_interface:
            self.binding = network.at(interfaces.primary_address(),
                                      f"this host's primary address ({host} names this host)")
        self.id = uuid.uuid4().hex
        self.store, self.store_port = meeting_point.serve_meeting_point(
            url, self.binding.address, self.port, secret, self.timeout_s)
        self._clients = {}
        self.generation, self.known = None, []
        # Members of this generation that this node's heartbeats found lost:
        # the next meeting neither probes them nor waits for them.
        self.lost = set()
        # Previous members whose ports refused this node's last look for the
        # leader (their processes are gone): a round this node leads does not
        # wait SETTLE_S for them. A member slow to answer is still waited for.
        self.unreachable = set()
        # Every member's store holds the job's identity (JobConfig.identity()),
        # so that a node with other flags or code is refused wherever it connects.
        self.identity, self.who = job_identity, f"{socket.gethostname()} pid {os.getpid()}"
        if job_identity is not None:
            identity.present(self.store, job_identity, 0, url, self.who, time.monotonic())
        logger.debug("node %s serves a meeting point at %s:%d", socket.gethostname(),
                     self.binding.address, self.store_port)

    # ---- stores ----

    def _address(self):
        return (self.binding.address, self.store_port)

    def _connect(self, address, entry=False):
        """A client of the store at ``address``. A member's store that cannot
        be reached now is a reason to look again (NoRound); the URL's
        (``entry``) that refuses this node is the user's to fix (UserError)."""
        address = tuple(address)
        if address == self._address():
            return self.store
        if address not in self._clients:
            try:
                self._clients[address] = meeting_point.join_meeting_point(
                    address, self.secret, self.timeout_s)
            except UserError as err:
                if entry:
                    raise
                raise NoRound(str(err)) from None
        return self._clients[address]

    def _answers(self, member):
        """ANSWERS when ``member``'s store answers the handshake; REFUSED when
        nothing listens at its port (its process is gone); else SILENT (it
        may be slow: a loaded host, a paused process, a cut link)."""
        address = (member["addr"], member["port"])
        if address == self._address():
            return ANSWERS
        try:
            channel.check(address, self.secret, f"tcp://{address[0]}:{address[1]}")
            return ANSWERS
        except ConnectionRefusedError:
            return REFUSED
        except (UserError, OSError):
            return SILENT

    def _probe(self, members):
        """Each member's answer (``_answers``), in the order given (asked at
        once: a paused or cut-off member costs one GREETING_S)."""
        if not members:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(PROBE_THREADS, len(members))) as pool:
            return list(pool.map(self._answers, members))

    def _walk(self, members):
        """(the members probed, their answers): in rank order until the
        first that answers, in batches of 1, 2, 4, ... (a dead member ahead
        costs little: its port refuses). Only when that first one is this
        node, which then leads the round, are all the others probed too:
        it alone must know who refused and whether the job went on
        elsewhere. A member that meets elsewhere asks only that first one
        (``_newer``): a meeting costs the job's stores N handshakes, not N
        x N (docs/elastic.md, "How it works")."""
        answers, size = [], 1
        while len(answers) < len(members) and ANSWERS not in answers:
            answers += self._probe(members[len(answers):len(answers) + size])
            size = min(2 * size, PROBE_THREADS)
        first = answers.index(ANSWERS) if ANSWERS in answers else None
        if first is not None and members[first]["id"] == self.id:
            answers += self._probe(members[len(answers):])
            return members, answers
        return members[:len(answers)], answers

    def _live(self, members):
        """``members`` whose stores answer the handshake, in the order given."""
        return [m for m, answer in zip(members, self._probe(members)) if answer == ANSWERS]

    def _leader_of(self, member):
        """{"addr", "port", "generation"}: where ``member`` says the job meets
        (None when its store cannot say)."""
        try:
            store = self._connect((member["addr"], member["port"]))
            return json.loads(store.get("e/leader")) if store.check(["e/leader"]) else None
        except (RuntimeError, OSError, NoRound, ValueError):
            self._clients.pop((member["addr"], member["port"]), None)
            return None

    def _newer(self, live):
        """The leader of the newest generation that a live member of
        ``live`` is in, when it is newer than this node's; else None."""
        own = 0 if self.generation is None else self.generation.number
        said = [self._leader_of(m) for m in live if m.get("id") != self.id and
                (m["addr"], m["port"]) != self._address()]
        newer = [s for s in said if s is not None and s["generation"] > own]
        return max(newer, key=lambda s: s["generation"]) if newer else None

    # ---- finding the leader ----

    def _leader_store(self, moved):
        """(store to meet at, whether this node arrives late). A member asks
        the previous members first: when the job went on without it, it
        joins the newer generation; otherwise it meets at the first live
        member (rank order). A newcomer goes where the URL's store points."""
        self.unreachable = set()
        if moved is not None:
            return self._connect((moved["addr"], moved["port"])), True
        if self.generation is None:
            # A node restarted from a checkpoint asks the members it names
            # first: the job may train on without the URL's host.
            running = self._newer(self._live(self.known))
            return (self._entry_store() if running is None else
                    self._connect((running["addr"], running["port"]))), True
        asked = [m for m in self.generation.members if m["id"] not in self.lost]
        asked, answers = self._walk(asked)
        live = [m for m, answer in zip(asked, answers) if answer == ANSWERS]
        self.unreachable = {m["id"] for m, answer in zip(asked, answers) if answer == REFUSED}
        newer = self._newer(live)
        if newer is not None:
            NODE.warning("the job went on without this node (generation %d at %s:%d); joining it",
                         newer["generation"], newer["addr"], newer["port"])
            return self._connect((newer["addr"], newer["port"])), True
        if not live:
            raise NoRound("no member of the job answers")
        if live[0]["id"] != self.id:
            logger.info("meeting at %s", describe(live[0]))
        return self._connect((live[0]["addr"], live[0]["port"])), False

    def _entry_store(self):
        """A newcomer's store: the URL's, or the leader it names (every member
        writes where the job meets into its own store)."""
        host, port = meeting_point.url_host_port(self.url)
        address = (self.binding.address if self.names_this_host else interfaces.resolve(host),
                   port)
        if address == self._address():
            return self.store
        network.wait_until_reachable(*address, self.timeout_s, lambda reason: (
            f"--elastic: could not reach the job at {self.url} within {self.timeout_s:.0f} s: "
            f"{reason}. Name a member's HOST:PORT; check the address and firewalls"))
        store = self._connect(address, entry=True)
        if store.check(["e/leader"]):
            leader = json.loads(store.get("e/leader"))
            return self._connect((leader["addr"], leader["port"]))
        return store

    # ---- a round ----

    def meet(self, updates, lineage=(), known=(), holder=0):
        """Take part in the next round; returns the new Generation.
        ``updates`` and ``lineage``: the state this node holds (-1: none),
        on its process ``holder``; ``known``: the members its checkpoint
        names ({"addr", "port"})."""
        self.known = [m for m in known if (m["addr"], m["port"]) != self._address()]
        me = {"id": self.id, "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
              "addr": self.binding.address, "port": self.store_port, "updates": updates,
              "lineage": list(lineage), "ranks": self.ranks, "holder": holder,
              "generation": None if self.generation is None else self.generation.number}
        self._deadline, moved = time.monotonic() + self._limit(), None
        while True:
            try:
                store, number, members = self._round(me, moved)
                moved = None
            except Moved as move:
                moved = move.leader
                continue
            except (RuntimeError, OSError, NoRound) as err:
                # The leader was lost or paused during the round, or nobody answers.
                logger.warning("no round closed at the meeting point (%s); looking again",
                               str(err).strip().splitlines()[0][:200])
                self._clients.clear()
                if time.monotonic() > self._deadline:
                    raise TooFew(f"no round of the job closed within {self._limit():.0f} s") \
                        from None
                time.sleep(POLL_S)
                continue
            if members.get("done"):
                raise JobDone(members["done"])
            if members.get("stop"):
                raise TooFew(members["stop"])
            if members.get("moved"):
                moved = members["moved"]
                continue
            if self.id in [m["id"] for m in members["members"]]:
                break
            # Missed (arrived late, or no place under --max-nodes): the next round.
            logger.info("round %d closed without this node; joining the next", number)
            moved = json.loads(store.get("e/leader")) if store.check(["e/leader"]) else None
        return self._enter(store, number, members)

    def _limit(self):
        """How long one meeting may take: a lost or stuck leader's round, then
        a round at the next member."""
        return 3 * self.timeout_s + 2 * SETTLE_S

    def _enter(self, store, number, published):
        """This node is a member of generation ``number``: record it."""
        members = tuple(published["members"])
        ids = [m["id"] for m in members]
        if self.id in published.get("refused", ()):
            NODE.warning("this node's state (%d updates) is not on the job's line (another "
                         "run, or the other side of a split): it takes the job's state instead",
                         members[ids.index(self.id)]["updates"])
        previous = self.generation
        self.generation = Generation(number, members, ids.index(self.id), store,
                                     published["source"], tuple(published["lineage"]))
        leader = members[0]
        self.store.set("e/leader", json.dumps({"addr": leader["addr"], "port": leader["port"],
                                               "generation": number}))
        self._log_change(previous)
        return self.generation

    def _round(self, me, moved):
        """(store, round number, what the leader published) of one attempt."""
        store, late = self._leader_store(moved)
        leads = store is self.store
        placed = None if leads else rounds.placed(store, self.id, self.generation)
        if placed is not None:
            return (store, *placed)
        if not leads and self.identity is not None:
            identity.present(store, self.identity, "this node", self.url, self.who,
                             self._deadline)
        if not leads and late:
            if rounds.full(store, self.max_nodes):
                self._wait_for_place(store)
                self._deadline = time.monotonic() + self._limit()
            else:
                # Tell rank 0, before arriving: its round then clears the flag
                # only once this arrival is visible to it.
                store.set("e/join", "1")
        number = rounds.next_number(store, self.generation)
        # Where this node meets, in its own store: a node that took it for the
        # leader (it saw the real leader as lost for a moment) follows there.
        at = f"e/{number}/at"
        if leads:
            self.store.delete_key(at)
        else:
            self.store.set(at, json.dumps(self._where(store)))
        index = store.add(f"e/{number}/n", 1)
        store.set(f"e/{number}/who/{index}", json.dumps(me))
        members = LeadRound(self, store, number).close() if leads else \
            FollowRound(self, store, number).close()
        return store, number, members

    def _where(self, store):
        """{"addr", "port", "generation"} of the store this node meets at."""
        address = next(a for a, client in self._clients.items() if client is store)
        return {"addr": address[0], "port": address[1],
                "generation": 0 if self.generation is None else self.generation.number}

    def _wait_for_place(self, store):
        """--max-nodes: the job is full. Wait at the leader's store, without
        asking for a meeting, until the next round opens there (a member
        lost, or leaving), then arrive in it."""
        NODE.info("the job has --max-nodes %d members; this node waits for a place",
                  self.max_nodes)
        # Registered while it waits: a round whose leader does not wait for
        # stragglers (the others are all there) waits for it, and empties
        # the slot once it closed (rounds.py). Emptied here (not deleted: a
        # get never waits on it) only when this node stops waiting otherwise.
        slot = f"e/waiting/{store.add('e/waiting/n', 1)}"
        store.set(slot, self.id)
        try:
            while True:
                if store.check(["e/done"]):
                    store.set(slot, "")
                    raise JobDone(store.get("e/done").decode())
                if store.add(f"e/{rounds.next_number(store, self.generation)}/n", 0) > 0:
                    return
                time.sleep(0.2)
        except (RuntimeError, OSError):     # the leader was lost: look for the job again
            self._clients.clear()

    def _log_change(self, previous):
        now = self.generation
        before = {} if previous is None else {m["id"]: m for m in previous.members}
        after = {m["id"]: m for m in now.members}
        left = [describe(m) for i, m in before.items() if i not in after]
        joined = [describe(m) for i, m in after.items() if i not in before]
        # Every node's log says who left and joined (NODE: each node's own lines).
        log = NODE.info if previous is None else logger.warning
        first = now.first_rank()
        ranks = f" (ranks {first}-{first + self.ranks - 1} of {now.world_size})" \
            if self.ranks > 1 else ""
        log("generation %d: %d nodes, this node is rank %d%s; left: %s; joined: %s",
            now.number, len(now.members), first, ranks, ", ".join(left) or "none",
            ", ".join(joined) or "none")

    def mark_lost(self, ranks):
        """Ranks of this generation that the heartbeats found lost: their
        members (a node's ranks are lost together). Never this node: one of
        its processes may find another one silent (starved of CPU), but a
        process of its own that ended is known for sure (elastic/agent.py)."""
        gen = self.generation
        self.lost = {gen.members[gen.member_of(r)]["id"] for r in ranks} - {self.id}
