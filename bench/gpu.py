#!/usr/bin/env python
"""HetSeq's step on one CUDA GPU: samples/s, model FLOP utilisation, the
memory probe of --capacity auto, and --compile. Prints JSON.

Models: the default BERT of ``--task bert`` (hidden 256, 4 layers) and
BERT-base (hidden 768, 12 layers, vocab 30522), sequences of 128, on random
token batches keyed as the training iterator keys them (dropout drawn per
sample, hetseq/keyed/randomness.py), AdamW at a fixed rate, clip 1.
- speed: seconds per ``Controller.train_step`` (forward, backward, update),
  after 3 warm-up steps, synchronised, in fp32 (torch's default matmul
  precision, no TF32) and bf16 autocast;
- mfu: the FLOPs of one step counted by ``torch.utils.flop_counter``
  (matrix products and attention) times steps/s, over ``--peak-tflops``
  (dense bf16: about 989 on an H100 or H200 SXM);
- probe: the micro-batch cap ``capacity.cuda_memory_cap`` finds for
  BERT-base (what --capacity auto does on a GPU), on the whole card and with
  ``torch.cuda.set_per_process_memory_fraction(--fraction)`` as a small
  card; then 3 training steps at that cap, which must not run out of memory
  (the optimizer state appears only at the first step, after the probe);
- table: HetSeq's default step (eager and --compile) against a bare loop
  (eager and compiled) and transformers, BERT-base bf16 at sequence 128
  (batch 256) and 512 (batch 64): bench/step_table.py, docs/gpu.md;
- rate: --capacity auto's speed probe (startup.steady_rate over
  ``Controller.probe``) against the rate the same Controller trains at.

    python bench/gpu.py [--parts table,rate,probe,speed] [--out FILE]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import Bert, BertBase, register  # noqa: E402  (bench/models.py)
from output import emit  # noqa: E402

from hetseq.app import cli  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.plan.capacity import cuda_memory_cap  # noqa: E402
from hetseq.plan.startup import steady_rate  # noqa: E402
from hetseq.keyed.randomness import KeyedBatch, sample_keys  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402

CTX = DistContext(0, 1, 0, torch.device("cuda", 0))


def controller(kind, precision, *extra):
    register(kind)
    flags = ["--task", kind.name, "--optimizer", "adamw", "--lr", "1e-4", "--lr-scheduler",
             "fixed", "--clip-norm", "1", *(["--bf16"] if precision == "bf16" else []), *extra]
    args, job, _ = cli.parse(flags)
    return Controller(job, TASKS.get(kind.name)(args), kind.build(), CTX)


def keyed(kind, size, seed=0):
    sample = kind.batch(size, torch.Generator().manual_seed(seed))
    return KeyedBatch(sample, sample_keys(1, 1, range(size)))


def step(ctrl, batch):
    ctrl.train_step([batch], batch)


def seconds_per_step(ctrl, batch, steps):
    for _ in range(3):
        step(ctrl, batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(ctrl, batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def step_flops(ctrl, batch):
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step(ctrl, batch)
    return counter.get_total_flops()


def speed(kind, precision, size, steps, peak):
    ctrl = controller(kind, precision)
    batch = keyed(kind, size)
    flops = step_flops(ctrl, batch)
    seconds = seconds_per_step(ctrl, batch, steps)
    return {"model": kind.__name__, "precision": precision, "batch": size,
            "samples_per_s": round(size / seconds, 1), "step_s": round(seconds, 4),
            "tflop_per_step": round(flops / 1e12, 3),
            "achieved_tflops": round(flops / seconds / 1e12, 1),
            "mfu_vs_bf16_peak": round(flops / seconds / (peak * 1e12), 4)}


def probe(kind, precision, fraction, steps):
    """The cap the memory probe finds, and whether training at it fits."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    ctrl = controller(kind, precision)
    start = time.perf_counter()
    cap = cuda_memory_cap(lambda size: ctrl.probe(keyed(kind, size)), 64, 1 << 14)
    result = {"model": kind.__name__, "precision": precision, "memory_fraction": fraction,
              "card_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
              "cap": cap, "probe_s": round(time.perf_counter() - start, 1)}
    try:
        result["step_s_at_cap"] = round(seconds_per_step(ctrl, keyed(kind, cap), steps), 4)
        result["samples_per_s_at_cap"] = round(cap / result["step_s_at_cap"], 1)
        result["trained_at_cap"] = True
    except torch.cuda.OutOfMemoryError as err:
        result["trained_at_cap"] = False
        result["error"] = str(err).splitlines()[0][:300]
    result["peak_gib"] = round(torch.cuda.max_memory_allocated(0) / 2**30, 2)
    del ctrl
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    return result


def probe_rate(kind, size, steps):
    """The speed probe's rate against the rate the Controller trains at."""
    ctrl = controller(kind, "bf16")
    batch = keyed(kind, size)
    probed = steady_rate(lambda n: ctrl.probe(keyed(kind, n)), size, lockstep=False)
    trained = size / seconds_per_step(ctrl, batch, steps)
    return {"model": kind.__name__, "batch": size, "probe_samples_per_s": round(probed, 1),
            "trained_samples_per_s": round(trained, 1),
            "probe_over_trained (goal within 0.9-1.1)": round(probed / trained, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="table,rate,probe")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device")
    parts = opts.parts.split(",")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "peak_tflops": opts.peak_tflops}
    if "speed" in parts:
        result["speed"] = [speed(kind, precision, size, opts.steps, opts.peak_tflops)
                           for kind, size in ((Bert, 32), (Bert, 256), (BertBase, 128))
                           for precision in ("fp32", "bf16")]
    if "probe" in parts:
        result["probe"] = [probe(BertBase, "bf16", fraction, 3) for fraction in (0, opts.fraction)]
        cap = result["probe"][0]["cap"]
        if result["probe"][0].get("trained_at_cap"):
            result["speed"] = result.get("speed", []) + [
                speed(BertBase, "bf16", cap, opts.steps, opts.peak_tflops)]
    if "table" in parts:
        import step_table
        result["table"] = [step_table.table(BertBase, seq, size, CTX.device, peak=opts.peak_tflops)
                           for seq, size in ((128, 256), (512, 64))]
    if "rate" in parts:
        result["rate"] = probe_rate(BertBase, 256, opts.steps)
    emit(result, opts.out)


if __name__ == "__main__":
    main()
