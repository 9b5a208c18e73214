#!/usr/bin/env python
"""What keeping ranks equal costs (hetseq/update/agreement.py), per update.

For each model, one AdamW update (forward, backward, step) is timed in one
process, then:
- the exact checksum of the parameters and the Adam state (paid every
  --divergence-check-interval updates on every job);
- a resync on 2 CPU ranks over gloo: rank 0's state broadcast and copied
  (paid only when a check finds the ranks apart: on mixed devices, at most
  once per check).
Reported per update at the default interval of 10, as a share of the update.

    python bench/drift.py --out bench/results/drift.json
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from hetseq.update import agreement  # noqa: E402
from models import MODELS  # noqa: E402
from output import emit  # noqa: E402

BATCH = {"bert": 16, "bert-base": 4}


def trained_state(kind, batch, steps):
    """The model and AdamW after ``steps`` updates, and the median update time."""
    model = kind.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sample = kind.batch(batch, torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, _, _ = kind.loss(model, sample)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    tensors = [*model.parameters(), *[v for s in optimizer.state.values() for v in s.values()
                                       if torch.is_tensor(v)]]
    return tensors, statistics.median(times[1:])


def timed(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _resync_rank(rank, name, init, queue):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    kind = MODELS[name]
    tensors = [p.detach() for p in kind.build().parameters()]
    tensors += [torch.zeros_like(t) for t in tensors for _ in range(2)]   # AdamW's moments
    if rank == 1:
        for t in tensors:
            t.mul_(1 + 1e-7)                                     # a rank that rounded apart
    ctx = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"), distributed=True,
                                is_main=rank == 0)
    seconds = timed(lambda: agreement.resync(tensors, ctx, 1e-4, 1), repeats=3)
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def resync_seconds(name):
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_resync_rank, args=(name, f"file://{tmp}/rendezvous", queue), nprocs=2)
    return queue.get()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert,bert-base")
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--out")
    opts = p.parse_args()
    torch.set_num_threads(2)
    report = {"interval": opts.interval, "threads": 2}
    for name in opts.models.split(","):
        tensors, update = trained_state(MODELS[name], BATCH[name], steps=4)
        check = timed(lambda: agreement.checksum(tensors))
        resync = resync_seconds(name)
        report[name] = {
            "batch": BATCH[name], "elements": sum(t.numel() for t in tensors),
            "update_ms": round(1000 * update, 1), "checksum_ms": round(1000 * check, 1),
            "resync_ms_2_ranks": round(1000 * resync, 1),
            "checksum_share_per_update": round(check / opts.interval / update, 5),
            "with_resync_every_check_share": round((check + resync) / opts.interval / update, 5)}
    emit(report, opts.out)


if __name__ == "__main__":
    main()
