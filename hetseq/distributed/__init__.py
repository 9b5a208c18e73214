"""Start-up: which ranks this command runs, the meeting point, rendezvous,
starting the ranks (spawn.py), collectives. Only the small collectives are
re-exported here, so that the update's importers load nothing of start-up;
everything else is imported from its module.
Layer 5: imports base, store. Tests: tests/unit/distributed/, tests/system/."""

from hetseq.distributed.collectives import all_gather_object, broadcast_from_main

__all__ = ["all_gather_object", "broadcast_from_main"]
