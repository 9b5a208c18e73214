"""Start this node's processes and give each one its rank and device.

``launch(node, backend, worker, ...)`` runs ``worker(ctx, ...)`` once per
local rank: in this process when the node runs one rank, else in spawned
children. A user
error in any child (a ``UserError``) ends the whole command with its message
and exit code 2; a crash ends it with the child's traceback and exit code 1.
"""

import contextlib
import dataclasses
import datetime
import gc
import importlib
import logging
import multiprocessing
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

from hetseq.distributed import health, meeting_point, rendezvous
from hetseq.distributed.topology import resolve_topology
from hetseq.base import stopping
from hetseq.base.errors import HetSeqError, PeerLost
from hetseq.base.logs import NODE, rank_ranges, setup_logging
from hetseq.store import job_secret

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistContext:
    """What one process knows about its place in the job."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None
    local_world_size: int = 1    # ranks on this node (they share its memory)
    timeout_s: float | None = None   # --distributed-timeout: groups made later take it too
    board: object = None         # rank 0: its StatusBoard (hetseq-status), else None
    # Read every update: fields computed once, not properties.
    is_main: bool = dataclasses.field(init=False)       # rank 0
    distributed: bool = dataclasses.field(init=False)   # more than one rank

    def __post_init__(self):
        object.__setattr__(self, "is_main", self.rank == 0)
        object.__setattr__(self, "distributed", self.world_size > 1)


class WorkerFailed(Exception):
    def __init__(self, exit_code, message):
        super().__init__(message)
        self.exit_code = exit_code


def node_topology(node, backend):
    """This node's ranks (topology.py), from its flags or its launcher's variables."""
    return resolve_topology(node.launch, os.environ, cuda_devices(node.launch), backend)


def cuda_devices(launch):
    """The GPUs this node trains on (0 with --cpu). Without --cpu and without
    a GPU the node says so once: CPU is then what it runs on, not a choice."""
    if launch.cpu:
        return 0
    count = torch.cuda.device_count()
    if count == 0:
        NODE.warning("no GPU found on this node: it trains on CPU (pass --cpu to say that "
                     "is meant and silence this line)")
    return count


def node_label(topology):
    """The log prefix of this node's own process: 'rank 1', 'rank 2-3'."""
    return f"rank {rank_ranges(range(topology.first_rank, topology.first_rank + topology.nprocs))}"


def launch(node, backend, worker, *worker_args, identity=None, board=None, topology=None):
    """Run ``worker(ctx, *worker_args)`` on every rank this node owns.
    ``node``: the NodeConfig (config.py); ``backend``: the job's
    --distributed-backend; ``identity``: what every node must agree on to
    join (``JobConfig.identity()``); ``board(store, hosts, nodes=)``: rank 0's
    status board in a job of several ranks (ctx.board), made by the caller
    so that start-up does not depend on the view (reporting/status.py);
    ``topology``: ``node_topology``'s, when the caller has it.

    Returns the worker's result when it ran in this process (one local rank).
    """
    # A bad one: exit 2 before spawning.
    secret = job_secret.read_secret(node.launch.job_secret_file,
                                    url=node.launch.distributed_init_method)
    topology = topology or node_topology(node, backend)
    if topology.nprocs == 1:
        return _run_rank(0, topology, node, identity, worker, worker_args, board)
    with _hosted_store(topology, secret) as (topology, serve, listener):
        try:
            start_ranks(_spawned_rank, (topology, node, identity, worker, worker_args, board),
                        topology.nprocs, topology.device_type, worker.__module__,
                        then=serve, not_inherited=listener)
        except mp.ProcessExitedException as err:
            raise _exited(topology.first_rank + err.error_index, err) from None
        except mp.ProcessRaisedException as err:
            raise WorkerFailed(1, f"rank {topology.first_rank + err.error_index} failed:\n{err}") \
                from None


# What every rank imports before it trains (torch.optim's first param group
# imports torch._dynamo; --zero 3 needs FSDP); for the fork server also its
# quick end once the command that started it has ended (quick_exit.py,
# never imported by a command: it would end with code 0).
RANK_MODULES = ("torch", "torch._dynamo", "torch.distributed.fsdp")
PRELOAD = (*RANK_MODULES, "hetseq.distributed.quick_exit")


def start_method(device_type, *modules):
    """How to start ranks on ``device_type``. CPU ranks fork from this
    process while it has one thread (it imported torch already, so they
    start at no cost; no other thread can hold a lock the copy inherits);
    else from a fork server that imported PRELOAD and ``modules`` once, in a
    fresh process of its own (a spawned rank would import them again, each:
    docs/design.md gives the cost). CUDA ranks are spawned: a process forked
    after an import touched the CUDA driver cannot use it."""
    if device_type == "cuda":
        return "spawn"
    modules = [m for m in modules if m != "__main__"]
    if threads_here() == 1:
        for name in (*RANK_MODULES, *modules):      # once here, not once per rank
            importlib.import_module(name)
        if threads_here() == 1:                     # an import may have started one
            return "fork"
    multiprocessing.set_forkserver_preload([*PRELOAD, *modules])
    return "forkserver"


def threads_here():
    """This process's threads, native ones too (a store's, an OpenMP pool's),
    as Linux lists them; 0 where it cannot tell (another system)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def start_linked(index, fn, args, device_type="cpu", *modules):
    """Start ``fn(index, conn, *args)`` in a process of its own (started as
    ``start_method`` says, with this process's environment of now), ``conn``
    being its end of a pipe to this process; returns (process, this end).
    Not waited for. When either process ends, the other's next read of the
    pipe fails (EOFError), since nobody else holds its ends."""
    method = start_method(device_type, *modules)
    context = mp.get_context(method)
    mine, theirs = context.Pipe()
    process = context.Process(target=_in_environment,
                              args=(index, dict(os.environ), (), stopping.shared(), fn,
                                    (theirs, *args)))
    with _frozen_for(method):
        process.start()
    theirs.close()
    return process, mine


@contextlib.contextmanager
def _frozen_for(method):
    """Around a fork: this process's objects (torch's modules, mostly) go to
    the collector's permanent generation first, so that a rank's collections
    (one at least, at its end) never walk them. Walking them writes to every
    page they sit on, which the kernel then copies into the rank (a 2-rank
    toy command: 0.85x the CPU, bench/rank_start.py). Here they go back to
    the collector once the ranks started: a caller that goes on (a library
    user, a test) must still reclaim the cycles it drops."""
    if method != "fork":
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def start_ranks(fn, args, nprocs, device_type="cpu", *modules, then=None, not_inherited=()):
    """Run ``fn(index, *args)`` in ``nprocs`` processes started as
    ``start_method`` says, with this process's environment of now (a fork
    server's children would otherwise inherit its environment of when it
    started); call ``then()`` once they started (a thread it starts is not
    in their copy); wait for all of them. ``not_inherited``: file
    descriptors a forked rank closes at once (a listener of this process)."""
    method = start_method(device_type, *modules)
    # Only a forked rank has these: in another, the same numbers may be its own.
    inherited = tuple(not_inherited) if method == "fork" else ()
    with _frozen_for(method):
        context = mp.start_processes(_in_environment, nprocs=nprocs, join=False,
                                     args=(dict(os.environ), inherited, stopping.shared(), fn,
                                           args),
                                     start_method=method)
    try:
        if then is not None:
            then()
    except BaseException:
        for process in context.processes:       # they would wait for a store never served
            process.kill()
        raise
    while not context.join():
        pass


def _in_environment(index, environ, not_inherited, stop, fn, args):
    # A signal to the node (a terminal's Ctrl-C reaches every process) is
    # recorded here; the node's process answers it (base/stopping.py).
    stopping.adopt(stop)
    for fd in not_inherited:
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    fn(index, *args)


def _exited(rank, err):
    """A spawned rank that ended without a HetSeq error of its own. Killed by a
    signal (the OOM killer, kill -9): a lost peer, exit 3, not the signal's
    number passed on (which the shell shows as 247 and the like)."""
    if err.exit_code is not None and err.exit_code < 0:
        return WorkerFailed(PeerLost.exit_code, f"rank {rank} (pid {err.error_pid}) was killed by "
                            f"signal {err.signal_name}; the other ranks of this node stop too")
    return WorkerFailed(err.exit_code or 1, f"rank {rank} exited with code {err.exit_code}")


@contextlib.contextmanager
def _hosted_store(topology, secret=None):
    """A single-node job with no init method meets at a TCP store served by this
    parent on a port the OS picks: free by construction, no guessed numbers.
    With a job secret it is behind the gate, so other users of this host
    cannot reach it either.
    Yields (topology, serve, fds): ``serve()`` starts serving once the ranks
    started (they fork while this process has one thread: spawn.start_method),
    ``fds`` the listener's, which a forked rank closes."""
    if topology.init_method is not None:
        yield topology, None, ()
        return
    listener, served = meeting_point.loopback_listener(), []
    port = listener.getsockname()[1]

    def serve():
        served.append(meeting_point.loopback_store(
            topology.world_size, datetime.timedelta(seconds=60), secret, listener))

    yield (dataclasses.replace(topology, init_method=f"tcp://127.0.0.1:{port}", store_hosted=True),
           serve, (listener.fileno(),))
    served.clear()       # the store stops with its last reference


def _spawned_rank(index, topology, node, identity, worker, worker_args, board):
    try:
        _run_rank(index, topology, node, identity, worker, worker_args, board)
    except HetSeqError as err:
        logging.getLogger("hetseq").error("rank %d: %s", topology.first_rank + index, err)
        exit_now(err.exit_code)


def exit_now(code):
    """Exit with ``code`` at once, the log and standard streams flushed:
    after a lost peer, tearing down the process group at interpreter exit
    can abort the process and hide the code; after a finished job the
    teardown only frees torch's modules, seconds of CPU."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(index, topology, node, identity, worker, worker_args, board=None):
    rank = topology.first_rank + index
    setup_logging(rank, all_ranks=node.log.log_all_ranks, node_first=index == 0)
    set_threads(topology)
    device = device_of(topology, index)
    ctx = DistContext(rank, topology.world_size, topology.first_device + index, device,
                      topology.backend, topology.local_world_size,
                      node.launch.distributed_timeout)
    if not ctx.distributed:
        return worker(ctx, *worker_args)
    store, peers = rendezvous.init_process_group(
        topology, rank, node.launch.distributed_timeout, node.launch.distributed_interface,
        identity, job_secret.read_secret(node.launch.job_secret_file))
    heartbeat = health.Heartbeat(store, rank)
    if rank == 0 and board is not None:
        ctx = dataclasses.replace(ctx, board=board(
            store, [peers[r]["host"] for r in range(ctx.world_size)],
            nodes=[peers[r].get("node") or peers[r]["host"] for r in range(ctx.world_size)]))
    try:
        result = worker(ctx, *worker_args)
    except RuntimeError as err:
        if not health.is_communication_error(err):
            raise
        raise health.peer_lost(err, store, rank, ctx.world_size, peers) from None
    finally:
        heartbeat.stop()
    # Objects holding the process group (DDP) must be gone before it is
    # destroyed; reference cycles would keep them to interpreter exit, where
    # tearing down gloo's threads aborts the process.
    gc.collect()
    rendezvous.shutdown(topology, rank, store)
    if index == 0:
        NODE.info("node %s finished its part: ranks %s", socket.gethostname(),
                  rank_ranges(range(rank, rank + topology.nprocs)))
    return result


def set_threads(topology):
    # Several CPU ranks on one node share its cores; oversubscribing them makes
    # every rank slower. An explicit OMP_NUM_THREADS wins.
    if topology.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topology.local_world_size))


def device_of(topology, index):
    """The device of this node's process ``index``."""
    if topology.device_type == "cuda":
        device = torch.device("cuda", topology.first_device + index)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
