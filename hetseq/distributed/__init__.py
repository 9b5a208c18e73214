"""Distributed start-up: topology from flags/env, rendezvous, spawning, collectives."""

from hetseq.distributed.collectives import all_gather_object, broadcast_from_main
from hetseq.distributed.launch import DistContext, WorkerFailed, launch
from hetseq.distributed.topology import Topology, resolve_topology

__all__ = ["DistContext", "Topology", "WorkerFailed", "all_gather_object", "broadcast_from_main",
           "launch", "resolve_topology"]
