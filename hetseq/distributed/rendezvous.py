"""Meeting point of all ranks: a key-value store, rank claims, then the process group.

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
import urllib.parse

import torch.distributed as dist

from hetseq.errors import UserError

logger = logging.getLogger(__name__)


def _tcp_store(url, host, port, rank, world_size, timeout, hosted):
    # Rank 0 serves the store unless the launcher process already does
    # (single-node runs, torchrun's agent store).
    is_server = rank == 0 and not hosted
    try:
        return dist.TCPStore(host, port, world_size, is_server, timeout, wait_for_workers=False)
    except (RuntimeError, ValueError) as err:
        reason = str(err).splitlines()[0]
        if is_server:
            raise UserError(f"rank 0 could not serve {url}: {reason}. The port may be in use by "
                            "another job (pick a free one) or HOST is not this machine's address")
        raise UserError(f"rank {rank} could not reach {url} within {timeout.total_seconds():.0f} s: "
                        f"{reason}. Check that rank 0 runs, that HOST:PORT is its address and "
                        "that no firewall blocks the port") from None


def _open_tcp(url, rank, world_size, timeout, hosted):
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or not port:
        raise UserError(f"--distributed-init-method {url}: expected tcp://HOST:PORT")
    return _tcp_store(url, parsed.hostname, port, rank, world_size, timeout, hosted)


def _open_env(url, rank, world_size, timeout, hosted):
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        raise UserError("env:// needs MASTER_ADDR and MASTER_PORT (an integer) in the environment, "
                        f"got MASTER_ADDR={addr!r} MASTER_PORT={port!r}")
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT.
    hosted = hosted or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return _tcp_store(f"env:// ({addr}:{port})", addr, int(port), rank, world_size, timeout, hosted)


def _open_file(url, rank, world_size, timeout, hosted):
    path = file_path(url)
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UserError(f"--distributed-init-method {url}: folder {folder} does not exist; "
                        "create it on a filesystem every node shares")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--distributed-init-method {url}: folder {folder} is not writable")
    return dist.FileStore(path, world_size)


STORE_OPENERS = {"tcp": _open_tcp, "env": _open_env, "file": _open_file}


def file_path(url):
    return urllib.parse.unquote(url[len("file://"):])


def open_store(url, rank, world_size, timeout, hosted=False):
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in STORE_OPENERS:
        raise UserError(f"--distributed-init-method {url}: expected tcp://HOST:PORT, "
                        "file:///shared/path or env://")
    return STORE_OPENERS[scheme](url, rank, world_size, timeout, hosted)


def claim_rank(store, rank, world_size, timeout, url):
    """Take rank ``rank`` in the store, then wait until all ranks are taken.
    Returns {rank: {"host", "pid", "world_size"}} of every rank."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "world_size": world_size}
    if store.add(f"hetseq/claim/{rank}", 1) != 1:
        raise UserError(
            f"rank {rank} was claimed by two processes (this one: {me['host']} pid {me['pid']}). "
            "Give each node its own --distributed-rank (the sum of --distributed-gpus of the "
            "nodes before it); with file:// a file left by an earlier job does this too: "
            f"delete it or use a new path ({url})")
    store.set(f"hetseq/who/{rank}", json.dumps(me))
    return _wait_for_all(store, world_size, timeout, url)


def _wait_for_all(store, world_size, timeout, url):
    pending, peers = set(range(world_size)), {}
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for other in sorted(pending):
            key = f"hetseq/who/{other}"
            try:
                present = store.check([key])
                info = json.loads(store.get(key)) if present else None
            except dist.DistError as err:
                raise UserError(f"lost the meeting point {url} while waiting for ranks "
                                f"{sorted(pending)}: the process serving it (rank 0) has stopped "
                                f"({str(err).splitlines()[0]}); see rank 0's message") from None
            if present:
                _check_peer(other, info, world_size)
                peers[other] = info
                pending.discard(other)
        if pending and time.monotonic() > deadline:
            raise UserError(
                f"timed out after {timeout.total_seconds():.0f} s waiting at {url} for ranks "
                f"{sorted(pending)} of {world_size}: start them, or check that each node's "
                "--distributed-rank and --distributed-gpus add up to --distributed-world-size")
        time.sleep(0.02)
    return peers


def _check_peer(rank, info, world_size):
    if info["world_size"] != world_size:
        raise UserError(f"rank {rank} ({info['host']}) runs with --distributed-world-size "
                        f"{info['world_size']} but this process with {world_size}; "
                        "pass the same world size on every node")


def init_process_group(topology, rank, timeout_s):
    """Meet the other ranks and start torch.distributed; returns the store and
    what every rank registered (host, pid)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    url = topology.init_method
    store = open_store(url, rank, topology.world_size, timeout, topology.store_hosted)
    peers = claim_rank(store, rank, topology.world_size, timeout, url)
    dist.init_process_group(topology.backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=topology.world_size, timeout=timeout)
    logger.info("rank %d of %d joined via %s (%s)", rank, topology.world_size, url,
                topology.backend)
    return store, peers


def shutdown(topology, rank, store):
    """Leave the process group after a clean run. The ranks leave together: the
    process serving the TCP store (rank 0) waits until every rank has let go
    of it, since a client whose server vanished can abort at exit. Rank 0 then
    removes a file:// store file (a leftover file breaks the next job there)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    store.add("hetseq/left", 1)
    url = topology.init_method or ""
    if rank == 0:
        deadline = time.monotonic() + 30
        while store.add("hetseq/left", 0) < topology.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
        if url.startswith("file://"):
            try:
                os.remove(file_path(url))
            except FileNotFoundError:
                pass
