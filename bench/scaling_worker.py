"""One rank of bench/scaling.py, run on one namespace host: times gloo
all-reduces of several sizes, then DDP training steps of the default BERT
with and without gradient communication. Rank 0 prints one JSON line."""

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq.bert.demo import MODEL, VOCAB_SIZE
from hetseq.bert.model import BertConfig, BertForPreTraining


def timed_all_reduce(size_bytes, reps):
    buffer = torch.ones(size_bytes // 4)
    dist.all_reduce(buffer)                      # warm-up: connections, allocation
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch(size, generator):
    ids = torch.randint(5, VOCAB_SIZE, (size, 128), generator=generator)
    return dict(input_ids=ids, segment_ids=torch.zeros_like(ids), input_mask=torch.ones_like(ids),
                masked_lm_positions=torch.randint(1, 128, (size, 20), generator=generator),
                masked_lm_ids=torch.randint(5, VOCAB_SIZE, (size, 20), generator=generator))


def step(ddp, optimizer, sample, sync):
    """(forward s, backward s, whole step s) of one update. no_sync must hold
    the forward too: DDP decides at forward time whether backward reduces."""
    start = time.perf_counter()
    with contextlib.nullcontext() if sync else ddp.no_sync():
        mlm, nsp = ddp(sample["input_ids"], sample["segment_ids"], sample["input_mask"],
                       sample["masked_lm_positions"])
        loss = torch.nn.functional.cross_entropy(
            mlm.flatten(0, 1), sample["masked_lm_ids"].flatten(), reduction="sum") + nsp.sum()
        forward = time.perf_counter()
        loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return forward - start, backward - forward, time.perf_counter() - start


def train_steps(args):
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=VOCAB_SIZE, **MODEL))
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sample = batch(args.batch, torch.Generator().manual_seed(args.rank))
    step(ddp, optimizer, sample, True)              # warm-up
    rows = {True: [], False: []}
    for pair in range(args.steps):
        for sync in ((True, False) if pair % 2 else (False, True)):   # flip the order
            dist.barrier()
            rows[sync].append(step(ddp, optimizer, sample, sync))
    med = {sync: [statistics.median(col) for col in zip(*r)] for sync, r in rows.items()}
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return {"grad_bytes": grad_bytes, "batch": args.batch, "bucket_cap_mb": args.bucket_cap_mb,
            "forward_s": med[False][0], "backward_s": med[False][1], "step_no_comm_s": med[False][2],
            "step_s": med[True][2]}


def main():
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "batch", "steps", "reps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--sizes-mb", type=float, nargs="+", required=True)
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=args.rank, world_size=args.world)
    result = train_steps(args)
    sizes = sorted({int(mb * 2**20) for mb in args.sizes_mb} | {result["grad_bytes"]})
    result["all_reduce"] = [[size, timed_all_reduce(size, args.reps)] for size in sizes]
    times = [None] * args.world
    dist.all_gather_object(times, result["step_no_comm_s"])
    result["rank_step_no_comm_s"] = times
    if args.rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
