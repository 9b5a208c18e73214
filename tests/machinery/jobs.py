"""Short jobs of W ranks run one after another in one set of processes.

For tests and benchmarks: a train.py command costs seconds to start (Python,
torch, the rendezvous); here W processes start once, join one process group
(the recording backend over gloo, so every collective is recorded), and
build a ``Run`` for each job from its per-rank flags, as train.py would. A
job's results: each rank's collectives with a marker around every update,
rank 0's full checkpoint state, the plan's global batch and each rank's
model state in bytes.

    results = run_jobs(2, [("split 24/8", [argv_rank0, argv_rank1])], folder)
    alone = run_alone(argv)      # one process, in this process: the reference
"""

import dataclasses
import datetime
import gc
import os

import torch
import torch.distributed as dist

from machinery import recording


@dataclasses.dataclass
class JobResult:
    calls: list             # per rank: recording.Call, with "update N" markers
    state: dict             # rank 0's Controller.state_dict() after the run
    global_batch: int
    state_bytes: list       # per rank: Controller.state_bytes() after the run

    def updates(self, rank=0):
        """{"update N": [calls]} of ``rank``."""
        return recording.sections(self.calls[rank], "update ")


def _mark_updates(controller):
    """A marker before and after each update in the recording."""
    step = controller.train_step

    def marked(*args, **kwargs):
        recording.mark(f"update {controller.num_updates + 1}")
        result = step(*args, **kwargs)
        recording.mark("between updates")
        return result
    controller.train_step = marked


def _build(argv, ctx):
    from hetseq.app import cli
    from hetseq.run.loop import Run
    args, job, node = cli.parse([str(a) for a in argv])
    return Run(args, job, node, ctx)


def _worker(rank, world, folder, jobs, timeout):
    from hetseq.distributed.spawn import DistContext
    torch.set_num_threads(1)
    recording.register()
    dist.init_process_group(recording.BACKEND, init_method=f"file://{folder}/meet", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    results = {}
    for name, argvs in jobs:
        recording.clear()
        run = _build(argvs[rank], ctx)
        _mark_updates(run.controller)
        run.train()
        calls = recording.calls()
        state = run.controller.state_dict()        # a collective under sharding
        results[name] = JobResult(calls, state if rank == 0 else None,
                                  run.balance.plan.global_batch, run.controller.state_bytes())
        del run, state
        gc.collect()
    # Files, not a queue: a queue's pipe blocks on this much data until the
    # parent reads, and it reads after joining.
    torch.save(results, os.path.join(folder, f"results.{rank}"))
    gc.collect()       # objects holding the group (DDP) go before it
    dist.barrier()
    dist.destroy_process_group()


def run_jobs(world, jobs, folder, timeout=60):
    """Run ``jobs`` ([(name, [argv of each rank])]) on ``world`` ranks, one
    after the other; {name: JobResult}. ``folder``: an empty directory."""
    from hetseq.distributed.spawn import start_ranks
    os.makedirs(folder, exist_ok=True)
    start_ranks(_worker, (world, str(folder), jobs, timeout), world, "cpu", "hetseq.run.loop")
    per_rank = [torch.load(os.path.join(folder, f"results.{rank}"), weights_only=False)
                for rank in range(world)]
    return {name: JobResult([ranks[name].calls for ranks in per_rank], per_rank[0][name].state,
                            per_rank[0][name].global_batch,
                            [ranks[name].state_bytes for ranks in per_rank])
            for name, _ in jobs}


def run_alone(argv):
    """The Controller state after training with ``argv`` in this process,
    as one process (no process group)."""
    from hetseq.distributed.spawn import DistContext
    run = _build(argv, DistContext(0, 1, 0, torch.device("cpu")))
    run.train()
    return run.controller.state_dict()
