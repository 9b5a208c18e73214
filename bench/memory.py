#!/usr/bin/env python
"""Memory and speed of the --zero modes on CPU ranks (gloo). Prints JSON.

1. state: per-rank model state (parameters + gradients + optimizer state,
   counted from the tensors each rank holds after one AdamW update, a shard
   counting its local part) and peak RSS, for BERT-base (110M) under
   --zero 0/1/2/3 and 3 --cpu-offload, on each world size of --ranks. Each
   mode runs in fresh processes, so peak RSS is that mode's own.
2. speed: step time of every mode relative to --zero 0 for the default BERT
   (hidden 256, 4 layers, seq 128) on 2 ranks, the same batches, measured side
   by side: the modes take turns step by step, the order rotating, so the
   drift of a shared machine hits all alike.
3. largest: the largest BERT (layers x hidden, seq 128, micro-batch 1) that
   fits in --cap-gb per rank on 2 ranks under --zero 0, 3 and 3 --cpu-offload.
   Model state per mode comes from the counts of part 1 (bytes per parameter,
   which part 1 checks against the tensors); activations are the bytes autograd
   saves for backward, measured for each hidden size at 1 and 2 layers.
   Under --zero 3 two units are gathered at once (the current one and the
   prefetched next one); with --cpu-offload on a GPU, the sharded state lives
   on the host, so only gathered units and activations count against the
   device (on a CPU rank host and device are the same memory).

    python bench/memory.py [--ranks 2,4] [--speed-steps 30] [--cap-gb 2] [--out FILE]
"""

import argparse
import datetime
import gc
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.app import cli  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from models import Bert, BertBase, register, take_turns  # noqa: E402  (bench/models.py)
from output import emit  # noqa: E402  (bench/output.py)

MODES = {"zero0": ["--zero", "0"], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"],
         "zero3": ["--zero", "3"], "zero3_offload": ["--zero", "3", "--cpu-offload"]}


def start(rank, world, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return DistContext(rank, world, rank, torch.device("cpu"), "gloo")


def controller(kind, flags, ctx):
    register(kind)
    args, job, _ = cli.parse(["--task", kind.name, "--optimizer", "adamw", "--lr", "1e-4",
                              "--lr-scheduler", "fixed", "--clip-norm", "1", *flags])
    return Controller(job, TASKS.get(kind.name)(args), kind.build(), ctx)


def finish():
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def state_worker(rank, world, port, flags, out):
    ctx = start(rank, world, port)
    ctrl = controller(BertBase, flags, ctx)
    batch = BertBase.batch(1, torch.Generator().manual_seed(rank))
    ctrl.train_step([batch], batch)
    params = sum(p.numel() for p in ctrl.model.parameters())
    out.put((rank, ctrl.state_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             params))
    del ctrl
    finish()


def speed_worker(rank, world, port, steps, out):
    ctx = start(rank, world, port)
    ctrls = {name: controller(Bert, flags, ctx) for name, flags in MODES.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [Bert.batch(8, g) for _ in range(steps)]
    spent = take_turns(ctrls, batches)
    if rank == 0:
        out.put(spent)
    del ctrls
    finish()


def spawn(worker, world, *args):
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, server.port, *args, queue), nprocs=world)
    return queue


def state_table(worlds):
    rows, per_param = [], {}
    for world in worlds:
        for name, flags in MODES.items():
            queue = spawn(state_worker, world, flags)
            results = sorted(queue.get() for _ in range(world))
            state = max(r[1] for r in results)
            params = results[0][3]
            rows.append({"ranks": world, "mode": name, "params": params,
                         "state_gb_per_rank": round(state / 2**30, 3),
                         "state_bytes_per_param": round(state / params, 2),
                         "peak_rss_gb_per_rank": round(max(r[2] for r in results) / 2**30, 3)})
            per_param[world, name] = state / params
            print(json.dumps(rows[-1]), file=sys.stderr)
    for row in rows:
        zero0 = per_param[row["ranks"], "zero0"]
        row["state_vs_zero0"] = round(row["state_bytes_per_param"] / zero0, 3)
    return rows


def speed_table(steps):
    queue = spawn(speed_worker, 2, steps)
    spent = queue.get()
    return {name: round(spent["zero0"] / seconds, 3) for name, seconds in spent.items()}


def activation_bytes(hidden, layers):
    """Bytes autograd saves for backward for one sample of 128 tokens."""
    from hetseq.bert import BertForPreTraining
    from hetseq.plan.capacity import saved_activation_bytes
    from hetseq.tasks.bert_pretraining import BertTask
    model = BertForPreTraining(bert_config(hidden, layers))
    g = torch.Generator().manual_seed(0)
    return saved_activation_bytes(
        lambda size: BertTask.loss(None, model, BertBase.batch(size, g)))(1)


def bert_config(hidden, layers):
    from hetseq.bert import BertConfig
    return BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                      max_position_embeddings=512)


def parameters(hidden, layers):
    from hetseq.bert import BertForPreTraining
    with torch.device("meta"):
        model = BertForPreTraining(bert_config(hidden, layers))
    layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    return sum(p.numel() for p in model.parameters()), layer


def largest_table(cap_gb, per_param, world=2):
    """Largest (layers, hidden) whose state + gathered units + activations fit."""
    cap = cap_gb * 2**30
    hiddens, layer_counts = (256, 512, 768, 1024, 1536, 2048), (2, 4, 6, 8, 12, 16, 24, 32, 48)
    fits = {mode: None for mode in ("zero0", "zero3", "zero3_offload_gpu")}
    for hidden in hiddens:
        one, two = activation_bytes(hidden, 1), activation_bytes(hidden, 2)
        for layers in layer_counts:
            params, layer = parameters(hidden, layers)
            activations = one + (layers - 1) * (two - one)
            gathered = 2 * 4 * layer       # fp32 units all-gathered at once under zero 3
            need = {"zero0": per_param["zero0"] * params + activations,
                    "zero3": per_param["zero3"] * params + gathered + activations,
                    "zero3_offload_gpu": gathered + activations}
            for mode, total in need.items():
                best = fits[mode]
                if total <= cap and (best is None or params > best["params"]):
                    fits[mode] = {"layers": layers, "hidden": hidden, "params": params,
                                  "need_gb": round(total / 2**30, 3)}
    return {"cap_gb_per_rank": cap_gb, "ranks": world, **fits}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes for the state table")
    parser.add_argument("--speed-steps", type=int, default=30)
    parser.add_argument("--cap-gb", type=float, default=2.0)
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_args()
    worlds = [int(w) for w in opts.ranks.split(",")]
    state = state_table(worlds)
    per_param = {row["mode"]: row["state_bytes_per_param"] for row in state if row["ranks"] == 2}
    result = {"state_bert_base": state,
              "step_speed_vs_zero0_default_bert_2_ranks": speed_table(opts.speed_steps),
              "largest_bert": largest_table(opts.cap_gb, per_param) if per_param else None}
    emit(result, opts.out)


if __name__ == "__main__":
    main()
