#!/usr/bin/env python
"""Equal vs capacity-aware (auto) batches on 2 CPU ranks, one about 2x slower.

1. Each rank's standalone rate (no communication; both measured at the same
   time in two processes, so they share the 2 cores as the job's ranks do):
   the ideal aggregate is their sum; equal batches are capped at 2 x the
   slower rate.
2. The same job with --capacity equal and --capacity auto: aggregate samples/s
   over the updates after warm-up.
   Also reported against the in-job ideal: the sum of the ranks' compute
   rates (waits excluded) in the same updates.
3. auto again, both ranks equally fast until update 30, then rank 1 becomes
   2x slower: updates until the aggregate is back above 0.9 of the new ideal.
Prints JSON. Targets: auto >= 0.95 of ideal; recovery within 20 updates.

    python bench/hetero.py
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hetseq import cli  # noqa: E402
from hetseq.distributed import launch  # noqa: E402
from hetseq.tasks import TASKS, import_user_dir  # noqa: E402
from hetseq.train import Run  # noqa: E402

TASK_DIR = os.path.join(ROOT, "bench", "tasks")
GLOBAL_BATCH = 128


def flags(mode, updates, extra=()):
    return ["--task", "bench_hetero", "--user-dir", TASK_DIR, "--cpu", "--no-progress-bar",
            "--log-interval", "1000", "--optimizer", "sgd", "--lr", "0.01",
            "--lr-scheduler", "fixed", "--clip-norm", "0", "--no-save", "--disable-validation",
            "--max-update", str(updates), "--capacity", mode, "--global-batch-size",
            str(GLOBAL_BATCH), "--distributed-world-size", "2", *map(str, extra)]


def standalone_rate(ms_per_sample, factor, batch=64, steps=12, repeats=7):
    """Samples/s of one rank alone with the given slowdown factor (1 thread;
    median of ``repeats`` timings, this machine is noisy)."""
    import_user_dir(TASK_DIR)
    torch.set_num_threads(1)
    args = cli.parse_args(flags("equal", 1, ["--bench-slow-rank", 0, "--bench-slow-factor", factor,
                                             "--bench-ms-per-sample", ms_per_sample]))
    task = TASKS.get("bench_hetero")(args)
    model, data = task.build_model(), task.load_dataset("train")
    sample = data.collater(list(range(batch)))
    task.train_step(model, sample)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            task.train_step(model, sample)
        rates.append(steps * batch / (time.perf_counter() - start))
    return statistics.median(rates)


def _standalone(index, ms_per_sample, factors, queue):
    queue.put((index, standalone_rate(ms_per_sample, factors[index])))


def standalone_pair(ms_per_sample, factors):
    """Both ranks' standalone rates, measured concurrently."""
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_standalone, args=(ms_per_sample, factors, queue), nprocs=len(factors))
    rates = dict(queue.get() for _ in factors)
    return [rates[i] for i in range(len(factors))]


def timed_worker(args, ctx, out):
    """Train as usual, recording when each update ends (rank 0 writes them)."""
    import_user_dir(args.user_dir)
    run = Run(args, ctx)
    marks, step = [], run.controller.train_step

    def recorded(samples, dummy, **kwargs):
        metrics = step(samples, dummy, **kwargs)
        marks.append((time.perf_counter(), metrics["sample_size"], list(run.plan.batch_sizes),
                      metrics["rank_times"], metrics["rank_samples"]))
        return metrics
    run.controller.train_step = recorded
    run.train()
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump(marks, f)


def run_job(mode, updates, extra=()):
    out = tempfile.mktemp(suffix=".json")
    launch(cli.parse_args(flags(mode, updates, extra)), timed_worker, out)
    with open(out) as f:
        marks = json.load(f)
    os.remove(out)
    return marks


def rate(marks, first, last):
    """Aggregate samples/s of updates first+1 .. last."""
    span = marks[last][0] - marks[first][0]
    return sum(m[1] for m in marks[first + 1:last + 1]) / span


def in_job_ideal(marks, first, last):
    """Sum of the ranks' compute rates in the same updates (each rank's samples
    over its compute seconds, waits excluded): the ideal measured in the job
    itself, immune to the machine drifting between the standalone phase and
    the job. Each update reports the previous update's times, hence the shift."""
    times = [sum(m[3][r] for m in marks[first + 2:last + 1]) for r in range(len(marks[0][3]))]
    samples = [sum(m[4][r] for m in marks[first + 2:last + 1]) for r in range(len(marks[0][4]))]
    return sum(n / t for n, t in zip(samples, times) if t > 0)


def plan_changes(marks):
    return sum(a[2] != b[2] for a, b in zip(marks, marks[1:]))


def calibrate():
    """Compute milliseconds per sample of the CNN on one thread."""
    return 1000.0 / standalone_rate(0.0, 1.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=60)
    opts = p.parse_args()
    import_user_dir(TASK_DIR)
    ms = calibrate()
    fast, slow = standalone_pair(ms, [1.0, 2.0])
    ideal = fast + slow
    slowed = ["--bench-slow-factor", 2.0, "--bench-ms-per-sample", ms]
    report = {"global_batch": GLOBAL_BATCH, "ms_per_sample": round(ms, 3),
              "standalone_samples_per_s": {"rank0": round(fast, 1), "rank1": round(slow, 1)},
              "ideal_samples_per_s": round(ideal, 1)}
    warm = 10
    for mode in ("equal", "auto"):
        marks = run_job(mode, opts.updates, slowed)
        agg = rate(marks, warm, len(marks) - 1)
        report[mode] = {"samples_per_s": round(agg, 1), "of_ideal": round(agg / ideal, 3),
                        "of_in_job_ideal": round(agg / in_job_ideal(marks, warm, len(marks) - 1), 3),
                        "final_split": marks[-1][2], "plan_changes": plan_changes(marks)}
    report["auto_over_equal"] = round(report["auto"]["samples_per_s"] /
                                      report["equal"]["samples_per_s"], 3)
    report["drift"] = drift(ms, fast, slow, opts.updates)
    print(json.dumps(report, indent=2))


def drift(ms, fast, slow, updates, change=30):
    """auto with both ranks fast until ``change``, then rank 1 2x slower."""
    # Start-up profiling makes 6 train_step calls before training.
    marks = run_job("auto", change + updates, ["--bench-slow-factor", 2.0,
                                               "--bench-ms-per-sample", ms,
                                               "--bench-slow-after", change + 6])
    new_ideal = fast + slow
    recovered = next((u - change for u in range(change + 3, len(marks))
                      if rate(marks, u - 3, u) >= 0.9 * new_ideal), None)
    tail = rate(marks, len(marks) - 11, len(marks) - 1)
    return {"slowdown_at_update": change, "new_ideal_samples_per_s": round(new_ideal, 1),
            "updates_to_recover_0.9": recovered, "final_of_new_ideal": round(tail / new_ideal, 3),
            "final_split": marks[-1][2], "plan_changes": plan_changes(marks)}


if __name__ == "__main__":
    main()
