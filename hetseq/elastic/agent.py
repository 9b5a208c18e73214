"""An elastic node (--elastic): train in generations and carry the state
across them, so the job goes on while members are lost or join. The node's
first process meets for it (membership.py) and sends its other processes
their places over a pipe; each generation's Run talks to it through one
seam (run/seam.py; elastic/hooks.py's Elastic). Each generation starts
from the newest state on the job's line, so the next update is the one a
single process would make next (docs/elastic.md says why that is exact)."""

import dataclasses
import gc
import importlib
import logging
import os
import socket

import torch.distributed as dist

from hetseq.distributed import health, rendezvous
from hetseq.distributed.spawn import (PRELOAD, DistContext, WorkerFailed, cuda_devices,
                                      device_of, exit_now, set_threads, start_linked)
from hetseq.distributed.topology import resolve_elastic
from hetseq.elastic.generations import choose_source
from hetseq.elastic.membership import JobDone, Membership, TooFew
from hetseq.elastic.place import Place
from hetseq.elastic.hooks import RECORD, Elastic
from hetseq.run.seam import GenerationOver, Reconfigure
from hetseq.base.errors import HetSeqError, PeerLost, UserError
from hetseq.base.logs import NODE, rank_ranges, setup_logging
from hetseq.reporting import status
from hetseq.store import job_secret
from hetseq.checkpoints import files as checkpoint_files
from hetseq.run.loop import Run
from hetseq.checkpoints.keys import CONTROLLER, UPDATES

logger = logging.getLogger("hetseq.elastic.agent")
FINISHED_S = 5.0     # how long a rank whose last barrier failed asks rank 0's store


class TooFewNodes(PeerLost):
    """Fewer than --min-nodes nodes for --distributed-timeout: saved and stopped."""


@dataclasses.dataclass(frozen=True)
class Ended:
    """How one process's part of a generation ended, and the state it holds
    now (``updates`` -1: none; ``lineage`` and ``known``: generations.py)."""
    finished: bool
    updates: int
    lineage: list
    known: list
    lost: tuple = ()       # ranks its heartbeats found lost


def train_elastic(args, job, node, inputs):
    """Train this node's ranks across generations, as its first process."""
    # Salted with the job id of the URL this node was given (job_secret.job_id).
    secret = job_secret.read_secret(node.launch.job_secret_file,
                                    url=node.launch.distributed_init_method)
    if secret is None:
        raise UserError("--elastic needs a job secret, since nodes join by themselves: set "
                        "HETSEQ_JOB_SECRET or --job-secret-file on every node "
                        f"({job_secret.MAKE_ONE} makes one)")
    # This process trains the first process's rank: it imports what the first update
    # needs (seconds of CPU) before it meets, not while members wait
    # for it in a new generation.
    for module in PRELOAD:
        importlib.import_module(module)
    topology = resolve_elastic(node.launch, cuda_devices(node.launch), job.distributed_backend)
    membership = Membership(node.launch, topology.backend, secret, job.elastic.min_nodes,
                            job.elastic.max_nodes, job.identity(), ranks=topology.nprocs)
    work = (args, job, node, inputs, topology)
    others = [start_linked(local, _run_other_process, (*work, membership.binding, secret),
                           topology.device_type, "hetseq.run.loop")
              for local in range(1, topology.nprocs)]
    try:
        _run_first_process(membership, others, *work)
    finally:
        for process, conn in others:
            conn.close()              # another process still waiting reads the end of the pipe
            process.join(30)
            if process.is_alive():
                process.kill()


def _run_first_process(membership, others, args, job, node, inputs, topology):
    """The first process's loop: meet for the node, tell the node's other
    processes where they stand, train its own rank."""
    set_threads(topology)
    device = device_of(topology, 0)
    state = _own_checkpoint(node.save)
    ends = [_ended(False, state)] + [_end_of(local, f) for local, f in enumerate(others, 1)]
    while True:
        holder = _newest(ends)
        try:
            generation = membership.meet(ends[holder].updates, ends[holder].lineage,
                                         ends[holder].known, holder)
        except TooFew as err:
            _save_alone(state, node.save)
            raise TooFewNodes(f"--elastic: {err}; stopped. Start more nodes with the same "
                              "command to resume from the newest checkpoint") from None
        except JobDone as done:
            logger.warning("--elastic: %s before this node could join", done)
            return
        for _, conn in others:
            conn.send(dataclasses.replace(generation, store=None))
        place = Place(generation, 0, membership.binding, node.launch.distributed_timeout)
        ended, state = _serve(place, state, device, args, job, node, inputs, topology)
        ends = [ended] + [_end_of(local, f) for local, f in enumerate(others, 1)]
        if ended.finished:
            return
        membership.mark_lost({rank for end in ends for rank in end.lost})


def _run_other_process(local, conn, args, job, node, inputs, topology, binding, secret):
    """Process ``local`` (1 and up) of a node: train where the first process says,
    each generation, until the job ends or the first process does."""
    from hetseq.tasks import import_builtin_tasks, import_user_dir
    try:
        import_builtin_tasks()
        import_user_dir(node.user_dir)   # a started process begins with an empty registry
        set_threads(topology)
        device = device_of(topology, local)
        state = None
        conn.send(_ended(False, state))
        while True:
            try:
                generation = conn.recv()
            except EOFError:          # the first process ended: the job, or this node, is over
                return
            place = Place.joining(generation, local, binding, node.launch.distributed_timeout,
                                  secret)
            ended, state = _serve(place, state, device, args, job, node, inputs, topology)
            conn.send(ended)
            if ended.finished:
                return
    except HetSeqError as err:
        logging.getLogger("hetseq").error("process %d of this node: %s", local, err)
        exit_now(err.exit_code)


def _end_of(local, other):
    """How process ``local``'s part ended (what it sent); WorkerFailed when
    it ended instead."""
    process, conn = other
    try:
        return conn.recv()
    except (EOFError, OSError):
        process.join(10)
        code = process.exitcode
        if code is not None and code < 0:
            raise WorkerFailed(PeerLost.exit_code, f"process {local} of this node was killed by "
                               f"signal {-code}: the node leaves the job") from None
        raise WorkerFailed(code or 1, f"process {local} of this node ended with exit code "
                           f"{code}: the node leaves the job") from None


def _newest(ends):
    """Which of a node's processes holds the newest state (they train one
    trajectory; after a failure one may hold an update more)."""
    offered = [{"id": i, "updates": e.updates, "lineage": e.lineage} for i, e in enumerate(ends)]
    return choose_source(offered)[0]


def _serve(place, state, device, args, job, node, inputs, topology):
    """This process's part of ``place``'s generation: (Ended, the state it
    holds now). ``state``: what it held before (the source's goes to all)."""
    setup_logging(place.rank, all_ranks=node.log.log_all_ranks, node_first=place.local == 0)
    gen = place.generation
    board = status.StatusBoard(
        place.store, [m["host"] for m in gen.members for _ in range(m.get("ranks", 1))],
        gen.number, nodes=[m.get("node") or m["host"] for m in gen.members
                           for _ in range(m.get("ranks", 1))]) if place.rank == 0 else None
    ctx = DistContext(place.rank, place.world_size, device.index or 0, device, topology.backend,
                      topology.nprocs, node.launch.distributed_timeout, board)
    run, mine, watch, back = None, state, None, None
    seam = Elastic(place, lambda: mine, split=job.sharding.zero > 0 and place.world_size > 1)
    try:
        place.process_group(topology.backend)
        watch = place.watchdog(job.elastic.heartbeat_timeout)
        run = Run(args, job, node, ctx, inputs, seam)
        run.train()
    except Reconfigure:
        state = seam.snapshot()
    except (RuntimeError, GenerationOver) as err:
        if isinstance(err, RuntimeError) and not health.is_communication_error(err):
            raise
        if watch is not None:
            watch.end()     # the ranks still blocked in a collective stop waiting
        why = f"a collective failed ({str(err).strip().splitlines()[0][:160]})" \
            if isinstance(err, RuntimeError) else "the heartbeats told it between inner steps"
        logger.warning("generation %d ended: %s", gen.number, why)
        if run is not None:
            state, back = seam.snapshot(), seam.went_back()
    else:
        updates = run.controller.num_updates
        run = seam = mine = None  # the model and states go before the group does
        _leave(place, updates, watch)
        if place.local == 0:
            ranks = range(place.rank, place.rank + topology.nprocs)
            NODE.info("node %s finished its part: rank%s %s after %d updates",
                      socket.gethostname(), "s" if len(ranks) > 1 else "", rank_ranges(ranks),
                      updates)
        return Ended(True, updates, [], []), None
    lost = _stop(watch)
    if back and back[0] > back[1] and place.local == 0:
        _went_back(gen.number, back, job.sharding.zero, lost)
    # Objects holding the process group (DDP) go before the group does.
    run = seam = mine = None
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    return _ended(False, state, lost), state


def _went_back(number, back, zero, lost):
    """Under a split state a lost member took its shard along: the node
    offers its newest full state, ``back`` = (updates completed, its updates)."""
    completed, kept = back
    who = f"rank{'s' if len(lost) > 1 else ''} {rank_ranges(lost)}" if lost else "a member"
    logger.warning("generation %d ended: went back %d updates to update %d: the state was "
                   "split (--zero %d) and %s was lost; save more often (--save-interval-updates) "
                   "to lose less", number, completed - kept, kept, zero, who)


def _ended(finished, state, lost=()):
    return Ended(finished, _updates(state), *_line(state), tuple(lost))


def _stop(watch):
    """Stop this generation's heartbeats; the ranks they found lost."""
    if watch is None:
        return ()
    watch.stop()
    return tuple(watch.lost)


def _updates(state):
    """How many updates a carried state holds (-1: none; never the source)."""
    return -1 if state is None else int(state[CONTROLLER.name][UPDATES])


def _line(state):
    """(lineage, members) that a carried state names: the chain of
    generations that trained it, and where their members served."""
    record = (state or {}).get(RECORD) or {}
    return record.get("lineage", []), record.get("members", [])


def _own_checkpoint(save):
    """This node's own newest checkpoint: the first generation takes the
    newest one any member has (no shared disk is needed)."""
    path = checkpoint_files.restore_path(save)
    return checkpoint_files.load(path) if os.path.exists(path) else None


def _save_alone(state, save):
    if state is None or save.no_save:
        return
    checkpoint_files.check_save_dir(save.save_dir)
    path = os.path.join(save.save_dir, "checkpoint_last.pt")
    checkpoint_files.save(path, state)
    logger.warning("saved %s (%d updates)", path, _updates(state))


def _finished(place):
    """Whether rank 0 said it finished (its last save and export written): a
    bounded read of its store, False when the store is gone with it."""
    try:
        return health.within(FINISHED_S, lambda: place.store.check(["e/finished"]))
    except Exception:     # rank 0 lost before it finished: not a finished job
        return False


def _leave(place, updates, watch):
    """The end of the job: every rank passes one barrier and lets go of the
    group; rank 0 serves the store (it is the leader's first process), so it tells a
    node still waiting to join that the job is over and waits until the
    others left it. Heartbeats stop only after the barrier: a rank still
    saving or exporting would otherwise find the others silent and cut them."""
    gc.collect()
    if place.rank == 0:
        place.store.set("e/finished", str(updates))    # its last save is written
    try:
        dist.barrier()
    except RuntimeError as err:     # a member lost after its last update
        if not (health.is_communication_error(err) and _finished(place)):
            raise
        logger.warning("a member left before the job's last barrier (%s); rank 0 finished "
                       "its part, and so did this rank", str(err).strip().splitlines()[0][:160])
    _stop(watch)
    dist.destroy_process_group()
    if place.rank == 0:
        place.store.set("e/done", f"the job finished after {updates} updates")
    rendezvous.leave(place.store, place.rank, place.world_size)
