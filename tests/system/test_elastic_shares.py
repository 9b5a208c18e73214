"""Elastic jobs whose state is split between ranks (--zero 1/2/3, even or by
memory: update/zero/uneven.py).

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/elastic/test_elastic_shares.py."""

import re

import pytest


from machinery.commands import final_params
from machinery.in_process import alone, max_diff
from machinery.settings import UPDATE_LINE, free_port
from machinery.elastic_jobs import finish_ok, new_rank_0, node
from machinery.parity import COMMON
from machinery.settings import EXACT
# Units of their own under --zero 2/3; SGD with momentum, so --zero 1 splits
# a state too (the update stays linear in the gradient: a wrong scale shows).
SPLIT = ["--toy-blocks", 2, "--momentum", 0.5]


SHARES = re.compile(r"state shares (?:by memory|even) \(.*?\): (.*)$", re.M)


RESUMED = re.compile(r"resumed from the state of rank \d+: epoch \d+, (\d+) updates done")


WENT_BACK = re.compile(r"went back (\d+) updates to update (\d+): the state was split "
                       r"\(--zero (\d)\)")


def reference(updates):
    """One process with the whole global batch of 48."""
    return alone(*COMMON, *SPLIT, "--max-update", updates, "--max-sentences", 48)["model"]


def percents(line):
    return [float(p) / 100 for p in re.findall(r"([\d.]+)%", line)]


def generations(out):
    """{generation number: its part of ``out``}, from each generation line on."""
    parts = re.split(r"(?=generation \d+: \d+ nodes)", out)
    return {int(re.match(r"generation (\d+)", part).group(1)): part for part in parts[1:]}


def check_shares(out, memories, mode):
    """The shares line(s) of each generation carry its members' fractions:
    by their memories (rank order) or even."""
    for number, part in generations(out).items():
        lines = SHARES.findall(part)
        assert lines, (number, part[-3000:])
        names = memories[number]
        total = sum(names.values())
        expected = [m / total if mode[-1] == "memory" else 1 / len(names) for m in names.values()]
        for line in lines:
            got = percents(line)
            assert len(got) == len(expected), (number, line)
            assert max(abs(g - e) for g, e in zip(got, expected)) < 0.02, (number, line, expected)


@pytest.mark.parametrize("mode", [
    ["--zero", 3, "--state-shares", "memory"],
    ["--zero", 1, "--state-shares", "even"]], ids=["zero3-memory", "zero1-even"])
def test_a_node_joins_a_split_state_and_is_lost_again(tmp_path, mode):
    """Two nodes of 1 and 3 MB for model state (--zero 3 by memory: shares
    1:3); a node of 2 MB joins. Every rank takes the full state together at
    the join, so the three go on from the update the two completed, with
    shares 1:3:2 agreed in the new generation. The newcomer is then killed
    inside its second update: the two others go back to the state their
    generation started from (the one they received), say so, and train
    those updates again, with shares 1:3 once more. The weights are one
    process's. (--zero 1 evenly: torch's optimizer takes a loaded state's
    tensors as its own and ZeroRedundancyOptimizer rewrites the dict it
    loads, so the state kept must be a copy.)"""
    url, slow = f"tcp://127.0.0.1:{free_port()}", tmp_path / "slow"
    # No save before the end (--save-interval in epochs): nothing but the
    # join keeps a newer full state.
    flags = [*SPLIT, *mode, "--max-update", 30, "--save-interval", 100, "--toy-sample-ms", 2,
             "--toy-slow-while", slow]
    memories = {"a": 0.001, "b": 0.003, "c": 0.002}
    first = [node(None, None, url, tmp_path / name, *flags, "--max-memory-gb", memories[name])
             for name in "ab"]
    for watched in first:
        watched.wait_for(r"generation 1: 2 nodes", timeout=60)
    leader = 0 if "this node is rank 0" in "".join(first[0].lines) else 1
    first[leader].wait_for(UPDATE_LINE, count=3, timeout=60)
    # 1 s more per step from here until the newcomer is lost: the job cannot
    # end before it joined, and it is killed while the ranks wait in that
    # second of its second update.
    slow.touch()
    joiner = node(None, None, url, tmp_path / "c", *flags, "--max-memory-gb", memories["c"])
    first[leader].wait_for(r"generation 2: 3 nodes", timeout=60)
    first[leader].wait_for(RESUMED.pattern, timeout=30)
    joined_at = int(RESUMED.search(first[leader].output()).group(1))
    first[leader].wait_for(rf"\| update {joined_at + 1}/", timeout=30)
    joiner.proc.kill()     # one process: the node's first process is its rank
    joiner.finish(30)
    slow.unlink()
    outputs = finish_ok(*first)
    out = outputs[leader]
    # Generation 2 took the state of the update generation 1 ended at.
    before_join = out[:out.index("generation 2: 3 nodes")]
    assert joined_at == max(int(n) for n in re.findall(r"\| update (\d+)", before_join)) > 0
    # Generation 3 went back to it: the state generation 2 started from.
    assert [int(n) for n in RESUMED.findall(out)] == [joined_at, joined_at], out[-4000:]
    went = WENT_BACK.findall(out)
    assert len(went) == 1 and int(went[0][0]) >= 1, out[-4000:]
    for each in outputs:     # the other node may have lost the update in flight: none to say
        assert all(to == str(joined_at) and zero == str(mode[1])
                   for _, to, zero in WENT_BACK.findall(each)), each[-4000:]
    # The shares, agreed in every generation in rank order (the leader, the
    # other member, the newcomer), from the memories.
    order = {n: memories[n] for n in ("ab"[leader], "ab"[1 - leader])}
    check_shares(out, {1: order, 2: {**order, "c": memories["c"]}, 3: order}, mode)
    assert max_diff(reference(30), final_params(tmp_path / "ab"[leader])) < EXACT


# (mode, how often it saves, the update after which rank 0 is killed, the last save before)
LOST = {"zero2-even": (["--zero", 2, "--state-shares", "even"],
                       ["--save-interval-updates", 4, "--save-interval", 100], 5, 4),
        # A save at every epoch's end (3 updates of 48, 48 and 4 samples).
        "zero1-memory": (["--zero", 1, "--state-shares", "memory"], [], 4, 3)}


@pytest.mark.parametrize("case", sorted(LOST))
def test_a_member_lost_from_a_split_state_goes_back_to_the_last_save(tmp_path, case):
    """Three nodes (--zero 2 evenly, saving every 4 updates; --zero 1 by
    memories 1:3:2, saving at every epoch's end). Rank 0 (the meeting point,
    the only rank that held the gathered state) is killed two updates after
    a save. The two others go back to the full state every rank took at
    that save (rank 0 sent it to them), say so, and train the update since
    again: the job goes on and its weights are one process's."""
    mode, saves, killed_after, saved_at = LOST[case]
    url, slow = f"tcp://127.0.0.1:{free_port()}", tmp_path / "slow"
    flags = [*SPLIT, *mode, *saves, "--max-update", 24, "--toy-sample-ms", 1,
             "--toy-slow-while", slow]
    by_memory = mode[-1] == "memory"
    nodes = [node(None, None, url, tmp_path / name, *flags,
                  *(["--max-memory-gb", gb] if by_memory else []))
             for name, gb in zip("abc", (0.001, 0.003, 0.002))]
    for watched in nodes:
        watched.wait_for(r"generation 1: 3 nodes", timeout=60)
    leader = next(i for i, w in enumerate(nodes) if "this node is rank 0" in "".join(w.lines))
    nodes[leader].wait_for(r"\| update 2/", timeout=60)
    slow.touch()       # 1 s more per step: killed while the ranks wait in the next one's
    nodes[leader].wait_for(rf"\| update {killed_after}/", timeout=60)
    nodes[leader].proc.kill()      # one process: the node's first process is its rank
    nodes[leader].finish(30)
    slow.unlink()
    survivors = [name for i, name in enumerate("abc") if i != leader]
    outputs = finish_ok(*(w for i, w in enumerate(nodes) if i != leader))
    went = [WENT_BACK.findall(out) for out in outputs]
    assert all(to == str(saved_at) and zero == str(mode[1])
               for each in went for _, to, zero in each), went
    assert any(went), outputs      # (a node that lost the update in flight has none to say)
    new = new_rank_0(outputs, "generation 2: 2 nodes")
    assert RESUMED.findall(outputs[new]) == [str(saved_at)], outputs[new][-4000:]
    assert max_diff(reference(24), final_params(tmp_path / survivors[new])) < EXACT
