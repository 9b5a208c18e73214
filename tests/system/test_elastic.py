"""Elastic jobs (--elastic): hosts lost, frozen or late, the meeting point
lost, too few nodes, a host lost while it saves.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/elastic/test_elastic.py."""

import os
import re
import signal
import socket
import threading
import time

import pytest
import torch

from hetseq.elastic.generations import Generation

from machinery.commands import namespace_hosts, final_params
from machinery.in_process import alone, max_diff
from machinery.settings import UPDATE_LINE, free_port
from machinery.parity import COMMON
from machinery.settings import EXACT
from machinery.elastic_jobs import SECRET, changed, finish_ok, new_rank_0, node, reference


# Scenarios with nothing left to happen once the fault is handled stop here.
SHORT = 40


def switch_off(cluster, host, watched):
    """Cut the host's link, then kill its processes: no packet says goodbye."""
    cluster.cut(host)
    os.killpg(watched.proc.pid, signal.SIGKILL)
    watched.finish(30)


class SilentStore:
    """A leader's store that never answers (its host paused or cut off)."""

    def __init__(self):
        self.released = threading.Event()

    def set(self, key, value):
        self.released.wait()
        raise RuntimeError("the store is gone")


def test_a_silent_leaders_store_tells_the_leader_lost_after_one_timeout():
    """The leader's store not answering for --heartbeat-timeout is the
    leader's silence: told then, not a second timeout later (which let
    the collective's --distributed-timeout end the generation first, and
    the next meeting then waited on the lost leader's store)."""
    from hetseq.elastic.watchdog import Watchdog
    store, timeout_s = SilentStore(), 3.0
    # The leader's address has no connection here: cutting it closes nothing.
    watchdog = Watchdog(store, 1, ["10.255.255.1", "127.0.0.1"], "127.0.0.1", timeout_s)
    started = time.monotonic()
    try:
        while not watchdog.lost and time.monotonic() - started < 4 * timeout_s:
            watchdog._stop.wait(0.05)
        told = time.monotonic() - started
    finally:
        store.released.set()
        watchdog.stop()
    assert watchdog.lost == [0]
    # One timeout and a beat's wait; a second timeout would be 6.5 s.
    assert told < timeout_s + 2.0, told


def arrive(store, number, *members):
    """Members arriving in round ``number`` at ``store`` (membership.py's way)."""
    import json
    for member in members:
        index = store.add(f"e/{number}/n", 1)
        store.set(f"e/{number}/who/{index}", json.dumps(member))


def test_a_round_does_not_wait_for_a_member_whose_store_refused():
    """A killed member's store refuses the survivors' look for the leader
    (Membership.unreachable): the leader closes the round as soon as the
    others arrived, not EXPECTED_SETTLE_S after them (a member it expects)."""
    import types
    from hetseq.elastic.rounds import EXPECTED_SETTLE_S, SETTLE_S, LeadRound
    line = ["1-a"]
    held = [{"id": i, "host": i, "addr": "10.0.0.1", "port": 1, "pid": 1, "updates": 10,
             "lineage": line, "ranks": 1, "holder": 0, "generation": 1} for i in "abc"]
    previous = Generation(1, tuple(held), 0, None, lineage=tuple(line))
    store = torch.distributed.HashStore()
    arrive(store, 2, held[0], held[1])
    def lead(number, unreachable, max_nodes=0):
        m = types.SimpleNamespace(generation=previous, lost=set(), unreachable=unreachable,
                                  min_nodes=1, max_nodes=max_nodes, timeout_s=30.0, id="a",
                                  _live=lambda members: [],   # probes: nobody is elsewhere
                                  _newer=lambda live: None)
        started = time.monotonic()
        outcome = LeadRound(m, store, number).close()
        return [member["id"] for member in outcome["members"]], time.monotonic() - started

    for unreachable, at_least in (set(), EXPECTED_SETTLE_S), ({"c"}, 0.0):
        ids, took = lead(2, unreachable)
        assert ids == ["a", "b"]
        assert at_least <= took < at_least + SETTLE_S / 2, (unreachable, took)
    # A node waiting for a place (--max-nodes 3) is waited for, not SETTLE_S
    # longer; an emptied slot or one that holds no node id is not. A node
    # that arrives twice (a retried round) counts once.
    w = "f" * 32
    waiter = {**held[2], "id": w, "generation": None, "updates": -1, "lineage": []}
    for slot, value in enumerate(["", "\udcff-not-an-id", w], 1):
        store.add("e/waiting/n", 1)
        store.set(f"e/waiting/{slot}", value.encode("utf-8", "surrogateescape"))
    arrive(store, 3, held[0], held[1], held[1])
    late = threading.Timer(0.5, arrive, (store, 3, waiter))
    late.start()
    ids, took = lead(3, {"c"}, max_nodes=3)
    late.join()
    assert ids == ["a", "b", w] and 0.5 <= took < SETTLE_S, took
    # The slots read are spent: a waiter that died does not hold up the next round.
    arrive(store, 4, held[0], held[1])
    ids, took = lead(4, {"c"}, max_nodes=3)
    assert ids == ["a", "b"] and took < SETTLE_S / 2, took


def test_a_round_closes_at_its_deadline_with_whoever_came():
    """A node arriving in the last seconds before --distributed-timeout (a
    slow start, a GPU's CUDA initialisation) joins: at the deadline a round
    with enough nodes and a quorum closes with them, though the last
    arrival had no SETTLE_S to settle (the leader crashed formatting a
    quorum of a first generation that has none). Too few nodes stop it with
    a line, first generation included."""
    import types
    from hetseq.elastic.rounds import SETTLE_S, LeadRound
    assert SETTLE_S > 1.0
    fresh = [{"id": i, "host": i, "addr": "10.0.0.1", "port": 1, "pid": 1, "updates": -1,
              "lineage": [], "ranks": 1, "holder": 0, "generation": None} for i in "ab"]

    def lead(store, number, min_nodes):
        m = types.SimpleNamespace(generation=None, lost=set(), unreachable=set(),
                                  min_nodes=min_nodes, max_nodes=0, timeout_s=1.0, id="a",
                                  _live=lambda members: [], _newer=lambda live: None)
        return LeadRound(m, store, number).close()

    store = torch.distributed.HashStore()
    arrive(store, 1, fresh[0])
    late = threading.Timer(0.7, arrive, (store, 1, fresh[1]))   # inside the last settle window
    late.start()
    try:
        outcome = lead(store, 1, min_nodes=2)
    except Exception as err:    # the crash this guards against
        pytest.fail(f"the round did not close with the two nodes that came: {err!r}")
    finally:
        late.join()
    assert [member["id"] for member in outcome.get("members", [])] == ["a", "b"], outcome
    lonely = torch.distributed.HashStore()
    arrive(lonely, 1, fresh[0])
    assert lead(lonely, 1, min_nodes=2) == {
        "stop": "only 1 of --min-nodes 2 nodes within --distributed-timeout 1 s"}


def test_a_member_whose_port_refuses_is_told_apart_from_a_slow_one():
    """A killed member's port refuses: the round need not wait for it. One
    that accepts but does not greet (a loaded host, a paused process) is
    only silent: the round still waits for it."""
    import types
    from hetseq.elastic.membership import REFUSED, SILENT, Membership
    me = types.SimpleNamespace(_address=lambda: ("127.0.0.1", 1), secret=SECRET)
    closed = free_port()                       # nothing listens there
    assert Membership._answers(me, {"addr": "127.0.0.1", "port": closed}) == REFUSED
    with socket.create_server(("127.0.0.1", 0)) as mute:     # the kernel accepts; nobody greets
        port = mute.getsockname()[1]
        assert Membership._answers(me, {"addr": "127.0.0.1", "port": port}) == SILENT


def test_an_elastic_node_without_a_secret_is_told_to_set_one(tmp_path):
    watched = node(None, None, f"tcp://127.0.0.1:{free_port()}", tmp_path / "a", env={})
    code, out = watched.finish(60)
    assert code == 2 and "--elastic needs a job secret" in out, out[-3000:]
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def test_two_nodes_on_one_host_train_exactly_and_a_node_with_other_flags_is_refused(tmp_path):
    """The smallest elastic job, on loopback: nodes met at the URL, ranks
    given out there, shares 16 and 32 of 48. A third node started with
    another --seed is refused (exit 2, the flag named) while they train."""
    url, go = f"tcp://127.0.0.1:{free_port()}", tmp_path / "go"
    # (Held at their first step until the third node was refused: a job that
    # had ended before it arrived would refuse nothing.)
    short = ["--toy-sample-ms", 3, "--max-update", 40, "--toy-hold-until", go]
    nodes = [node(None, None, url, tmp_path / "a", *short),
             node(None, None, url, tmp_path / "b", *short, "--max-sentences", 32)]
    nodes[0].wait_for(r"generation 1: 2 nodes")
    code, out = node(None, None, url, tmp_path / "c", *short, "--seed", 2).finish(60)
    go.touch()
    assert code == 2 and "--seed 2 here, 19940802 in the job" in out and "Traceback" not in out, out
    outputs = finish_ok(*nodes)
    leader = 0 if "this node is rank 0" in outputs[0] else 1
    expected = alone(*COMMON, "--max-update", 40, "--max-sentences", 48)
    assert max_diff(expected["model"], final_params(tmp_path / "ab"[leader])) < EXACT


def test_overlapped_rounds_go_back_to_the_last_exchange_that_arrived(tmp_path):
    """--local-steps 2 --outer-overlap under --elastic, two nodes on
    loopback (rounds of updates 1-2, 3, 4-5, 6, ...: an epoch of 100 samples
    ends at update 3 and 6). B's data ends in update 6 (--toy-fail-after 5):
    that round's statistics fail on A. The exchange of the round that ended
    at update 5, in flight, arrives (B, stopping on its own error, lets its
    half complete before it exits): A applies it, goes back to update
    5, saves and stops, alone below --min-nodes 2. Both started again
    resume and finish. The weights are those of a fixed 2-rank job that
    settled at update 5 (its --max-update) and resumed to the end, to
    float64's summation order."""
    from machinery.jobs import run_jobs
    url = f"tcp://127.0.0.1:{free_port()}"
    # A waits 6 s, not 10, for a second node before it saves and stops.
    rounds = ["--local-steps", 2, "--outer-overlap", "--outer-momentum", 0.5,
              "--max-sentences", 48, "--max-update", 12, "--toy-sample-ms", 3,
              "--distributed-timeout", 6]
    first = [node(None, None, url, tmp_path / "a", *rounds),
             node(None, None, url, tmp_path / "b", *rounds, "--toy-fail-after", 5)]
    (code_a, out_a), (code_b, out_b) = (n.finish(120) for n in first)
    assert code_b == 2 and "data ends at call 6" in out_b, out_b[-3000:]
    assert code_a == 3 and "(5 updates)" in out_a, out_a[-3000:]
    outputs = finish_ok(*(node(None, None, url, tmp_path / n, *rounds) for n in "ab"))
    leader = "ab"[0 if "this node is rank 0" in outputs[0] else 1]

    def job(updates):
        # 24 + 24, the split the elastic nodes' --max-sentences 48 gave B = 48.
        flags = [*COMMON, *rounds, "--max-update", updates, "--save-dir", tmp_path / "fixed",
                 "--distributed-world-size", 2, "--max-sentences", 24]
        return [[*map(str, flags)]] * 2
    run_jobs(2, [("to 5", job(5)), ("to 12", job(12))], tmp_path / "group")
    assert max_diff(final_params(tmp_path / "fixed"), final_params(tmp_path / leader)) < EXACT


def test_a_member_lost_inside_a_round_ends_the_generation_between_inner_steps(tmp_path):
    """Rounds of --local-steps 150 (about 7 s of compute without a
    collective), two nodes on loopback: the node that is not rank 0 is
    killed once it trains. Rank 0's heartbeats tell it 3 s later, and it
    leaves the generation between two inner steps, not at the round's end
    (a collective's failure a round's compute later). Alone below
    --min-nodes 2, it saves the state of the round's start (0 updates: the
    round is trained again) and stops."""
    url = f"tcp://127.0.0.1:{free_port()}"
    rounds = ["--local-steps", 150, "--toy-size", 4000, "--max-sentences", 8,
              "--global-batch-size", 16, "--max-update", 150, "--distributed-timeout", 6]
    nodes = [node(None, None, url, tmp_path / name, *rounds, "--toy-log-indices",
                  tmp_path / f"{name}-trains") for name in "ab"]
    nodes[0].wait_for(r"generation 1: 2 nodes", timeout=60)
    nodes[1].wait_for(r"generation 1: 2 nodes", timeout=60)
    leader = 0 if "this node is rank 0" in "".join(nodes[0].lines) else 1
    victim = 1 - leader
    trains = tmp_path / f"{'ab'[victim]}-trains.1"
    deadline = time.monotonic() + 60
    while not (trains.exists() and len(trains.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "the second node did not train 3 inner steps in 60 s"
        time.sleep(0.05)
    nodes[victim].proc.kill()     # one process: the node's first process is its rank
    nodes[victim].finish(30)
    inner = len((tmp_path / f"{'ab'[leader]}-trains.0").read_text().splitlines())
    code, out = nodes[leader].finish(120)
    assert code == 3 and "(0 updates)" in out, out[-3000:]
    assert "generation 1 ended: the heartbeats told it between inner steps" in out, out[-3000:]
    # It trained on after the kill for the heartbeats' time, not to the round's end.
    after = len((tmp_path / f"{'ab'[leader]}-trains.0").read_text().splitlines())
    assert inner < after < 150, (inner, after)


def test_a_lost_host_an_intruder_and_a_late_joiner(three_hosts, tmp_path):
    """Host C, a node of 2 ranks, is switched off after 10 updates; A (2
    ranks) and B (1) go on from the last update they completed. An
    uninvited node on C is refused without disturbing them; then C comes
    back with 2 ranks and joins, receiving the state from the members. The
    URL names host A, as the issue's command does (on A itself the name
    resolves to 127.0.1.1)."""
    url = f"tcp://{three_hosts.names[0]}:29517"
    # From the switch-off until C joined, A and B take 1 s more per update: the
    # survivors keep updating (a join is seen at an update) but cannot finish
    # before the intruder and the joiner (two processes) have started.
    ranks, slow = {0: 2, 1: 1, 2: 2}, tmp_path / "slow"
    a, b, c = (node(three_hosts, i, url, tmp_path / f"host{i}", "--cpu", "--distributed-gpus",
                    ranks[i], "--toy-slow-while", slow) for i in range(3))
    a.wait_for(r"generation 1: 3 nodes, this node is rank 0 \(ranks 0-1 of 5\)")
    a.wait_for(UPDATE_LINE, 10)
    slow.touch()
    switch_off(three_hosts, 2, c)
    a.wait_for(changed("hostC", "left"), timeout=90)
    a.wait_for(r"resumed from the state of rank", timeout=30)
    three_hosts.plug(2)
    code, out = node(three_hosts, 2, url, tmp_path / "intruder",
                     env={"HETSEQ_JOB_SECRET": "9e4c7a1f0b3d5e2a8c6f4d1b7e9a0c3f"}).finish(60)
    assert code == 2 and "its secret differs" in out and "Traceback" not in out, out[-3000:]
    assert len(out.strip().splitlines()) == 1, out
    joiner = node(three_hosts, 2, url, tmp_path / "joiner", "--cpu", "--distributed-gpus", 2)
    a.wait_for(changed("hostC", "joined"), timeout=90)
    slow.unlink()
    out_a, out_b, out_c = finish_ok(a, b, joiner)
    # Rank 0 (A) says what the new splits are, for 5 ranks, then 3, then 5;
    # B says who left and joined.
    assert out_a.count("capacity plan") == 3, out_a[-4000:]
    assert [len(re.findall(r"\n  rank \d ", plan)) for plan in
            out_a.split("capacity plan")[1:]] == [5, 3, 5], out_a[-4000:]
    assert "finished its part: ranks 3-4" in out_c, out_c[-3000:]
    assert "left: hostC" in out_b and "joined: hostC" in out_b, out_b[-4000:]
    assert "refused a connection to the job's store from 10.213.0.3" in out_a
    assert max_diff(reference(), final_params(tmp_path / "host0")) < EXACT


def test_the_meeting_point_host_is_lost_and_a_node_joins_through_another(three_hosts, tmp_path):
    """Host A serves the URL's meeting point and is rank 0; it is switched
    off. The lowest surviving rank becomes the meeting point and rank 0. A
    restarted node names B's address (every member serves the same port).
    The job runs in rounds of --local-steps 1 with the outer step theta_0 - D
    (the synchronous update, local_steps.py): the round cut short by the
    loss is trained again, and the joiner gets the outer step's state."""
    url = f"tcp://{three_hosts.addresses[0]}:29519"
    rounds = ["--local-steps", 1, "--outer-lr", 1, "--outer-momentum", 0]
    a, b, c = (node(three_hosts, i, url, tmp_path / f"host{i}", *rounds) for i in range(3))
    a.wait_for(UPDATE_LINE, 10)
    switch_off(three_hosts, 0, a)
    b.wait_for(changed("hostA", "left"), timeout=90)
    three_hosts.plug(0)
    again = node(three_hosts, 0, f"tcp://{three_hosts.addresses[1]}:29519", tmp_path / "again",
                 *rounds)
    b.wait_for(changed("hostA", "joined"), timeout=90)
    # Ranks were given in the order of arrival: B or C is now rank 0.
    leader = new_rank_0(finish_ok(b, c, again)[:2], "left: hostA") + 1
    assert max_diff(reference(), final_params(tmp_path / f"host{leader}")) < EXACT


def test_too_few_nodes_save_and_stop_and_the_job_resumes(three_hosts, tmp_path):
    """--min-nodes 3 and C killed: A and B wait --distributed-timeout, save
    the last completed update each in its own --save-dir and stop (exit 3).
    The same three commands again resume from the newest checkpoint."""
    url = f"tcp://{three_hosts.addresses[0]}:29520"
    three = ["--min-nodes", 3, "--max-update", SHORT]
    a, b, c = (node(three_hosts, i, url, tmp_path / f"host{i}", *three) for i in range(3))
    a.wait_for(UPDATE_LINE, 10)
    os.killpg(c.proc.pid, signal.SIGKILL)
    for watched in (a, b):
        code, out = watched.finish(120)
        assert code == 3 and "only 2 of --min-nodes 3 nodes" in out, out[-3000:]
        assert "Traceback" not in out
    nodes = [node(three_hosts, i, url, tmp_path / f"host{i}", *three) for i in range(3)]
    out_a = finish_ok(*nodes)[0]
    assert "resumed from the state of rank" in out_a, out_a[-3000:]
    assert max_diff(reference(SHORT), final_params(tmp_path / "host0")) < EXACT


def test_the_leader_lost_while_it_saves(three_hosts, tmp_path):
    """Rank 0's host is switched off in the middle of a checkpoint save (its
    state takes 3 s to gather). The others finish exactly, and the
    checkpoint A had written before is intact."""
    url = f"tcp://{three_hosts.addresses[0]}:29521"
    saving = ["--max-update", SHORT, "--save-interval-updates", 5]
    a = node(three_hosts, 0, url, tmp_path / "host0", *saving, "--toy-slow-state-ms", 3000)
    b, c = (node(three_hosts, i, url, tmp_path / f"host{i}", *saving) for i in (1, 2))
    a.wait_for(r"saved .*checkpoint_last.pt \(5 updates\)", timeout=120)
    a.wait_for(r"toy: state after", count=2, timeout=60)     # the save at 10 updates
    switch_off(three_hosts, 0, a)
    leader = new_rank_0(finish_ok(b, c), "left: hostA") + 1
    assert max_diff(reference(SHORT), final_params(tmp_path / f"host{leader}")) < EXACT
    last = torch.load(tmp_path / "host0" / "checkpoint_last.pt", weights_only=True)
    assert last["controller"]["num_updates"] == 5


def generation_lines(out):
    """{generation number: node count} of every generation line in ``out``."""
    return {int(n): int(k) for n, k in re.findall(r"generation (\d+): (\d+) nodes", out)}


def one_job(outputs):
    """Every node saw the same node count for each generation number: no
    generation was formed twice (two jobs) anywhere."""
    seen = {}
    for out in outputs:
        for number, count in generation_lines(out).items():
            assert seen.setdefault(number, count) == count, (number, [o[-3000:] for o in outputs])
    return seen


def test_a_paused_meeting_point_rejoins_the_job_and_never_trains_alone(three_hosts, tmp_path):
    """Host A (the URL's meeting point, rank 0) is paused past
    --distributed-timeout; B and C go on as generation 2. When A wakes up
    (--min-nodes 1: alone it would be enough) it finds the job went on,
    joins it as a late joiner and takes the job's state: one job, exactly."""
    url = f"tcp://{three_hosts.addresses[0]}:29522"
    slow = ["--min-nodes", 1, "--toy-sample-ms", 15, "--max-update", SHORT]
    a, b, c = (node(three_hosts, i, url, tmp_path / f"host{i}", *slow) for i in range(3))
    a.wait_for(UPDATE_LINE, 5)
    os.killpg(a.proc.pid, signal.SIGSTOP)
    b.wait_for(changed("hostA", "left"), timeout=90)
    os.killpg(a.proc.pid, signal.SIGCONT)
    b.wait_for(changed("hostA", "joined"), timeout=90)
    outputs = finish_ok(a, b, c)
    assert "the job went on without this node" in outputs[0], outputs[0][-3000:]
    counts = one_job(outputs)
    assert 1 not in counts.values(), counts      # A never trained alone
    leader = new_rank_0(outputs[1:], "left: hostA") + 1
    assert max_diff(reference(SHORT), final_params(tmp_path / f"host{leader}")) < EXACT


def test_a_split_into_halves_trains_on_one_side_only(tmp_path):
    """Four hosts, the network split 2 | 2. The half with the old rank 0 (A)
    has its tie-breaking quorum and finishes exactly; the other half has no
    quorum: it trains nothing, saves and stops (exit 3)."""
    with namespace_hosts(4) as hosts:
        url = f"tcp://{hosts.addresses[0]}:29523"
        nodes = [node(hosts, i, url, tmp_path / f"host{i}", "--max-update", SHORT)
                 for i in range(4)]
        nodes[0].wait_for(UPDATE_LINE, 10)
        hosts.split(2, 3)
        for watched in nodes[2:]:
            code, out = watched.finish(120)
            assert code == 3 and "no quorum: 2 of the 4 members of generation 1" in out, \
                out[-3000:]
            assert "Traceback" not in out and 2 not in generation_lines(out), out[-3000:]
        outputs = finish_ok(*nodes[:2])
    assert one_job(outputs)[2] == 2
    assert max_diff(reference(SHORT), final_params(tmp_path / "host0")) < EXACT


@pytest.mark.parametrize("fooled", [(1, 3), (2, 3)])
def test_two_rounds_of_one_generation_meet_at_the_lower_ranked_leader(fooled):
    """Five members, rank 4 lost; for a moment rank 0 looks lost to two
    others. (1, 3): rank 1 leads a round with rank 3 while rank 0 leads one
    with rank 2: 2 and 2 of 5, no quorum either way, unless rank 1 sees rank
    0's round of the same number and moves there. (2, 3): they meet at rank
    1's store, which is not leading (rank 1 is in rank 0's round) and says
    where it meets. Either way one generation of four forms. (One process:
    each Membership serves its own store on 127.0.0.1.)"""
    import threading
    import types
    from hetseq.elastic import membership
    from hetseq.store import job_secret
    from hetseq.store.secret import make
    secret = job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: make()})
    launch = types.SimpleNamespace(distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                   distributed_timeout=10.0, distributed_interface=None)
    nodes = [membership.Membership(launch, "gloo", secret, 1, 0) for _ in range(5)]

    def meet(group):
        results = {}

        def one(node):
            try:
                results[node.id] = node.meet(0, ["1-x"])
            except Exception as err:      # the test reports what each node got
                results[node.id] = err
        threads = [threading.Thread(target=one, args=(node,)) for node in group]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        return results
    first = meet(nodes)
    assert {g.world_size for g in first.values()} == {5}, first
    by_id = {node.id: node for node in nodes}
    ranked = [by_id[i] for i in next(iter(first.values())).ids]
    ranked[4].store.gate.listener.close()                    # rank 4 is lost
    leader = ranked[0].id
    for node in (ranked[i] for i in fooled):                 # rank 0 looks lost, once
        # The first probe of rank 0's store (finding where to meet) finds it
        # silent; later ones (a leader looking for a round elsewhere) answer.
        real, done = node._answers, [False]

        def answers(member, real=real, done=done):
            if not done[0] and member["id"] == leader:
                done[0] = True
                return membership.SILENT
            return real(member)
        node._answers = answers
    second = meet(ranked[:4])
    assert all(isinstance(g, Generation) for g in second.values()), second
    assert {g.number for g in second.values()} == {2}
    assert {tuple(g.ids) for g in second.values()} == {tuple(n.id for n in ranked[:4])}
