#!/usr/bin/env python
"""State shares by memory (--state-shares memory) against even shares, on
two CPU ranks (gloo) with --max-memory-gb M and 3M, --zero 3, AdamW. Prints JSON.

1. largest: the BERT-base shape (hidden 768, 12 heads, intermediate 3072,
   vocabulary 30522, sequences of 128) with the layers growing. For each
   depth the plan's own arithmetic (plan/state_shares.py: ``state_size``
   with AdamW's 2 slots under --zero 3, then ``choose``) decides whether it
   fits with even shares and with shares by memory. Each rank's memory for
   model state is its --max-memory-gb less the activations of one sample
   (micro-batch 1): the bytes autograd saves for backward, parameters left
   out (the gathered units are the state's ``whole`` part), measured at 1
   and 2 layers. ``state_only`` gives the largest depths with activations
   left out, as the job's own check at startup counts them.
2. trained: fresh rank processes build the two largest models and train
   them for --updates AdamW updates at micro-batch 1, through the path
   ``hetseq train`` takes (the shares agreed by run/shares.py's
   ``StateSharing`` from each rank's own --max-memory-gb, then the
   Controller). Per rank: the model-state bytes the rank counts from its own
   tensors (``Controller.state_bytes``) against the plan's share, its
   memory, peak RSS and RSS before the model was built (the torch runtime),
   and ``state_storage_gb``: the storages behind the counted tensors, which
   a view of a larger tensor (a gradient slice keeping the whole) exceeds.
   The larger model is also asked for even shares: the UserError of the
   refusal, as each rank raised it.
3. speed: the default BERT of --task bert (hidden 256, 4 layers) on 2 ranks
   under --zero 3, the same batches (8 samples per rank), seconds per
   update of even shares (torch's FSDP2, twice: its ratio to itself is the
   method's noise floor), HetSeq's engine at 1:1 (our engine, shares even)
   and HetSeq's engine at 1:3 (our engine, shares uneven). The modes take
   turns step by step, the order rotating, so a shared machine's drift hits
   all alike. Ratios are against even shares, what a user runs without
   --state-shares memory (goal: 1:3 at most 1.1x).

    python bench/memory_shares.py [--memory-gb 0.5] [--updates 3] [--speed-steps 30] [--out FILE]
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.app import cli  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.base.errors import UserError  # noqa: E402
from hetseq.optim import OPTIMIZERS  # noqa: E402
from hetseq.plan import state_shares  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402
from models import Bert, BertBase, register, take_turns  # noqa: E402  (bench/models.py)
from output import emit  # noqa: E402  (bench/output.py)

GB = 2 ** 30
FLAGS = ["--optimizer", "adamw", "--lr", "1e-4", "--lr-scheduler", "fixed", "--clip-norm", "1",
         "--zero", "3"]
RATIO = 3            # rank 1's memory over rank 0's
MAX_LAYERS = 48


def family(layers):
    """BERT-base's shape with ``layers`` layers, as a bench model."""
    return type(f"BertBase{layers}", (BertBase,), {
        "name": f"bench_bert_base_{layers}l",
        "CONFIG": {**BertBase.CONFIG, "num_hidden_layers": layers}})


def parse(kind, *flags):
    register(kind)
    return cli.parse(["--task", kind.name, *FLAGS, *flags])


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def storage_bytes(ctrl):
    """Bytes of the storages behind what ``state_bytes`` counts (this rank's
    parameters, their gradients, the optimizer state), each storage once: a
    tensor that is a view of a larger one shows the larger one here."""
    params = list(ctrl.sharding.counted_params(ctrl.params))
    inner = getattr(ctrl.optimizer, "optim", ctrl.optimizer)
    tensors = params + list(ctrl.sharding.local_grads(ctrl.params)) + [
        v for state in inner.state.values() for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0]
    storages = {}
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- 1. the largest model each way, by the plan's arithmetic ----

def activation_bytes(layers):
    """Bytes autograd saves for backward for one sample of 128 tokens, the
    parameters (saved by the matmuls) left out: they are model state."""
    from hetseq.tasks.bert_pretraining import BertTask
    kind = family(layers)
    model = kind.build()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        BertTask.loss(None, model, kind.batch(1, torch.Generator().manual_seed(0)))
    return sum(storages.values())


def size_of(layers, job):
    """(StateSize under --zero 3 with the job's optimizer, parameters)."""
    with torch.device("meta"):
        model = family(layers).build()
    slots = OPTIMIZERS.get(job.optimizer.optimizer).state_slots(job.optimizer)
    size = state_shares.state_size(3, False, "cpu", model, slots)
    return size, sum(p.numel() for p in model.parameters())


def fits(cfg, memories, size, kind):
    try:
        state_shares.choose(dataclasses.replace(cfg, state_shares=kind), memories, size)
        return True
    except UserError:
        return False


def largest(memory_gb):
    _, job, _ = parse(family(1))
    one, two = activation_bytes(1), activation_bytes(2)
    memories = [memory_gb * GB, RATIO * memory_gb * GB]
    best = {"even": None, "memory": None}
    state_only = {"even": None, "memory": None}
    rows = []
    for layers in range(1, MAX_LAYERS + 1):
        size, params = size_of(layers, job)
        activations = one + (layers - 1) * (two - one)
        left = [m - activations for m in memories]
        row = {"layers": layers, "params": params}
        for kind in best:
            row[f"fits_{kind}"] = fits(job.sharding, left, size, kind)
            if row[f"fits_{kind}"]:
                best[kind] = layers
            if fits(job.sharding, memories, size, kind):
                state_only[kind] = layers
        rows.append(row)
        if not fits(job.sharding, memories, size, "memory"):
            break
    out = {"memory_gb_per_rank": [memory_gb, RATIO * memory_gb],
           "shape": "BERT-base: hidden 768, 12 heads, intermediate 3072, vocab 30522, seq 128",
           "activation_bytes_per_sample": {"1_layer": one, "per_extra_layer": two - one},
           "state_bytes_per_param": 4 * (2 + 2), "whole_part": "2 x largest unit (the root: "
           "embeddings, pooler, heads), gathered with its gradient"}
    for kind in best:
        layers = best[kind]
        size, params = size_of(layers, job)
        activations = one + (layers - 1) * (two - one)
        shares = state_shares.choose(dataclasses.replace(job.sharding, state_shares=kind),
                                     [m - activations for m in memories], size)
        out[kind] = {"layers": layers, "params": params,
                     "state_gb_planned": [round(b / GB, 4)
                                          for b in state_shares.describe(shares, size)],
                     "shares": [round(f, 4) for f in shares.fractions]}
    out["params_memory_over_even"] = round(out["memory"]["params"] / out["even"]["params"], 3)
    out["state_only"] = {"even_layers": state_only["even"], "memory_layers": state_only["memory"]}
    out["by_layers"] = rows
    return out


# ---- 2. train them ----

def start(rank, world, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return DistContext(rank, world, rank, torch.device("cpu"), "gloo")


def finish():
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train_worker(rank, world, port, layers, kind, memory_gb, updates, out):
    from hetseq.run.shares import StateSharing
    ctx = start(rank, world, port)
    runtime = rss_bytes()
    model_kind = family(layers)
    memory = memory_gb * (RATIO if rank else 1)
    args, job, node = parse(model_kind, "--state-shares", kind, "--max-memory-gb", str(memory))
    model = model_kind.build()
    report = {"rank": rank, "memory_gb": memory}
    try:
        shares = StateSharing(job, node, ctx, model).fractions     # the agree collective
    except UserError as e:
        out.put({**report, "refused": str(e)})
        finish()
        return
    ctrl = Controller(job, TASKS.get(model_kind.name)(args), model, ctx, state_shares=shares)
    g = torch.Generator().manual_seed(rank)
    losses, seconds = [], []
    for _ in range(updates):
        batch = model_kind.batch(1, g)
        begin = time.perf_counter()
        result = ctrl.train_step([batch], batch)
        seconds.append(time.perf_counter() - begin)
        losses.append(round(float(result.totals["loss"]) / result.sample_size, 4))
    report.update({"sharding": ctrl.describe_sharding(), "share": ctrl.state_shares()[rank],
                   "state_bytes_counted": ctrl.state_bytes(),
                   "state_storage_gb": round(storage_bytes(ctrl) / GB, 4),
                   "peak_rss_gb": round(peak_rss_bytes() / GB, 3),
                   "rss_gb_after": round(rss_bytes() / GB, 3),
                   "runtime_rss_gb": round(runtime / GB, 3),
                   "seconds_per_update": round(sum(seconds[1:]) / max(1, len(seconds) - 1), 3),
                   "loss_per_update": losses})
    out.put(report)
    del ctrl, model
    finish()


def spawn(worker, world, *args):
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, server.port, *args, queue), nprocs=world)
    return sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])


def train(layers, kind, memory_gb, updates):
    _, job, _ = parse(family(layers))
    size, params = size_of(layers, job)
    ranks = spawn(train_worker, 2, layers, kind, memory_gb, updates)
    row = {"layers": layers, "params": params, "state_shares": kind}
    if any("refused" in r for r in ranks):
        row["refused"] = [r.get("refused") for r in ranks]
        print(json.dumps(row), file=sys.stderr)
        return row
    for r in ranks:
        planned = r["share"] * size.sharded
        r["state_gb_counted"] = round(r.pop("state_bytes_counted") / GB, 4)
        r["counted_over_planned_share"] = round(r["state_gb_counted"] * GB / planned, 4)
        r["state_gb_planned_with_gathered_unit"] = round((size.whole + planned) / GB, 4)
        r["share"] = round(r["share"], 4)
    row["ranks"] = ranks
    print(json.dumps(row), file=sys.stderr)
    return row


# ---- 3. speed ----

SPEED_MODES = {"even_fsdp2": None, "even_fsdp2_again": None,
               "hetseq_1to1": [0.5, 0.5], "hetseq_1to3": [0.25, 0.75]}


def speed_worker(rank, world, port, steps, out):
    ctx = start(rank, world, port)
    args, job, _ = parse(Bert)
    ctrls = {name: Controller(job, TASKS.get(Bert.name)(args), Bert.build(), ctx,
                              state_shares=shares) for name, shares in SPEED_MODES.items()}
    described = {name: ctrl.describe_sharding() for name, ctrl in ctrls.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [Bert.batch(8, g) for _ in range(steps)]
    spent = take_turns(ctrls, batches)
    out.put({"rank": rank, "spent": spent, "described": described,
             "state_bytes": {name: ctrl.state_bytes() for name, ctrl in ctrls.items()}})
    del ctrls
    finish()


def speed(steps):
    ranks = spawn(speed_worker, 2, steps)
    timed = steps - 2
    seconds = {name: ranks[0]["spent"][name] / timed for name in SPEED_MODES}
    even = seconds["even_fsdp2"]
    ratios = {name: round(s / even, 3) for name, s in seconds.items()}
    return {"model": "default BERT (hidden 256, 4 layers, vocab 8192, seq 128), --zero 3, AdamW",
            "ranks": 2, "samples_per_rank": 8, "timed_updates": timed,
            "engines": ranks[0]["described"],
            "state_bytes_per_rank": {name: [r["state_bytes"][name] for r in ranks]
                                     for name in SPEED_MODES},
            "seconds_per_update": {name: round(s, 4) for name, s in seconds.items()},
            "step_time_vs_even": ratios,
            "hetseq_1to3_vs_hetseq_1to1": round(seconds["hetseq_1to3"] /
                                                seconds["hetseq_1to1"], 3),
            "goal_1to3_vs_even_at_most_1.1": ratios["hetseq_1to3"] <= 1.1}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gb", type=float, default=0.5,
                        help=f"rank 0's --max-memory-gb; rank 1 has {RATIO}x")
    parser.add_argument("--updates", type=int, default=3, help="AdamW updates per trained model")
    parser.add_argument("--speed-steps", type=int, default=30)
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_args()
    started = time.perf_counter()
    fit = largest(opts.memory_gb)
    print(json.dumps(fit), file=sys.stderr)
    small, big = fit["even"]["layers"], fit["memory"]["layers"]
    trained = {"largest_even_with_even_shares": train(small, "even", opts.memory_gb, opts.updates),
               "largest_even_with_memory_shares": train(small, "memory", opts.memory_gb,
                                                        opts.updates),
               "largest_memory_with_memory_shares": train(big, "memory", opts.memory_gb,
                                                          opts.updates),
               "largest_memory_with_even_shares": train(big, "even", opts.memory_gb,
                                                        opts.updates)}
    result = {"command": " ".join(["python", "bench/memory_shares.py", *sys.argv[1:]]),
              "torch": torch.__version__, "cpu_threads_per_rank": 1,
              "largest_bert_base_shape": fit, "trained": trained,
              "speed": speed(opts.speed_steps),
              "wall_seconds": None}
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    emit(result, opts.out)


if __name__ == "__main__":
    main()
