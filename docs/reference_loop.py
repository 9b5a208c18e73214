"""HetSeq's update, written as a plain PyTorch loop: the way in (docs/design.md).

W ranks, plain DDP over gloo, the task's own Task API, and HetSeq's math:
each rank takes a slice of every global batch of B samples (any sizes), its
task returns the SUM of its samples' losses and their count n_r; DDP leaves
G/W on every rank (G = sum_r g_r), and G/W times W/N (N = sum_r n_r) is the
gradient of the global batch's mean loss, one device's large-batch update.
Dropout is keyed by sample, so the split decides nothing. HetSeq's Controller
makes this same update (tests/system/test_reference_loop.py checks it).

    python docs/reference_loop.py --shares 20,12 --out state.pt -- --task toy ...
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from hetseq.app import cli
from hetseq.keyed import randomness
from hetseq.tasks import TASKS, import_builtin_tasks


def train(rank, shares, argv, meet=None, out=None):
    """Rank ``rank`` of len(shares) ranks; ``shares``: each rank's samples of
    a global batch; ``argv``: a HetSeq job's flags (task, lr, seed, max-update)."""
    world = len(shares)
    if world > 1:
        dist.init_process_group("gloo", init_method=meet, rank=rank, world_size=world)
    import_builtin_tasks()
    args, _, _ = cli.parse(argv)          # the flags a HetSeq job takes (imports --user-dir)
    randomness.seed_generators(args.seed)
    task = TASKS.get(args.task)(args)
    model = task.build_model()
    randomness.name_sites(model)          # each dropout's site: its path in the model
    ddp = DistributedDataParallel(model) if world > 1 else model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr[0], momentum=args.momentum)
    data = task.load_dataset("train")
    collate = task.collater(data)
    B, start = sum(shares), sum(shares[:rank])
    updates, epoch = 0, 1
    while updates < args.max_update:
        # The epoch's permutation, cut into global batches of B: the world plays no part.
        order = np.random.default_rng([args.seed, epoch]).permutation(len(data))
        for batch in (order[at:at + B] for at in range(0, len(data), B)):
            mine = batch[_slice(len(batch), shares, rank)]
            weight = 1.0 if len(mine) else 0.0    # no samples: a zero-weight forward, so
            rows = mine if len(mine) else batch[:1]   # that DDP's all-reduce still matches
            sample = collate([data[int(i)] for i in rows])
            with randomness.using(randomness.sample_keys(args.seed, epoch, rows)):
                loss, n, _ = task.loss(ddp, sample)       # the SUM over its samples, and n_r
            counts = torch.tensor([n * weight], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(counts)                   # N = sum_r n_r
            (loss * weight).backward()                    # DDP: every rank holds G/W
            with torch.no_grad():
                for p in params:                          # (G/W) * (W/N) = G/N
                    if p.grad is not None:
                        p.grad.mul_(world / counts.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            if updates == args.max_update:
                break
        epoch += 1
    if rank == 0 and out:
        torch.save(model.state_dict(), out)
    if world > 1:
        del ddp            # (it holds the group: at exit after it, gloo may abort)
        dist.destroy_process_group()
    return model.state_dict()


def _slice(length, shares, rank):
    """Rank ``rank``'s contiguous part of a batch of ``length`` (a short last
    batch is cut in proportion; the remainder goes to the first ranks)."""
    sizes = [length * s // sum(shares) for s in shares]
    for r in range(length - sum(sizes)):
        sizes[r] += 1
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", default="32", help="each rank's samples of a global batch")
    parser.add_argument("--out", help="write rank 0's model state here (torch.save)")
    own, flags = parser.parse_known_args()
    shares = [int(s) for s in own.shares.split(",")]
    flags = flags[1:] if flags[:1] == ["--"] else flags
    if len(shares) == 1:
        train(0, shares, flags, out=own.out)
        return
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(train, (shares, flags, f"file://{os.path.join(folder, 'meet')}", own.out),
                 nprocs=len(shares))


if __name__ == "__main__":
    sys.exit(main())
