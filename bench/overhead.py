#!/usr/bin/env python
"""Controller overhead vs a hand-written PyTorch DDP loop (2 CPU ranks).

Both train the same model (``--model mlp``: a small MLP; ``bert``: the
default BERT of ``--task bert``, hidden 256, 4 layers, sequences of 128) on
the same in-memory batches with SGD. Steps are
timed one by one in pairs, the order flipping every pair (DDP, HetSeq, HetSeq,
DDP, ...), so the drift of a shared 2-core machine and any effect of going
first or second hit both alike. Four phases each pair the DDP loop with:
  - hetseq:           Controller.train_step, the update a run makes between
                      log lines (no grad-norm pass; --clip-norm 0);
  - hetseq_grad_norm: the same, measuring the grad norm every update (what
                      --log-interval 1 or TensorBoard costs);
  - ddp_stats:        the DDP loop plus what HetSeq's stats cost on their own:
                      an asynchronous all-reduce of a stats vector (float64),
                      started before backward and waited for after it; its
                      own time (issuing and waiting) is also timed directly,
                      as a share of a DDP step;
  - ddp_control:      a second, identical DDP loop: the noise floor of this
                      method (its ratio should be 1).
Ratios are throughput over the DDP steps of the same phase. Prints JSON.

    python bench/overhead.py [--model mlp|bert] [--steps N] [--batch N]
"""

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.app import cli  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from models import MODELS, register  # noqa: E402  (bench/models.py)


STATS_SECONDS = [0.0]   # time spent in the stats all-reduce (issue + wait), ddp_stats phase


def ddp_step(kind, batch, model, opt, stats=False):
    """One DDP update with the mean loss; ``stats``: also all-reduce a stats
    vector, started before backward as the Controller does (its own cost is
    timed directly too: building and issuing it, and waiting for it)."""
    opt.zero_grad(set_to_none=True)
    loss, n, _ = kind.loss(model, batch)
    work = None
    if stats:
        begin = time.perf_counter()
        vec = torch.tensor([loss.item(), n, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        work = dist.all_reduce(vec, async_op=True)
        STATS_SECONDS[0] += time.perf_counter() - begin
    (loss / n).backward()
    if work is not None:
        begin = time.perf_counter()
        work.wait()
        STATS_SECONDS[0] += time.perf_counter() - begin
    opt.step()


def timed_pairs(steps, batches, first, second):
    """Seconds spent in ``first`` and ``second``, run alternately in flipping order."""
    spent = [0.0, 0.0]
    for i, batch in enumerate(batches[:steps]):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            (first, second)[which](batch)
            spent[which] += time.perf_counter() - start
    return spent


def ddp_loop(kind, stats=False):
    model = nn.parallel.DistributedDataParallel(kind.build())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, lambda batch: ddp_step(kind, batch, model, opt, stats)


def worker(rank, world, port, opts, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    kind = MODELS[opts.model]
    register(kind)
    g = torch.Generator().manual_seed(rank)
    batches = [kind.batch(opts.batch, g) for _ in range(opts.steps + 5)]
    args, job, _ = cli.parse(["--task", kind.name, "--optimizer", "sgd", "--lr", "0.01",
                              "--lr-scheduler", "fixed", "--clip-norm", "0"])
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    controller = Controller(job, TASKS.get(kind.name)(args), kind.build(), ctx)
    loops = [ddp_loop(kind), ddp_loop(kind, stats=True), ddp_loop(kind)]
    ddp = loops[0][2]
    phases = {"hetseq": lambda b: controller.train_step([b], b),
              "hetseq_grad_norm": lambda b: controller.train_step([b], b).grad_norm,
              "ddp_stats": loops[1][2], "ddp_control": loops[2][2]}
    result = {"model": opts.model, "ranks": world, "batch_per_rank": opts.batch,
              "steps_per_phase": opts.steps}
    samples = opts.steps * opts.batch * world
    for name, step in phases.items():
        timed_pairs(5, batches, ddp, step)                  # warm-up
        ddp_s, other_s = timed_pairs(opts.steps, batches[5:], ddp, step)
        result[f"{name}_samples_per_s"] = round(samples / other_s, 1)
        result[f"ddp_samples_per_s_in_{name}_phase"] = round(samples / ddp_s, 1)
        result[f"ratio_{name}_over_ddp"] = round(ddp_s / other_s, 4)
        if name == "ddp_stats":   # the direct measure: seconds in the stats code itself
            result["stats_allreduce_ms_per_step"] = round(1000 * STATS_SECONDS[0] / (opts.steps + 5), 4)
            result["stats_allreduce_share_of_ddp_step"] = round(
                STATS_SECONDS[0] / (opts.steps + 5) / (ddp_s / opts.steps), 5)
    if rank == 0:
        out.put(result)
    # DDP objects must go before the process group, or gloo aborts at exit.
    del loops, ddp, phases, controller
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "bert"], default="mlp")
    parser.add_argument("--steps", type=int, help="timed pairs per phase (default: mlp 1500, "
                                                   "bert 40)")
    parser.add_argument("--batch", type=int, help="samples per rank (default: mlp 64, bert 8)")
    opts = parser.parse_args()
    opts.steps = opts.steps or {"mlp": 1500, "bert": 40}[opts.model]
    opts.batch = opts.batch or {"mlp": 64, "bert": 8}[opts.model]
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(2, server.port, opts, out), nprocs=2)
    print(json.dumps(out.get(), indent=2))


if __name__ == "__main__":
    main()
