"""A process's place in one generation of an elastic job (membership.py
makes the generations): its rank, the leader's store, its heartbeats and
the generation's process group."""

import dataclasses
import datetime

import torch.distributed as dist

from hetseq.distributed import meeting_point, network
from hetseq.elastic.watchdog import Watchdog


class Place:
    """One process's place in a generation: rank ``first_rank() + local``,
    ``local`` being its index among its node's processes. The node's process
    0 (elastic/agent.py) meets for the node and reaches the
    leader's store through its Membership; the node's other processes
    connect to that store themselves (``Place.joining``)."""

    def __init__(self, generation, local, binding, timeout_s):
        self.generation, self.local = generation, local
        self.binding, self.timeout_s = binding, timeout_s
        self.rank = generation.first_rank() + local
        self.watch = None         # this process's Watchdog, once it starts

    @classmethod
    def joining(cls, generation, local, binding, timeout_s, secret):
        """A place of one of the node's other processes: ``generation`` as
        the node's process 0 sent it (no store), with a connection of its own."""
        leader = generation.members[0]
        store = meeting_point.join_meeting_point((leader["addr"], leader["port"]), secret,
                                              timeout_s)
        return cls(dataclasses.replace(generation, store=store), local, binding, timeout_s)

    @property
    def world_size(self):
        return self.generation.world_size

    @property
    def store(self):
        return self.generation.store

    def record(self):
        """What a checkpoint of this generation keeps: its lineage and where
        its members serve (a node restarted from it asks them first)."""
        gen = self.generation
        return {"lineage": list(gen.lineage),
                "members": [{"addr": m["addr"], "port": m["port"]} for m in gen.members]}

    def join_waiting(self):
        """Rank 0 only: whether a node asked to join (read once per update)."""
        return self.rank == 0 and self.store.check(["e/join"])

    def watchdog(self, timeout_s):
        """This process's heartbeats (a Watchdog, on a connection of its
        own to the leader's store); None when --heartbeat-timeout is 0."""
        if not timeout_s:
            return None
        gen = self.generation
        self.watch = Watchdog(gen.store.clone(), self.rank, gen.addresses(),
                              self.binding.address, timeout_s, prefix=f"e/{gen.number}",
                              spare={m["port"] for m in gen.members})
        return self.watch

    def over(self):
        """Whether the heartbeats already know this generation is over: a
        member told lost, or a rank's collective failed. Read between the
        inner steps of --local-steps, which make no collective that could
        fail (two attribute reads: no network)."""
        watch = self.watch
        return watch is not None and (watch.ended or bool(watch.lost))

    def process_group(self, backend):
        """Start this generation's process group (its own key prefix, so a
        round never reads an earlier round's keys)."""
        gen = self.generation
        network.apply(self.binding, backend)
        dist.init_process_group(backend, store=dist.PrefixStore(f"e/{gen.number}/pg", gen.store),
                                rank=self.rank, world_size=gen.world_size,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
