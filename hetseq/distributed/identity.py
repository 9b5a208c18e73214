"""The job's identity: what every node must agree on before it may join.

Nodes are started by hand, by different people, from different shells. Two
jobs on one ``file://`` path, or one node started with another ``--seed`` or
``--max-epoch``, would otherwise train together and silently damage the run
(samples trained twice or never, a node waiting for one that stopped). So
each node presents the flags that define the job at rendezvous; rank 0 sets
them, and a node whose flags differ is refused, before it claims a rank,
with the flags that differ named.

What may differ per node is listed in PER_NODE (README: "Checked across
nodes"). A flag that names a file (a model config, a vocab) is compared by
the file's content, since each node may keep its copy elsewhere; a flag that
names a folder (``--data``) is a per-node location whose content is checked
after joining (every rank must see a dataset of the same size).
"""

import functools
import hashlib
import json
import os
import time

import hetseq
from hetseq.errors import UserError

PER_NODE = frozenset({
    # this node's share of the work and its devices
    "max_sentences", "max_sentences_valid", "distributed_rank", "distributed_gpus",
    "device_id", "cpu", "num_workers", "capacity_weight", "micro_batch_cap", "max_memory_gb",
    "distributed_no_spawn", "distributed_interface", "distributed_port", "distributed_timeout",
    "distributed_init_method",   # one master, reached by name or address
    "bucket_cap_mb",
    # where this node keeps things, and what it prints
    "save_dir", "restore_file", "user_dir", "tensorboard_logdir", "no_progress_bar",
    "log_interval", "log_format", "log_all_ranks", "no_save",
})
# Compared elsewhere, with a message of its own (rank claims, rendezvous.py).
CHECKED_AT_CLAIM = frozenset({"distributed_world_size"})


@functools.lru_cache(maxsize=None)
def _file_digest(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def code_digest():
    """HetSeq's own source, so nodes on different code are told so at rendezvous
    (not later by DDP as 'expects same model')."""
    root = os.path.dirname(hetseq.__file__)
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()[:16]


def job_identity(args, task_per_node=frozenset()):
    """{flag: value} of every flag that defines the job, plus HetSeq's version
    and code. ``task_per_node``: the task's own flags that may differ per node."""
    identity = {"hetseq_version": hetseq.__version__, "hetseq_code": code_digest()}
    for name, value in sorted(vars(args).items()):
        if name in PER_NODE or name in CHECKED_AT_CLAIM or name in task_per_node:
            continue
        if isinstance(value, str) and os.path.isfile(value):
            value = _file_digest(os.path.abspath(value))
        elif isinstance(value, str) and os.path.isdir(value):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            identity[name] = value
        elif isinstance(value, (list, tuple)):
            identity[name] = list(value)
    return identity


def _flag(name):
    return "HetSeq's code (install the same version on every node)" if name == "hetseq_code" \
        else "--" + name.replace("_", "-")


def differences(mine, theirs):
    """'--seed 2 here, 1 in the job; ...' for every flag that differs."""
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(f"{_flag(k)} {mine.get(k)!r} here, {theirs.get(k)!r} in the job"
                     for k in keys if mine.get(k) != theirs.get(k))


def present(store, identity, rank, url, who, deadline):
    """Join the job at ``store`` with ``identity``, or refuse. Rank 0 defines the
    job (the first rank 0 to arrive, by an atomic compare-and-set; it serves a
    TCP store, so the job is where it is); other ranks wait for it until
    ``deadline`` and must match it."""
    mine = json.dumps(identity, sort_keys=True)
    if rank == 0:
        held = store.compare_set("hetseq/job", "", mine).decode()
        if held == mine:
            store.compare_set("hetseq/job-by", "", who)
            return
    else:
        while not store.check(["hetseq/job"]):
            if time.monotonic() > deadline:
                raise UserError(f"rank {rank} waited at {url} for rank 0, which defines the job, "
                                "until --distributed-timeout: start it, or check the address")
            time.sleep(0.05)
        held = store.get("hetseq/job").decode()
        if held == mine:
            return
    founder = store.get("hetseq/job-by").decode() if store.check(["hetseq/job-by"]) else "?"
    raise UserError(
        f"rank {rank} refused by the job at {url} (started by {founder}): its flags differ: "
        f"{differences(identity, json.loads(held))}. Start every node with the same flags "
        "(only those listed in the README as per-node may differ), or use another "
        "--distributed-init-method for another job")
