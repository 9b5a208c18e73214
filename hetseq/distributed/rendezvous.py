"""The rendezvous of all ranks: the meeting point's store (meeting_point.py),
rank claims, then the process group; and leaving it.

We open the store ourselves (instead of passing the URL to
``init_process_group``) so that start-up problems get messages a user can act
on: a busy or unreachable master, a rank claimed by two nodes, ranks nobody
started, nodes that disagree on the world size. Each rank claims its number
with an atomic ``add`` and then waits, with a deadline, until all are there.
"""

import datetime
import json
import logging
import os
import socket
import time

import torch.distributed as dist

from hetseq.distributed import health, identity, network
from hetseq.distributed.meeting_point import Access, file_path, master_host, open_store
from hetseq.distributed.topology import node_name, ready_backend
from hetseq.base.errors import UserError
from hetseq.base.logs import NODE, Every, rank_ranges

logger = logging.getLogger(__name__)


def claim_rank(store, rank, world_size, url, address):
    """Take rank ``rank`` in the store and register {"host", "node", "pid",
    "world_size", "addr"} for it; another process holding it is a mistake."""
    me = {"host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
          "world_size": world_size, "addr": address}
    if store.add(f"hetseq/claim/{rank}", 1) != 1:
        raise UserError(
            f"rank {rank} was claimed by two processes (this one: {me['host']} pid {me['pid']}). "
            "Give each node its own --distributed-rank (the sum of --distributed-gpus of the "
            "nodes before it); with file:// a file left by an earlier job does this too: "
            f"delete it or use a new path ({url})")
    store.set(f"hetseq/who/{rank}", json.dumps(me))


def wait_for_ranks(store, prefix, world_size, deadline, url, rank=None):
    """{rank: value} of the JSON keys ``prefix/<rank>`` once every rank set its own.
    While waiting, ``rank``'s heartbeat advances (so a newcomer can tell a live
    job from a file left by a dead one)."""
    pending, values, beat_at = set(range(world_size)), {}, 0.0
    reminder = Every()
    while pending:
        for other in sorted(pending):
            key = f"{prefix}/{other}"
            try:
                if rank is not None and time.monotonic() >= beat_at:
                    store.add(health.beat_key(rank), 1)
                    beat_at = time.monotonic() + health.INTERVAL_S / 2
                present = store.check([key])
                value = json.loads(store.get(key)) if present else None
            except dist.DistError as err:
                raise UserError(f"lost the meeting point {url} while waiting for ranks "
                                f"{sorted(pending)}: the process serving it (rank 0) has stopped "
                                f"({str(err).splitlines()[0]}); see rank 0's message") from None
            if present:
                values[other] = value
                pending.discard(other)
        if pending and reminder.due():
            NODE.info("waiting at %s for ranks %s of %d: %.0f s left before "
                      "--distributed-timeout", url, rank_ranges(pending), world_size,
                      deadline - time.monotonic())
        if pending and time.monotonic() > deadline:
            raise UserError(
                f"timed out waiting at {url} for ranks {sorted(pending)} of {world_size}: "
                "start them, or check that each node's --distributed-rank and "
                "--distributed-gpus add up to --distributed-world-size")
        time.sleep(0.02)
    return values


def _check_peer(rank, info, world_size):
    if not (isinstance(info, dict) and isinstance(info.get("world_size"), int)
            and isinstance(info.get("host"), str)):
        # (What a peer registered: in a job without a secret, anyone's words.)
        raise UserError(f"rank {rank} registered at the meeting point in a form this HetSeq "
                        "does not read (another HetSeq version, or not a HetSeq node): install "
                        "the same HetSeq on every node")
    if info["world_size"] != world_size:
        raise UserError(f"rank {rank} ({info['host']}) runs with --distributed-world-size "
                        f"{info['world_size']} but this process with {world_size}; "
                        "pass the same world size on every node")


def init_process_group(topology, rank, timeout_s, interface=None, job=None, secret=None):
    """Meet the other ranks and start torch.distributed; returns the store and
    what every rank registered (host, pid, the address its collectives use).
    ``job``: the flags every node must agree on (refused before claiming a rank).
    ``secret``: the job secret (job_secret.JobSecret), or None; it is
    salted here with the job id of the URL every rank was given, the same
    on every rank whatever its flags (job_secret.job_id)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    url, world = topology.init_method, topology.world_size
    if secret is not None:
        secret = secret.for_url(url)
    access = Access(secret, interface, spans_hosts=world > topology.nprocs)
    store = open_store(url, rank, world, timeout, topology.store_hosted, access)
    master = master_host(url)
    binding = network.choose(master, interface, topology.backend)
    try:
        refuse_stale(store, world, url)
        if job is not None:
            identity.present(store, job, rank, url, f"{socket.gethostname()} pid {os.getpid()}",
                             time.monotonic() + timeout_s)
        claim_rank(store, rank, world, url, binding.address)
    except dist.DistError as err:
        raise UserError(f"lost the meeting point {url} while joining: the process serving it "
                        f"(rank 0) has stopped ({str(err).splitlines()[0]}); see rank 0's "
                        "message") from None
    try:
        return _meet(store, topology, rank, timeout, binding, master)
    except UserError:
        if rank == 0 and url.startswith("file://"):
            _remove(url)   # rank 0 ends this job: its file must not trap the next one
        raise


def _meet(store, topology, rank, timeout, binding, master):
    """After the claim: wait for every rank, settle addresses, start the group."""
    url, world, timeout_s = topology.init_method, topology.world_size, timeout.total_seconds()
    peers = wait_for_ranks(store, "hetseq/who", world, time.monotonic() + timeout_s, url, rank)
    for other, info in peers.items():
        _check_peer(other, info, world)
    binding = network.reconcile(binding, rank, peers, master is not None)
    deadline = time.monotonic() + timeout_s
    peers = network.check_reachability(
        store, rank, world, binding, peers,
        lambda prefix: wait_for_ranks(store, prefix, world, deadline, url, rank))
    network.apply(binding, topology.backend)
    ready_backend(topology.backend)
    dist.init_process_group(topology.backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=timeout)
    if rank == topology.first_rank:
        NODE.info("node %s joined the job at %s: ranks %s of %d (%s, ranks from %s) on %s %s: "
                  "%s", socket.gethostname(), url, rank_ranges(range(rank, rank + topology.nprocs)),
                  world, topology.backend, topology.launcher, binding.interface,
                  binding.address, binding.reason)
    if rank == 0:
        logger.info("network: %s", network.describe(peers))
    return store, peers


LEAVE_S = 30.0   # how long leaving may take once every rank passed the last barrier


def shutdown(topology, rank, store):
    """Leave the process group after a clean run. The ranks leave together: the
    process serving the TCP store (rank 0) waits until every rank has let go
    of it, since a client whose server vanished can abort at exit. Rank 0 then
    removes a file:// store file (a leftover file breaks the next job there);
    the others keep their store object, whose destructor would make it anew."""
    if not dist.is_initialized():
        return
    dist.barrier()                      # bounded by the process group's timeout
    dist.destroy_process_group()
    url = topology.init_method or ""
    leave(store, rank, topology.world_size)
    if url.startswith("file://"):
        if rank == 0:
            _remove(url)
        else:
            _KEPT.append(store)


# A file:// store's destructor opens its file again (FileStore counts there
# the processes done with it), which made the file anew when rank 0 had just
# removed it. The other ranks keep theirs to their end: a quick exit never
# runs it, and at a normal exit the file is long gone (it then does nothing).
_KEPT: list = []


def leave(store, rank, world_size):
    """Let go of the store; rank 0, which serves it, waits for the others."""
    try:
        _leave(store, rank, world_size)
    except (TimeoutError, dist.DistError) as err:   # the run itself is complete
        logger.warning("rank %d could not leave the meeting point cleanly: %s", rank, err)


def _leave(store, rank, world_size):
    # Store calls have no deadline of their own (TCPStore.add): bound each one.
    health.within(LEAVE_S, lambda: store.add("hetseq/left", 1))
    deadline = time.monotonic() + LEAVE_S
    while rank == 0 and time.monotonic() < deadline and \
            health.within(LEAVE_S, lambda: store.add("hetseq/left", 0)) < world_size:
        time.sleep(0.01)


def _remove(url):
    try:
        os.remove(file_path(url))
    except FileNotFoundError:
        pass


STALE_AFTER_S = 3 * health.INTERVAL_S   # a live member beats well within it


def refuse_stale(store, world_size, url):
    """A file:// meeting point outlives a job that was killed: a newcomer would
    take the dead job's registrations for live ranks and wait out the timeout.
    Its members' heartbeats (which advance every half second while they wait
    and every second while they train) tell: none advancing is a leftover."""
    if not url.startswith("file://") or not store.check(["hetseq/job"]):
        return
    members = [r for r in range(world_size) if store.check([f"hetseq/who/{r}"])]
    if not members:
        return
    before = [store.add(health.beat_key(r), 0) for r in members]
    deadline = time.monotonic() + STALE_AFTER_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if [store.add(health.beat_key(r), 0) for r in members] != before:
            return
    who = ", ".join(f"rank {r} ({info['host']} pid {info['pid']})" for r, info in
                    ((r, json.loads(store.get(f"hetseq/who/{r}"))) for r in members))
    raise UserError(f"{url} was left by an earlier job that stopped: its {who} no longer "
                    f"answer. Delete {file_path(url)} (or give each job a new file name), "
                    "then start every node again")
