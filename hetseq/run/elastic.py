"""An elastic node (--elastic): train in generations, carry the state across.

A node runs one rank. Each generation (distributed/membership.py says how the
members meet) starts a process group and a fresh ``Run`` whose state comes
from one member: the one holding the most completed updates. Every member
then holds that state, so the job continues on the same trajectory:

- a member lost (killed, frozen, cut off): the survivors' collective fails
  (at once when it was killed; within --heartbeat-timeout when it froze or
  was cut off, since its heartbeat stops and the survivors cut their
  connections to it, health.Watchdog; else after --distributed-timeout),
  each takes a *snapshot* of the last update it completed, and they meet
  again;
- a node asking to join: rank 0 sees it in its store and says so in the
  update's stats; after that update every member snapshots and they meet
  again, the newcomer included;
- too few nodes (below --min-nodes) for --distributed-timeout: each node
  writes its snapshot to its own --save-dir and stops (exit 3); starting
  the nodes again resumes from the newest of them.

Why the result is exact: an update either completed on every member or on
none before the failure was seen (the optimizer steps only after all of the
update's collectives), except that some members may have completed update
k+1 while others failed inside it; taking the state with the most updates
covers that case. The data position is part of the state and counts samples
of the world-independent global batches (data/iterators.py), and the global
batch never changes with the members, so the next update is the one a single
process would make next.
"""

import gc
import logging
import os
import socket

import torch
import torch.distributed as dist

from hetseq.distributed import health, rendezvous, tunnel
from hetseq.distributed.launch import DistContext
from hetseq.distributed.membership import JobDone, Membership, TooFew
from hetseq.errors import PeerLost, UserError
from hetseq.reporting import NODE, setup_logging
from hetseq.run import checkpoint
from hetseq.update.controller import CONTROLLER, UPDATES

logger = logging.getLogger("hetseq.run.elastic")


class Reconfigure(Exception):
    """Raised at an update boundary when a node asked to join."""


class TooFewNodes(PeerLost):
    """Fewer than --min-nodes nodes for --distributed-timeout: saved and stopped."""


def train_elastic(make_run, job, node):
    """Train this node's rank across generations. ``make_run(ctx, restore,
    membership)`` builds a Run (train.py) that takes its state from
    ``restore`` = (source rank, callable giving the state there, the
    lineage that state must have)."""
    secret = tunnel.read_secret(node.launch.job_secret_file)
    if secret is None:
        raise UserError("--elastic needs a job secret, since nodes join by themselves: set "
                        f"HETSEQ_JOB_SECRET or --job-secret-file on every node ({tunnel.MAKE_ONE} "
                        "makes one)")
    device = _device(node.launch)
    backend = job.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    membership = Membership(node.launch, backend, secret, job.elastic.min_nodes,
                            job.elastic.max_nodes, job.identity())
    carried = _own_checkpoint(node.save)
    while True:
        try:
            generation = membership.meet(_updates(carried), *_line(carried))
        except TooFew as err:
            _save_alone(carried, node.save)
            raise TooFewNodes(f"--elastic: {err}; stopped. Start more nodes with the same "
                              "command to resume from the newest checkpoint") from None
        except JobDone as done:
            logger.warning("--elastic: %s before this node could join", done)
            return
        setup_logging(generation.rank, all_ranks=node.log.log_all_ranks, node_first=True)
        ctx = DistContext(generation.rank, generation.world_size, device.index or 0, device,
                          backend, 1)
        run, mine, watch = None, carried, None
        try:
            membership.process_group(backend)
            watch = membership.watchdog(job.elastic.heartbeat_timeout)
            source = generation.members[generation.source]["lineage"]
            run = make_run(ctx, (generation.source, lambda: mine, source), membership)
            run.train()
        except Reconfigure:
            carried = run.snapshot()
        except RuntimeError as err:
            if not health.is_communication_error(err):
                raise
            logger.warning("generation %d ended: a collective failed (%s)", generation.number,
                           str(err).strip().splitlines()[0][:160])
            carried = run.snapshot() if run is not None else carried
        else:
            updates = run.controller.num_updates
            del run, mine
            _leave(membership, generation, updates, watch)
            NODE.info("node %s finished its part: rank %d after %d updates",
                      socket.gethostname(), generation.rank, updates)
            return
        _stop(watch, membership)
        # Objects holding the process group (DDP) go before the group does.
        del run, mine
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(watch, membership=None):
    """Stop this generation's heartbeats; tell ``membership`` whom they found lost."""
    if watch is not None:
        watch.stop()
        if membership is not None:
            membership.mark_lost(watch.lost)


def _device(launch):
    """This node's one device: its --device-id GPU, or the CPU."""
    if launch.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", launch.device_id)
    torch.cuda.set_device(device)
    return device


def _updates(state):
    """How many updates a carried state holds (-1: none; never the source)."""
    return -1 if state is None else int(state[CONTROLLER.name][UPDATES])


def _line(state):
    """(lineage, members) that a carried state names: the chain of
    generations that trained it, and where their members served."""
    record = (state or {}).get("elastic") or {}
    return record.get("lineage", []), record.get("members", [])


def _own_checkpoint(save):
    """This node's own newest checkpoint: the first generation takes the
    newest one any member has (no shared disk is needed)."""
    path = checkpoint.restore_path(save)
    return checkpoint.load(path) if os.path.exists(path) else None


def _save_alone(state, save):
    if state is None or save.no_save:
        return
    checkpoint.check_save_dir(save.save_dir)
    path = os.path.join(save.save_dir, "checkpoint_last.pt")
    checkpoint.save(path, state)
    logger.warning("saved %s (%d updates)", path, _updates(state))


def _leave(membership, generation, updates, watch):
    """The end of the job: every member passes one barrier and lets go of the
    group; rank 0 serves the store, so it waits until the others left it.
    Heartbeats stop only after the barrier: a member still saving or
    exporting would otherwise find the others silent and cut them."""
    gc.collect()
    dist.barrier()
    _stop(watch)
    dist.destroy_process_group()
    membership.finish(updates)
    rendezvous.leave(generation.store, generation.rank, generation.world_size)
