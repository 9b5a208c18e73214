#!/usr/bin/env python
"""Controller overhead vs a hand-written PyTorch DDP loop (2 CPU ranks).

Both train the same MLP on the same in-memory batches with SGD. Their steps
alternate one by one (DDP step, HetSeq step, DDP step, ...), each timed on
its own, so the drift of a shared 2-core machine hits both alike; we report
the throughput of each over all steps and their ratio. Prints JSON.

    python bench/overhead.py [--steps 400]
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq import cli  # noqa: E402
from hetseq.controller import Controller  # noqa: E402
from hetseq.distributed import DistContext  # noqa: E402
from hetseq.tasks import TASKS, Task, register_task  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


if "bench_mlp" not in TASKS:
    @register_task("bench_mlp")
    class BenchTask(Task):
        def build_model(self):
            return make_model()

        def loss(self, model, sample):
            x, y = sample
            return F.cross_entropy(model(x), y, reduction="sum"), len(y), {}


def ddp_step(batch, model, opt):
    x, y = batch
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def timed(step, *args):
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def worker(rank, world, port, opts, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(opts.batch, 784, generator=g),
                torch.randint(0, 10, (opts.batch,), generator=g)) for _ in range(opts.steps)]
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    args = cli.parse_args(["--task", "bench_mlp", "--optimizer", "sgd", "--lr", "0.01",
                           "--lr-scheduler", "fixed", "--clip-norm", "0"])
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    controller = Controller(args, TASKS.get("bench_mlp")(args), make_model(), ctx)
    for batch in batches[:5]:                      # warm-up both paths
        ddp_step(batch, model, opt)
        controller.train_step([batch], batch)
    times = {"ddp": 0.0, "hetseq": 0.0}
    for batch in batches:
        times["ddp"] += timed(ddp_step, batch, model, opt)
        times["hetseq"] += timed(controller.train_step, [batch], batch)
    if rank == 0:
        samples = opts.steps * opts.batch * world
        rates = {k: samples / v for k, v in times.items()}
        out.put({"ranks": world, "batch_per_rank": opts.batch, "steps": opts.steps,
                 "ddp_samples_per_s": round(rates["ddp"], 1),
                 "hetseq_samples_per_s": round(rates["hetseq"], 1),
                 "ratio_hetseq_over_ddp": round(rates["hetseq"] / rates["ddp"], 4)})
    # DDP objects must go before the process group, or gloo aborts at exit.
    del model, opt, controller
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    opts = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(2, server.port, opts, out), nprocs=2)
    print(json.dumps(out.get(), indent=2))


if __name__ == "__main__":
    main()
