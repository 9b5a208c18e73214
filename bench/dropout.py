#!/usr/bin/env python
"""What drawing dropout per sample costs: the default BERT's training step
with HetSeq's keyed masks (hetseq/keyed/randomness.py) against torch's own dropout.

One process, the default BERT of ``--task bert`` (hidden 256, 4 layers,
4 heads, sequences of 128, batch 32, dropout 0.1 everywhere), SGD.
``Controller.train_step`` is given the same batch either as the iterator
gives it (a KeyedBatch: keyed masks, attention through the explicit path
that keys its probabilities' dropout) or bare (no keys: torch's
``F.dropout`` and SDPA's own attention dropout, what the model did before
sample-keyed draws). Steps are timed in pairs, the order flipping every pair,
so a shared machine's drift hits both alike; a third phase pairs the torch
step with itself (its ratio is the method's noise floor).

    python bench/dropout.py [--steps N] [--device cpu|cuda] [--out FILE]

Prints JSON: per precision, seconds per step of each and
``keyed_over_torch`` (step time ratio; below 1: keyed is faster).
"""

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.app import cli  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.keyed.randomness import KeyedBatch, sample_keys  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from models import Bert, register  # noqa: E402  (bench/models.py)
from output import emit  # noqa: E402


def controller_for(precision, device):
    register(Bert)
    flags = ["--task", Bert.name, "--optimizer", "sgd", "--lr", "0.01", "--lr-scheduler",
             "fixed", "--clip-norm", "0", *(["--bf16"] if precision == "bf16" else [])]
    args, job, _ = cli.parse(flags)
    ctx = DistContext(0, 1, device.index or 0, device)
    return Controller(job, TASKS.get(Bert.name)(args), Bert.build(), ctx)


def timed_pairs(pairs, first, second, sync):
    """Seconds per call of ``first`` and ``second``, alternating, order flipping."""
    spent = [0.0, 0.0]
    for i in range(pairs):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            sync()
            start = time.perf_counter()
            (first, second)[which]()
            sync()
            spent[which] += time.perf_counter() - start
    return [s / pairs for s in spent]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed pairs per phase")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sample = Bert.batch(opts.batch, torch.Generator().manual_seed(0))
    keyed = KeyedBatch(sample, sample_keys(1, 1, range(opts.batch)))
    result = {"model": "default BERT (hidden 256, 4 layers, seq 128, dropout 0.1)",
              "batch": opts.batch, "device": str(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
              "steps_per_phase": opts.steps}
    for precision in ("fp32", "bf16"):
        controller = controller_for(precision, device)

        def step(batch):
            return lambda: controller.train_step([batch], batch)
        timed_pairs(2, step(keyed), step(sample), sync)                 # warm-up
        keyed_s, torch_s = timed_pairs(opts.steps, step(keyed), step(sample), sync)
        control_a, control_b = timed_pairs(opts.steps, step(sample), step(sample), sync)
        result[precision] = {"keyed_step_s": round(keyed_s, 4), "torch_step_s": round(torch_s, 4),
                             "keyed_over_torch": round(keyed_s / torch_s, 4),
                             "control_torch_over_torch": round(control_a / control_b, 4)}
    emit(result, opts.out)


if __name__ == "__main__":
    main()
