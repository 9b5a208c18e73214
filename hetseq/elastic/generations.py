"""The rules of an elastic job's generations, as pure functions (no network),
so that they can be read and tested in one place: whether a round may close
(a quorum of the previous generation: one job, never two), who gets which
rank, and whose state the next generation continues from (the newest on the
job's line). membership.py runs the rounds; docs/elastic.md, "One job,
always", gives the rules and what they cost.
"""

import dataclasses
import secrets


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation: its number, the members in order (their JSON infos),
    this node's place among them (``index``), the store it met at (the
    leader's), the member whose state every rank takes (``source``), and the
    generation's lineage.

    A member is a node; it runs ``ranks`` processes (--distributed-gpus) and
    they hold consecutive ranks: member i's ranks follow member i-1's, so the
    leader's first process is rank 0. ``holder`` is which of a member's ranks
    holds the state it offered (after a failure one may have finished the
    update in flight that the others did not)."""
    number: int
    members: tuple
    index: int
    store: object
    source: int = 0
    lineage: tuple = ()

    @property
    def world_size(self):
        return sum(_ranks(m) for m in self.members)

    @property
    def ids(self):
        return [m["id"] for m in self.members]

    def first_rank(self, index=None):
        """Rank of the first process of member ``index`` (default: this node)."""
        index = self.index if index is None else index
        return sum(_ranks(m) for m in self.members[:index])

    @property
    def source_rank(self):
        """The rank whose state every rank takes."""
        return self.first_rank(self.source) + self.members[self.source].get("holder", 0)

    def member_of(self, rank):
        """Index of the member that runs ``rank`` (one pass over the members:
        mark_lost asks it for every lost rank)."""
        end = 0
        for index, member in enumerate(self.members):
            end += _ranks(member)
            if rank < end:
                return index
        raise ValueError(f"rank {rank} is not in generation {self.number} "
                         f"({self.world_size} ranks)")

    def addresses(self):
        """Each rank's host address, in rank order."""
        return [m["addr"] for m in self.members for _ in range(_ranks(m))]


def _ranks(member):
    return member.get("ranks", 1)


MAX_RANKS = 1024    # processes of one node: more than any machine has GPUs


def well_formed(member):
    """Whether a participant's ``ranks`` and ``holder`` are sizes a round
    may use (a member's word, but it sizes lists and the process group)."""
    ranks, holder = member.get("ranks", 1), member.get("holder", 0)
    return (type(ranks) is int and 1 <= ranks <= MAX_RANKS and type(holder) is int
            and 0 <= holder < ranks)


def has_quorum(previous, arrived_ids):
    """Whether the nodes ``arrived_ids`` may close a round after the
    generation ``previous`` (None: a fresh start, no quorum needed)."""
    if previous is None:
        return True
    old = previous.ids
    present = sum(1 for i in old if i in arrived_ids)
    return 2 * present > len(old) or (2 * present == len(old) and old[0] in arrived_ids)


def quorum_text(previous, arrived_ids):
    """What a round without a quorum had, for the message."""
    old = previous.ids
    present = sum(1 for i in old if i in arrived_ids)
    return (f"{present} of the {len(old)} members of generation {previous.number} (a quorum is "
            "more than half, or half with its rank 0)")


def ordered(arrived, leader_id, previous, max_nodes=0):
    """The members in rank order: the leader, then the previous generation's
    members in their old order, then everyone else (newcomers, nodes back
    from a pause) in order of arrival; then the first ``max_nodes`` (0: all).
    Ordered first, cut second: the leader, whose store holds the round,
    and the members that train now keep their places; newcomers wait."""
    old_rank = {m["id"]: r for r, m in enumerate(previous.members)} if previous else {}
    lead = [m for m in arrived if m["id"] == leader_id]
    old = sorted((m for m in arrived if m["id"] in old_rank and m["id"] != leader_id),
                 key=lambda m: old_rank[m["id"]])
    new = [m for m in arrived if m["id"] not in old_rank and m["id"] != leader_id]
    return (lead + old + new)[:max_nodes or None]


def on_line(a, b):
    """Whether lineages ``a`` and ``b`` are of one line (one a prefix of the other)."""
    a, b = list(a), list(b)
    shorter = min(len(a), len(b))
    return a[:shorter] == b[:shorter]


def choose_source(members, line=None):
    """(source rank, [ids whose state is refused]) for ``members`` in rank
    order, each with "updates" (-1: no state) and "lineage". ``line``: the
    lineage of the previous generation (None: a fresh start, where the
    newest state of all sets the line)."""
    def newness(rank):
        m = members[rank]
        return (m["updates"] >= 0, len(m["lineage"]), m["updates"], -rank)
    holders = [r for r, m in enumerate(members) if m["updates"] >= 0]
    if line is None and holders:
        line = members[max(holders, key=newness)]["lineage"]
    refused = [members[r]["id"] for r in holders
               if line is not None and not on_line(members[r]["lineage"], line)]
    candidates = [r for r in range(len(members)) if members[r]["id"] not in refused]
    return max(candidates, key=newness), refused


def new_lineage(source_lineage, number):
    """The lineage of generation ``number`` continuing from a state with
    ``source_lineage``."""
    return [*source_lineage, f"{number}-{secrets.token_hex(8)}"]
