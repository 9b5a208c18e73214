#!/usr/bin/env python
"""Controller overhead vs a hand-written PyTorch DDP loop (2 CPU ranks).

Both train the same MLP on the same in-memory batches with SGD. Steps are
timed one by one in pairs, the order flipping every pair (DDP, HetSeq, HetSeq,
DDP, ...), so the drift of a shared 2-core machine and any effect of going
first or second hit both alike. Three phases each pair the DDP loop with:
  - hetseq:           Controller.train_step, the update a run makes between
                      log lines (no grad-norm pass; --clip-norm 0);
  - hetseq_grad_norm: the same, measuring the grad norm every update (what
                      --log-interval 1 or TensorBoard costs);
  - ddp_control:      a second, identical DDP loop: the noise floor of this
                      method (its ratio should be 1).
Ratios are throughput over the DDP steps of the same phase. Prints JSON.

    python bench/overhead.py [--steps 1500] [--batch 64]
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


def timed_pairs(steps, batches, first, second):
    """Seconds spent in ``first`` and ``second``, run alternately in flipping order."""
    spent = [0.0, 0.0]
    for i, batch in enumerate(batches[:steps]):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            (first, second)[which](batch)
            spent[which] += time.perf_counter() - start
    return spent


def ddp_loop():
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, lambda batch: ddp_step(batch, model, opt)


def worker(rank, world, port, opts, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(opts.batch, 784, generator=g),
                torch.randint(0, 10, (opts.batch,), generator=g)) for _ in range(opts.steps)]
    args = cli.parse_args(["--task", "bench_mlp", "--optimizer", "sgd", "--lr", "0.01",
                           "--lr-scheduler", "fixed", "--clip-norm", "0"])
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    controller = Controller(args, TASKS.get("bench_mlp")(args), make_model(), ctx)
    *baseline, ddp = ddp_loop()
    *control, ddp_again = ddp_loop()
    phases = {"hetseq": lambda b: controller.train_step([b], b, grad_norm=False),
              "hetseq_grad_norm": lambda b: controller.train_step([b], b, grad_norm=True),
              "ddp_control": ddp_again}
    result = {"ranks": world, "batch_per_rank": opts.batch, "steps_per_phase": opts.steps}
    samples = opts.steps * opts.batch * world
    for name, step in phases.items():
        timed_pairs(5, batches, ddp, step)                  # warm-up
        ddp_s, other_s = timed_pairs(opts.steps, batches, ddp, step)
        result[f"{name}_samples_per_s"] = round(samples / other_s, 1)
        result[f"ddp_samples_per_s_in_{name}_phase"] = round(samples / ddp_s, 1)
        result[f"ratio_{name}_over_ddp"] = round(ddp_s / other_s, 4)
    if rank == 0:
        out.put(result)
    # DDP objects must go before the process group, or gloo aborts at exit.
    del baseline, control, ddp, ddp_again, phases, controller
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="timed pairs per phase")
    parser.add_argument("--batch", type=int, default=64)
    opts = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(2, server.port, opts, out), nprocs=2)
    print(json.dumps(out.get(), indent=2))


if __name__ == "__main__":
    main()
