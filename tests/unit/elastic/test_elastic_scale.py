"""Elastic membership as the node count grows (#35 item 4).

Unit tests of the heartbeats' cost and messages (many watchdogs in one
process, on a HashStore), and a job of 16 namespace hosts: its first
generation, a host killed and one frozen far from rank 0 in the ring, and a
joiner. bench/elastic_scale.py measures the same at 8 to 64 nodes.
"""

import json
import socket
import threading
import time
import types

import torch

from hetseq.elastic.generations import Generation
from hetseq.elastic.watchdog import Watchdog


class Counting:
    """A store that counts the keys each call reads (the watchdogs' load on
    the leader's store)."""

    def __init__(self, store):
        self.store, self.read, self.beats = store, 0, 0
        self.lock = threading.Lock()

    def _count(self, keys):
        with self.lock:
            self.read += keys

    def set(self, key, value):
        self.beats += "/beat/" in key
        return self.store.set(key, value)

    def add(self, key, amount):
        self._count(1)
        return self.store.add(key, amount)

    def check(self, keys):
        self._count(len(keys))
        return self.store.check(keys)

    def get(self, key):
        self._count(1)
        return self.store.get(key)

    def multi_get(self, keys):
        self._count(len(keys))
        return self.store.multi_get(keys)


def watchdogs(size, timeout_s=2.0, stores=None):
    """``size`` ranks' watchdogs on one HashStore; every rank on an address
    of its own that this process has no connection to (cutting closes
    nothing)."""
    store = torch.distributed.HashStore()
    stores = stores or [Counting(store) for _ in range(size)]
    addresses = [f"10.255.{r // 250}.{r % 250 + 1}" for r in range(size)]
    return [Watchdog(stores[r], r, addresses, addresses[r], timeout_s) for r in range(size)], \
        stores


def until(condition, limit):
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def test_only_rank_0_reads_every_heartbeat():
    """The leader's store serves each rank a constant number of keys a beat:
    its work grows linearly with the ranks, not with their square (every
    rank reading every beat was 16 x 16 keys a beat here, 64 x 64 at 64)."""
    size = 16
    dogs, stores = watchdogs(size)
    try:
        until(lambda: all(s.beats >= 4 for s in stores), 20)
    finally:
        for dog in dogs:
            dog.stop()
    per_beat = [s.read / s.beats for s in stores]
    # The others: `ended`, rank 0's beat (checked, then read) and the lost list.
    assert all(keys <= 5 for keys in per_beat[1:]), per_beat
    assert per_beat[0] >= size, per_beat        # the leader checks and reads every beat
    assert not any(dog.lost for dog in dogs)


def test_a_failed_collective_anywhere_closes_every_ranks_process_group():
    """A rank whose collective failed ends the generation for all: every
    watchdog then shuts down this process's process-group connections (a
    collective blocked on a survivor that left returns at once) and keeps
    its store connections (the ports in ``spare``), needed to meet again."""
    with socket.create_server(("127.0.0.1", 0)) as group, \
            socket.create_server(("127.0.0.1", 0)) as store_port:
        pair = socket.create_connection(group.getsockname())
        kept = socket.create_connection(store_port.getsockname())
        peer, _ = group.accept()
        served, _ = store_port.accept()
        got = {}
        blocked = threading.Thread(target=lambda: got.update(data=peer.recv(10)))
        blocked.start()
        store = torch.distributed.HashStore()
        # Rank 1 on this host's loopback: the sockets above are "its" connections.
        addresses = ["10.255.0.1", "127.0.0.1", "10.255.0.3"]
        dogs = [Watchdog(store, r, addresses, addresses[r], 30.0,
                         spare={store_port.getsockname()[1]}) for r in range(3)]
        try:
            blocked.join(1.0)
            assert blocked.is_alive()                   # heartbeats alone cut nothing
            dogs[2].end()
            blocked.join(5)
            assert not blocked.is_alive() and got["data"] == b""
            until(lambda: all(dog.ended for dog in dogs), 5)    # each cut, within a beat
            served.settimeout(0.5)
            try:
                kept.sendall(b"x")
                echoed = served.recv(1)
            except OSError as err:
                echoed = err
            assert echoed == b"x", echoed               # the store's connection is intact
            assert not any(dog.lost for dog in dogs)
        finally:
            for dog in dogs:
                dog.stop()
            for sock in (pair, kept, peer, served):
                sock.close()


def test_a_member_asks_the_previous_members_only_up_to_the_first_that_answers():
    """The walk for the leader, in rank order: a member that will not lead
    stops at the first member that answers (the leader), so a meeting of N
    members costs about N handshakes, not N x N. The member that answers
    first to itself leads, and asks everyone (who refused, who went on)."""
    from hetseq.elastic.membership import ANSWERS, REFUSED, Membership
    members = [{"id": i} for i in "abcdefgh"]
    said = {"a": REFUSED, **{i: ANSWERS for i in "bcdefgh"}}

    def walk(me):
        asked = []
        node = types.SimpleNamespace(id=me, _probe=lambda ms: asked.extend(m["id"] for m in ms)
                                     or [said[m["id"]] for m in ms])
        probed, answers = Membership._walk(node, members)
        return asked, [m["id"] for m in probed], answers

    asked, probed, answers = walk("f")
    assert asked == probed == ["a", "b", "c"], asked          # batches of 1, then 2
    assert answers == [REFUSED, ANSWERS, ANSWERS]
    asked, probed, answers = walk("b")                          # b leads: it asks everyone
    assert sorted(asked) == list("abcdefgh") and probed == list("abcdefgh")


def test_a_member_waiting_at_a_node_that_went_elsewhere_follows_it():
    """A member whose walk stopped at a node that is not leading (it was
    paused, woke, and found the job elsewhere) follows that node's word
    (``e/leader``) once it joined a generation of at least the round waited
    for, instead of waiting out the round (10 minutes at the defaults)."""
    from hetseq.elastic.rounds import FollowRound
    store = torch.distributed.HashStore()
    me = types.SimpleNamespace(_where=lambda s: {"addr": "10.0.0.2", "port": 7,
                                                 "generation": 1})
    round_two = FollowRound(me, store, 2)
    assert round_two.went_on() is None                 # nothing said yet
    store.set("e/leader", json.dumps({"addr": "10.0.0.2", "port": 7, "generation": 2}))
    assert round_two.went_on() is None                 # it leads here itself
    store.set("e/leader", json.dumps({"addr": "10.0.0.1", "port": 7, "generation": 1}))
    assert round_two.went_on() is None                 # an older generation
    store.set("e/leader", json.dumps({"addr": "10.0.0.1", "port": 7, "generation": 3}))
    assert round_two.went_on()["addr"] == "10.0.0.1"
    store.set("e/leader", b"\xff not json")
    assert round_two.went_on() is None


def member(i, ranks=1):
    return {"id": i, "host": i, "addr": "10.0.0.1", "port": 1, "pid": 1, "updates": 10,
            "lineage": ["1-a"], "ranks": ranks, "holder": 0, "generation": 1}


def test_a_member_placed_in_a_round_it_did_not_read_enters_that_generation():
    """A member that arrived in round 2 and lost its connection before it
    read the outcome finds itself placed there: it enters generation 2 (the
    process group waits for it) instead of arriving late and asking for a
    generation 3."""
    from hetseq.elastic.rounds import placed as placed_in, publish
    store = torch.distributed.HashStore()
    one = Generation(1, (member("a"), member("b"), member("c")), 1, None)
    me = types.SimpleNamespace(id="b", generation=one)
    assert placed_in(store, me.id, me.generation) is None       # no round closed there
    publish(store, 2, {"members": [member("a"), member("b")], "source": 0, "lineage": []})
    placed = placed_in(store, me.id, me.generation)
    assert placed is not None
    number, outcome = placed
    assert number == 2 and [m["id"] for m in outcome["members"]] == ["a", "b"]
    assert placed_in(store, "c", one) is None
    two = Generation(2, tuple(outcome["members"]), 1, None)
    assert placed_in(store, "b", two) is None
    assert json.loads(store.get("e/2/members"))["members"][1]["id"] == "b"
