"""Ranks and references in this process: rank processes started as the
launcher starts them, a Controller built from flags, the toy's keyed rows,
and the single-process references shared by the session's workers."""

import io
import os
import tempfile
from pathlib import Path

import torch

def start_ranks(worker, nprocs, *args):
    """Run ``worker(rank, *args)`` in ``nprocs`` processes and wait for them,
    started as spawn.start_method says (from a fork server that imported
    torch once: a test worker has threads)."""
    from hetseq.distributed.spawn import start_ranks as start
    start(worker, args, nprocs, "cpu", "hetseq.run.loop")


def rank_queue():
    """A queue that ranks of ``start_ranks`` can put on."""
    import torch.multiprocessing as mp
    from hetseq.distributed.spawn import start_method
    return mp.get_context(start_method("cpu", "hetseq.run.loop")).SimpleQueue()


def leave_process_group():
    """End a test worker's process group the way a run ends (distributed/spawn.py):
    collect first, since objects holding the group (DDP, FSDP's mesh) kept
    alive by reference cycles to interpreter exit make gloo abort there."""
    import gc
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def build_controller(argv, ctx):
    """(Controller, task) of the flags ``argv``, in this process, for ``ctx``."""
    from hetseq.app import cli
    from hetseq.update.controller import Controller
    from hetseq.tasks import TASKS
    args, job, _ = cli.parse([str(a) for a in argv])
    task = TASKS.get(args.task)(args)
    return Controller(job, task, task.build_model(), ctx), task


def keyed(toy_data, rows, seed=1, epoch=1):
    """Rows of the toy's dataset as the training iterator gives them: a
    KeyedBatch, whose dropout draws belong to those rows (hetseq/keyed/randomness.py)."""
    from hetseq.keyed.randomness import KeyedBatch, sample_keys
    return KeyedBatch({"x": toy_data.x[rows], "y": toy_data.y[rows]},
                      sample_keys(seed, epoch, rows))


def portable(obj):
    """``obj`` as bytes a spawned worker can put on a queue and exit: tensors
    sent as they are would live in the worker's shared memory, gone with it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


_ALONE = {}


# References shared by the session's workers (the folder is made by the
# process that imports this first, the one that runs the session, and
# inherited by its xdist workers): each trained once, not once per worker.
# Removed at the end by the process that made it (a worker inherits it).
_OWN_REFERENCES = "HETSEQ_TEST_REFERENCES" not in os.environ


if _OWN_REFERENCES:
    os.environ["HETSEQ_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="hetseq-references-")


REFERENCES = Path(os.environ["HETSEQ_TEST_REFERENCES"])


def alone(*argv):
    """The Controller state of one process trained with ``argv`` (nothing
    saved), trained once per distinct argv in the session (the first worker
    to ask trains it; the others wait for its file): the single-process
    reference."""
    key = tuple(map(str, argv))
    if key not in _ALONE:
        _ALONE[key] = _shared_reference(key)
    return _ALONE[key]


def _shared_reference(key):
    import fcntl
    import hashlib
    from machinery.jobs import run_alone
    path = REFERENCES / hashlib.sha256("\0".join(key).encode()).hexdigest()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # released when closed
        if path.exists():
            return torch.load(path, weights_only=False)
        state = run_alone([*key, "--no-save"])
        torch.save(state, path.with_suffix(".partial"))
        os.replace(path.with_suffix(".partial"), path)
        return state


def close():
    """At the session's end: the shared references removed by the process that made them."""
    if _OWN_REFERENCES:
        import shutil
        shutil.rmtree(REFERENCES, ignore_errors=True)
