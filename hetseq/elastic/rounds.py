"""A round of an elastic job, as its leader runs it (LeadRound) and as the
others wait for it (FollowRound); what a store says of its rounds
(placed, full, next_number). The leader waits for a quorum, then lets the
arrivals settle; it gives the round up when the job is elsewhere and stops
it without a quorum. membership.py finds the leader and arrives.
docs/elastic.md, "How it works" and "One job, always".
"""

import json
import logging
import re
import time

from hetseq.elastic import generations
from hetseq.base.logs import NODE
from hetseq.store.channel import GREETING_S

logger = logging.getLogger("hetseq.elastic.membership")

SETTLE_S = 3.0     # a round with enough members closes when nobody new came for this long
# ... or for this long while a member it expects has not come: a survivor
# slow to leave its failed group (a loaded machine: 16 nodes on 2 cores
# came 3 s after the others) would come back as a newcomer, a generation more.
EXPECTED_SETTLE_S = 10.0
POLL_S = 0.05
PROBE_EVERY_S = 2.0   # a waiting leader asks the previous members again this often
MAX_WAITING = 64      # nodes waiting for a place that a round looks for
NODE_ID = re.compile(rb"[0-9a-f]{32}")     # Membership.id: uuid4().hex


class NoRound(Exception):
    """No round could be held where this node looked (a leader lost or
    paused, nobody answering): look again until the meeting's deadline."""


class Moved(Exception):
    """The job is elsewhere (a newer generation, or this round held by a
    lower-ranked member): meet at ``leader``, arriving late."""

    def __init__(self, leader):
        super().__init__(f"the job went on at {leader['addr']}:{leader['port']}")
        self.leader = leader


def describe(member):
    return f"{member['host']} ({member['addr']}, pid {member['pid']})"


class LeadRound:
    """Round ``number`` led by ``membership`` (a Membership) at ``store``, its own."""

    def __init__(self, membership, store, number):
        self.m, self.store, self.number = membership, store, number
        self._read = {}       # arrival slot -> what was written there (each read once)

    def close(self):
        """Wait for a quorum and the members, then write them; what was published."""
        previous = self.m.generation
        # Every previous member, except those this node's heartbeats found
        # lost and those whose ports refused it just now (gone), and the
        # nodes waiting for a place (--max-nodes) as the round opens.
        waiting = self._waiting()
        expected = (set() if previous is None else
                    set(previous.ids) - self.m.lost - self.m.unreachable) | set(waiting.values())
        deadline = time.monotonic() + self.m.timeout_s
        seen, changed, probed = 0, time.monotonic(), time.monotonic()
        while True:
            arrived = self._arrivals()
            if len(arrived) != seen:
                seen, changed = len(arrived), time.monotonic()
            ids = {m["id"] for m in arrived}
            enough = len(arrived) >= self.m.min_nodes and generations.has_quorum(previous, ids)
            settle = EXPECTED_SETTLE_S if expected - ids else SETTLE_S
            if enough and ((self.m.max_nodes and len(arrived) >= self.m.max_nodes) or
                           (expected and expected <= ids) or
                           time.monotonic() - changed >= settle):
                break
            if time.monotonic() > deadline:
                if enough:      # the last arrival had no time to settle: close with whoever came
                    break
                return self._stop(arrived)
            if previous is not None and time.monotonic() - probed >= PROBE_EVERY_S:
                self._give_up_if_elsewhere(previous)
                probed = time.monotonic()
            time.sleep(POLL_S)
        if self.store.check(["e/join"]):
            self.store.delete_key("e/join")
        outcome = self._publish(self._decide(self._arrivals()))
        # Slots read are spent: a node still waiting (cut by --max-nodes)
        # registers again, and one that died waiting delays one round only.
        for key in waiting:
            self.store.set(key, "")
        return outcome

    def _waiting(self):
        """{slot key: node id} of the nodes waiting for a place
        (membership._wait_for_place), the latest MAX_WAITING registrations;
        a value that is not a node id (emptied, or garbage) is left out."""
        count = self.store.add("e/waiting/n", 0)
        keys = [f"e/waiting/{i}" for i in range(max(1, count - MAX_WAITING + 1), count + 1)]
        keys = [key for key in keys if self.store.check([key])]   # set just after its slot
        values = [bytes(v) for v in (self.store.multi_get(keys) if keys else [])]
        return {key: value.decode() for key, value in zip(keys, values)
                if NODE_ID.fullmatch(value)}

    def _give_up_if_elsewhere(self, previous):
        """The job is elsewhere: a previous member is in a newer generation
        (the job went on without this round), or a lower-ranked previous
        member holds a round of this same number (two leaders, each seeing
        the other as lost for a moment: without this, neither round might
        reach its quorum). Everyone in this round follows to that leader,
        so the rounds of one generation end up at the lowest-ranked one."""
        live = self.m._live([m for m in previous.members
                             if m["id"] != self.m.id and m["id"] not in self.m.lost])
        newer = self.m._newer(live)
        target = newer or self._lower_round(live, previous)
        if target is None:
            return
        self._publish({"moved": target})
        if newer is not None:
            NODE.warning("the job went on without this node (generation %d at %s:%d); joining "
                         "it", newer["generation"], newer["addr"], newer["port"])
        else:
            logger.warning("round %d is also held at %s:%d, a lower-ranked member: meeting "
                           "there", self.number, target["addr"], target["port"])
        raise Moved(target)

    def _lower_round(self, live, previous):
        """The meeting point of a round ``number`` held by a live previous
        member ranked before this node, or None."""
        ids = previous.ids
        mine = ids.index(self.m.id) if self.m.id in ids else len(ids)
        for member in live:
            if member["id"] not in ids or ids.index(member["id"]) >= mine:
                continue
            try:
                other = self.m._connect((member["addr"], member["port"]))
                if other.add(f"e/{self.number}/n", 0) > 0:
                    return {"addr": member["addr"], "port": member["port"],
                            "generation": previous.number}
            except (RuntimeError, OSError, NoRound):
                self.m._clients.pop((member["addr"], member["port"]), None)
        return None

    def _decide(self, arrived):
        """The round's outcome: members in rank order (the first --max-nodes:
        the others wait for a place), the source state and the new lineage."""
        previous = self.m.generation
        keep = generations.ordered(arrived, self.m.id, previous, self.m.max_nodes)
        source, refused = generations.choose_source(
            keep, None if previous is None else previous.lineage)
        for member in keep:
            if member["id"] in refused:
                logger.warning("refused the state of %s as the source: it is not on the job's "
                               "line", describe(member))
        return {"members": keep, "source": source, "refused": refused,
                "lineage": generations.new_lineage(keep[source]["lineage"], self.number)}

    def _stop(self, arrived):
        """Too few, or no quorum (only after a previous generation: a first
        one needs none): say so, and keep serving the store until every
        node that arrived has read it (or it would look for a new meeting
        point)."""
        ids = {m["id"] for m in arrived}
        if len(arrived) < self.m.min_nodes:
            why = f"only {len(arrived)} of --min-nodes {self.m.min_nodes} nodes"
        else:
            why = f"no quorum: {generations.quorum_text(self.m.generation, ids)}"
        stop = self._publish({"stop": (
            f"{why} within --distributed-timeout {self.m.timeout_s:.0f} s")})
        deadline = time.monotonic() + self.m.timeout_s
        while self.store.add(f"e/{self.number}/read", 0) < len(arrived) - 1 and \
                time.monotonic() < deadline:
            time.sleep(POLL_S)
        return stop

    def _arrivals(self):
        """Who arrived so far. Polled every POLL_S: each slot is read once
        (a slot is written once, just after its number was taken), so a round
        of N arrivals reads N slots, not N per poll."""
        store, number = self.store, self.number
        count = store.add(f"e/{number}/n", 0)
        for i in range(1, count + 1):
            key = f"e/{number}/who/{i}"
            if i not in self._read and store.check([key]):
                member = json.loads(store.get(key))
                self._read[i] = member
                if not generations.well_formed(member):
                    logger.warning("left out %s: it claims %r ranks (holder %r); expected 1 to "
                                   "%d", describe(member), member.get("ranks"),
                                   member.get("holder"), generations.MAX_RANKS)
        arrived = [self._read[i] for i in sorted(self._read)]
        # One entry per node: one that arrived again in a retried round
        # counts once (its latest word, at its first place), so that no
        # member is placed twice nor counted twice for a quorum.
        unique = {}
        for member in arrived:
            if generations.well_formed(member):
                unique[member["id"]] = member
        return list(unique.values())

    def _publish(self, outcome):
        return publish(self.store, self.number, outcome)


def publish(store, number, outcome):
    """Write a round's outcome (members, stop or moved) into the leader's store.
    A generation's heartbeat verdicts start empty: a member's key written
    ahead of time (it holds the secret) does not end the generation."""
    if "members" in outcome:
        for key in (f"e/{number}/ended", f"e/{number}/lost"):
            store.delete_key(key)
    store.set(f"e/{number}/members", json.dumps(outcome))
    if "members" in outcome:
        store.set("e/gen", str(number))
    return outcome


class FollowRound:
    """Round ``number`` at ``store``, another member's, as ``membership`` (a
    Membership) waits for what its leader publishes."""

    def __init__(self, membership, store, number):
        self.m, self.store, self.number = membership, store, number

    def close(self):
        """What the leader published for the round. A leader that
        publishes nothing for longer than its own wait (--distributed-timeout)
        plus its probes is stuck: look again while the meeting has time."""
        store, number = self.store, self.number
        key = f"e/{number}/members"
        waited = self.m.timeout_s + EXPECTED_SETTLE_S + 2 * GREETING_S
        deadline = min(self.m._deadline, time.monotonic() + waited)
        while not store.check([key]):
            if store.check(["e/done"]):
                return {"done": store.get("e/done").decode()}
            if store.check([f"e/{number}/at"]):      # not the leader: it meets elsewhere
                return {"moved": json.loads(store.get(f"e/{number}/at"))}
            went = self.went_on()
            if went is not None:                      # it joined a generation elsewhere
                return {"moved": went}
            if time.monotonic() > deadline:
                raise NoRound(f"round {number} at the meeting point did not close within "
                              f"{waited:.0f} s")
            time.sleep(POLL_S)
        members = json.loads(store.get(key))
        if members.get("stop"):
            store.add(f"e/{number}/read", 1)
        return members

    def went_on(self):
        """Where the node of the store trains now, when it joined a generation
        of at least this round's at another leader: a node that took it for
        the leader (it was first in the walk, paused and then woken, and it
        found the job elsewhere) follows instead of waiting out the round."""
        if not self.store.check(["e/leader"]):
            return None
        try:
            leader = json.loads(self.store.get("e/leader"))
            here = self.m._where(self.store)
            elsewhere = (leader["addr"], leader["port"]) != (here["addr"], here["port"])
            return leader if elsewhere and leader["generation"] >= self.number else None
        except (ValueError, KeyError, TypeError, StopIteration):
            return None


def placed(store, node_id, generation):
    """(number, outcome) of the newest generation at ``store`` when it
    placed the node ``node_id`` (in ``generation`` now): it arrived in that
    round but lost its connection before reading the outcome, and the new
    process group waits for it.
    Arriving late instead would leave the group a rank short until
    --distributed-timeout. None otherwise."""
    try:
        if not store.check(["e/gen"]):
            return None
        number = int(store.get("e/gen"))
        if number <= (0 if generation is None else generation.number):
            return None
        outcome = json.loads(store.get(f"e/{number}/members"))   # written before e/gen
        if node_id not in [m.get("id") for m in outcome.get("members", ())]:
            return None
    except (ValueError, AttributeError, TypeError):     # not what a leader writes
        return None
    logger.info("round %d placed this node before its connection was lost: entering it",
                number)
    return number, outcome


def full(store, max_nodes):
    """Whether the job at ``store`` has --max-nodes members already (a
    newcomer then waits for a place instead of asking for a meeting)."""
    if not max_nodes or not store.check(["e/gen"]):
        return False
    key = f"e/{int(store.get('e/gen'))}/members"
    if not store.check([key]):
        return False
    return len(json.loads(store.get(key)).get("members", ())) >= max_nodes


def next_number(store, generation):
    """The round to take part in: one after the leader's last closed one
    (and after this node's own, which a new leader may not have seen)."""
    last = int(store.get("e/gen")) if store.check(["e/gen"]) else 0
    own = generation.number if generation is not None else 0
    return max(last, own) + 1
