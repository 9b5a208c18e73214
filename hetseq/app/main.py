"""``hetseq-train`` and ``python train.py``: parse the flags, start this node's
ranks (or its elastic member), each running hetseq/run/loop.py's Run."""

import logging
import os
import shlex
import signal
import sys

from hetseq.app import cli
from hetseq.distributed.spawn import WorkerFailed, exit_now, launch, node_label, node_topology
from hetseq.elastic.agent import train_elastic
from hetseq.base import stopping
from hetseq.base.errors import HetSeqError
from hetseq.base.logs import NODE, setup_logging
from hetseq.reporting.status import StatusBoard
from hetseq.run.loop import train_worker
from hetseq.tasks import TASKS

logger = logging.getLogger("hetseq.run")


def main(argv=None):
    # This node's lines say its ranks from the first on: 'node' until they
    # are known (an elastic member's come from the meeting), then its own.
    setup_logging(0, label="node")
    # SIGINT and SIGTERM from here on: a stop the ranks agree on, after a
    # save (base/stopping.py); before the first update, at once.
    stopping.install()
    try:
        args, job, node = cli.parse(argv, prog=command_name())
        topology = None
        if not job.elastic.elastic:
            topology = node_topology(node, job.distributed_backend)
            setup_logging(0, label=node_label(topology))
        inputs = TASKS.get(job.task).resolve_inputs(args)
        if job.elastic.elastic:
            train_elastic(args, job, node, inputs)
        else:
            launch(node, job.distributed_backend, train_worker, args, job, node, inputs,
                   identity=job.identity(), board=StatusBoard, topology=topology)
    except (HetSeqError, WorkerFailed) as err:
        logger.error("%s", err)
        exit_now(err.exit_code)
    stopped = stopping.outcome()
    if stopped is not None:
        say_stopped(*stopped, node.save)
        exit_now(128 + stopped[0])
    # Done: everything is written and closed (a rank's files as in a spawned
    # rank, which also ends this way). The interpreter's teardown would only
    # free torch's modules: 1-3 s of CPU per command for nothing.
    exit_now(0)


def say_stopped(signum, updates, saved, save):
    """The last line of a node whose job stopped on a signal: what it kept
    and the command that goes on from there."""
    name = signal.Signals(signum).name
    if save.no_save:
        kept = "nothing saved (--no-save)"
    elif saved:
        kept = f"saved {os.path.join(save.save_dir, 'checkpoint_last.pt')}"
    else:
        kept = "rank 0's node saved its checkpoint"
    again = "" if save.no_save else \
        f"; resume with the same command{' on every node' if not saved else ''}: {resume_command()}"
    NODE.warning("stopped by %s after update %d: %s%s", name, updates, kept, again)


def resume_command():
    """The command line this node was started with, as a user would type it again."""
    name = command_name()
    head = ["python", sys.argv[0]] if name.endswith(".py") else [name]
    return shlex.join([*head, *sys.argv[1:]])


def command_name():
    """How this command was run, as its errors name it: ``train.py`` (or the
    script a user made of it) for ``python train.py``, else hetseq-train."""
    name = os.path.basename(sys.argv[0] or "")
    return name if name.endswith(".py") and name not in ("main.py", "__main__.py") \
        else "hetseq-train"


if __name__ == "__main__":
    main()
