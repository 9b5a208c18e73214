#!/usr/bin/env python
"""Equal vs capacity-aware (auto) batches on CPU ranks of different speeds.

1. Compute: 2 ranks training a small CNN, one about 2x slower (sleeping the
   difference), and the same with rank 1 turning 2x slower mid-run
   (updates until the job is back above 0.9 of the new ideal).
2. Mixes of speeds: 2, 3 and 4 ranks (``--mixes``), each rank sleeping
   factor x ``--sleep-ms`` per sample on a tiny model, so that more ranks than
   cores fit and the mix is exact.
3. Adding a machine (bench/adding_a_machine.py): a fast rank and a second
   one 2000x slower, 10x slower, 10x slower behind 10 Mbit/s, or as fast, on
   namespace hosts: --capacity auto against the better of the fast rank
   alone and both ranks in the exchange.

The ideal is the sum of the ranks' standalone rates (each rank alone, no
communication, all measured at the same time so they share the cores as in
the job); equal batches are capped at N x the slowest rate. Also reported:
the ideal measured inside the job (the sum of the ranks' compute rates, waits
excluded), plan changes, and the share of an update's wall time outside the
slowest rank's compute (all-reduce, optimizer step, stats: what balancing
cannot remove). Each mix also runs a hand-written DDP loop (the same model,
sleeps and SGD step, no HetSeq) with auto's final split: the floor this
machine sets for that split, so ``auto_over_ddp_same_split`` is HetSeq's own
cost (stats all-reduce, data, rebalancer, logging). Series come from each
job's ``balance.jsonl``; ``--plot`` draws per-rank samples/s and shares over
the updates for equal and auto.

    python bench/hetero.py --out bench/results/hetero.json --plot bench/results/hetero.png
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from hetseq.app import cli  # noqa: E402
from hetseq.distributed.spawn import launch  # noqa: E402
from hetseq.reporting.status import StatusBoard  # noqa: E402
from hetseq.tasks import TASKS, import_user_dir  # noqa: E402
from hetseq.run.loop import train_worker  # noqa: E402
from output import emit  # noqa: E402

TASK_DIR = os.path.join(ROOT, "bench", "tasks")
GLOBAL_BATCH = 128
WARM = 10


def flags(mode, updates, world, extra=(), save_dir=None):
    return ["--task", "bench_hetero", "--user-dir", TASK_DIR, "--cpu", "--no-progress-bar",
            "--log-interval", "1000", "--optimizer", "sgd", "--lr", "0.01",
            "--lr-scheduler", "fixed", "--clip-norm", "0", "--disable-validation",
            "--max-update", str(updates), "--capacity", mode, "--global-batch-size",
            str(GLOBAL_BATCH), "--distributed-world-size", str(world),
            *(["--save-dir", save_dir, "--save-interval-updates", "100000"] if save_dir
              else ["--no-save"]), *map(str, extra)]


def standalone_rate(extra, batch=64, steps=12, repeats=7):
    """Samples/s of one rank alone with the task flags ``extra`` (1 thread;
    median of ``repeats`` timings, this machine is noisy)."""
    import_user_dir(TASK_DIR)
    torch.set_num_threads(1)
    args = cli.parse_args(flags("equal", 1, 1, extra))
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


def _standalone(index, extras, repeats, queue):
    queue.put((index, standalone_rate(extras[index], repeats=repeats)))


def standalone_all(extras, repeats=7):
    """Each rank's standalone rate (task flags per rank), measured concurrently."""
    import torch.multiprocessing as mp
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_standalone, args=(extras, repeats, queue), nprocs=len(extras))
    rates = dict(queue.get() for _ in extras)
    return [rates[i] for i in range(len(extras))]


def run_job(mode, updates, world, extra=()):
    """Train; returns the job's balance.jsonl lines (one per update)."""
    folder = tempfile.mkdtemp()
    try:
        args, job, node = cli.parse(flags(mode, updates, world, extra, folder))
        launch(node, job.distributed_backend, train_worker, args, job, node, board=StatusBoard)
        with open(os.path.join(folder, "balance.jsonl")) as f:
            return [json.loads(line) for line in f]
    finally:
        shutil.rmtree(folder)


def rate(lines, first, last):
    """Aggregate samples/s of updates first+1 .. last (list positions)."""
    span = lines[last]["time"] - lines[first]["time"]
    return sum(line["samples"] for line in lines[first + 1:last + 1]) / span


def in_job_ideal(lines, first, last):
    """Sum of the ranks' compute rates in the same updates (samples over compute
    seconds, waits excluded): the ideal measured in the job itself, immune to
    the machine drifting between the standalone phase and the job."""
    used = [line for line in lines[first + 1:last + 1] if "rank_compute_s" in line]
    world = len(used[0]["rank_compute_s"])
    times = [sum(line["rank_compute_s"][r] for line in used) for r in range(world)]
    samples = [sum(line["rank_samples"][r] for line in used) for r in range(world)]
    return sum(n / t for n, t in zip(samples, times) if t > 0)


def outside_compute(lines, first, last):
    """Share of the update wall time outside the slowest rank's compute."""
    used = [line for line in lines[first + 1:last + 1] if "rank_compute_s" in line]
    wall = sum(line["wall_s"] for line in used)
    return 1 - sum(max(line["rank_compute_s"]) for line in used) / wall


def plan_changes(lines):
    return sum(a["batch_sizes"] != b["batch_sizes"] for a, b in zip(lines, lines[1:]))


def summary(lines, ideal):
    last = len(lines) - 1
    agg = rate(lines, WARM, last)
    return {"samples_per_s": round(agg, 1), "of_ideal": round(agg / ideal, 3),
            "of_in_job_ideal": round(agg / in_job_ideal(lines, WARM, last), 3),
            "outside_compute_share": round(outside_compute(lines, WARM, last), 3),
            "final_split": lines[-1]["batch_sizes"], "plan_changes": plan_changes(lines)}


def compare(world, extras_per_rank, job_extra, updates, repeats=7):
    """Standalone rates, then equal and auto jobs; returns (report, series)."""
    standalone = standalone_all(extras_per_rank, repeats)
    ideal = sum(standalone)
    report = {"standalone_samples_per_s": [round(r, 1) for r in standalone],
              "ideal_samples_per_s": round(ideal, 1),
              "equal_cap_of_ideal": round(world * min(standalone) / ideal, 3)}
    series = {}
    for mode in ("equal", "auto"):
        series[mode] = run_job(mode, updates, world, job_extra)
        report[mode] = summary(series[mode], ideal)
    report["auto_over_equal"] = round(report["auto"]["samples_per_s"] /
                                      report["equal"]["samples_per_s"], 3)
    return report, series


def calibrate():
    """Compute milliseconds per sample of the CNN on one thread."""
    return 1000.0 / standalone_rate(["--bench-slow-factor", 1.0, "--bench-ms-per-sample", 0.0])


def cnn_pair(updates):
    """Section 1: real compute, rank 1 2x slower; then a slowdown mid-run."""
    ms = calibrate()
    slowed = ["--bench-slow-factor", 2.0, "--bench-ms-per-sample", ms]
    # Alone, a process is rank 0: slowing "rank 1" leaves it fast, "rank 0" slows it.
    alone = [[*slowed, "--bench-slow-rank", 1 - rank] for rank in (0, 1)]
    report, series = compare(2, alone, slowed, updates)
    report["ms_per_sample"] = round(ms, 3)
    report["drift"], series["drift"] = drift(ms, report["ideal_samples_per_s"], updates)
    return report, series


def drift(ms, new_ideal, updates, change=30):
    """auto with both ranks fast until ``change``, then rank 1 2x slower."""
    # Start-up profiling makes 6 train_step calls before training.
    lines = run_job("auto", change + updates, 2, ["--bench-slow-factor", 2.0,
                                                  "--bench-ms-per-sample", ms,
                                                  "--bench-slow-after", change + 6])
    recovered = next((u - change for u in range(change + 3, len(lines))
                      if rate(lines, u - 3, u) >= 0.9 * new_ideal), None)
    first_change = next((u - change for u in range(change + 1, len(lines))
                         if lines[u]["batch_sizes"] != lines[u - 1]["batch_sizes"]), None)
    tail = rate(lines, len(lines) - 11, len(lines) - 1)
    return {"slowdown_at_update": change, "updates_to_first_plan_change": first_change,
            "updates_to_recover_0.9": recovered,
            "final_of_new_ideal": round(tail / new_ideal, 3),
            "final_split": lines[-1]["batch_sizes"], "plan_changes": plan_changes(lines)}, lines


def _ddp_rank(rank, init, extra, split, updates, queue):
    """One rank of the plain DDP loop: its slice of ``split`` every update."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(split))
    import_user_dir(TASK_DIR)
    task = TASKS.get("bench_hetero")(cli.parse_args(flags("equal", 1, 1, extra)))
    model = DistributedDataParallel(task.build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = task.load_dataset("train")
    ends = []
    for update in range(updates):
        start = update * sum(split) + sum(split[:rank])
        sample = data.collater(list(range(start, start + split[rank])))
        optimizer.zero_grad(set_to_none=True)
        task.train_step(model, sample)
        optimizer.step()
        ends.append(time.perf_counter())
    if rank == 0:
        queue.put(ends)
    del model
    gc.collect()    # DDP must go before its process group, or gloo can abort at exit
    dist.barrier()
    dist.destroy_process_group()


def ddp_same_split(extra, split, updates, ideal):
    """Samples/s of the plain DDP loop with ``split``, over the same updates."""
    import torch.multiprocessing as mp
    folder = tempfile.mkdtemp()
    try:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_ddp_rank, args=(f"file://{folder}/store", extra, split, updates, queue),
                 nprocs=len(split))
        ends = queue.get()
    finally:
        shutil.rmtree(folder)
    agg = sum(split) * (len(ends) - 1 - WARM) / (ends[-1] - ends[WARM])
    return {"samples_per_s": round(agg, 1), "of_ideal": round(agg / ideal, 3), "split": split}


def mix(factors, sleep_ms, updates, forward_share):
    """Section 2: ranks sleeping factor x sleep_ms per sample."""
    sleep = ["--bench-ms-per-sample", sleep_ms, "--bench-forward-share", forward_share]
    extra = ["--bench-factors", ",".join(map(str, factors)), *sleep]
    alone = [["--bench-factors", str(f), *sleep] for f in factors]
    # Sleeping is steady: 3 timings per rank are enough (a slow rank's take long).
    report, series = compare(len(factors), alone, extra, updates, repeats=3)
    report["ddp_same_split"] = ddp_same_split(extra, report["auto"]["final_split"], updates,
                                              report["ideal_samples_per_s"])
    report["auto_over_ddp_same_split"] = round(report["auto"]["samples_per_s"] /
                                               report["ddp_same_split"]["samples_per_s"], 3)
    return {"factors": factors, "sleep_ms": sleep_ms, **report}, series


def plot(series, path, title):
    """Per-rank samples/s and shares over the updates, one column per run
    (``series``: title -> balance.jsonl lines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(series), figsize=(5.5 * len(series), 6), squeeze=False)
    for column, (name, run) in enumerate(series.items()):
        lines = [line for line in run if "rank_samples_per_s" in line]
        updates = [line["update"] for line in lines]
        world = len(lines[0]["batch_sizes"])
        for r in range(world):
            axes[0][column].plot(updates, [line["rank_samples_per_s"][r] for line in lines],
                                 label=f"rank {r}")
            axes[1][column].plot(updates, [line["batch_sizes"][r] / sum(line["batch_sizes"])
                                           for line in lines], label=f"rank {r}")
        axes[0][column].set_title(name)
        axes[0][column].set_ylabel("samples/s (own compute)")
        axes[1][column].set_ylabel("share of the global batch")
        axes[1][column].set_ylim(0, 1)
        axes[1][column].set_xlabel("update")
        axes[0][column].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    global GLOBAL_BATCH
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--mixes", default="1,2;1,2,4;1,1,2,4;1,2,3,4",
                   help="speed factors per rank, mixes separated by ';'")
    p.add_argument("--sleep-ms", type=float, default=5.0,
                   help="milliseconds per sample of the fastest rank in the mixes")
    p.add_argument("--forward-share", type=float, default=1 / 3,
                   help="share of a mix's sleep before the forward, the rest in the "
                        "backward (1: ranks slow only at loading data)")
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    p.add_argument("--skip-cnn", action="store_true")
    p.add_argument("--sections", default="cnn,mixes,adding",
                   help="which to run, of cnn, mixes, adding (a machine: bench/"
                        "adding_a_machine.py, on namespace hosts; needs root)")
    p.add_argument("--adding-rows", help="rows of 'adding a machine' to run, separated by "
                   "';' (default: all)")
    p.add_argument("--out")
    p.add_argument("--plot", help="PNG of the 3-rank mix (per-rank rates and shares), and "
                   "<name>_slowdown.png of the CNN run that slows mid-way")
    opts = p.parse_args()
    import_user_dir(TASK_DIR)
    GLOBAL_BATCH = opts.global_batch
    report = {"global_batch": GLOBAL_BATCH, "warm_up_updates": WARM, "updates": opts.updates,
              "forward_share": round(opts.forward_share, 3)}
    sections = opts.sections.split(",")
    if not opts.skip_cnn and "cnn" in sections:
        report["cnn_2_ranks"], cnn = cnn_pair(opts.updates)
        if opts.plot:
            plot({"auto, rank 1 2x slower from update 30":
                  cnn["drift"]}, opts.plot.replace(".png", "_slowdown.png"),
                 "2 ranks (CNN): rebalancing after a slowdown")
    report["mixes"] = []
    for text in filter(None, opts.mixes.split(";") if "mixes" in sections else []):
        factors = [float(f) for f in text.split(",")]
        result, series = mix(factors, opts.sleep_ms, opts.updates, opts.forward_share)
        report["mixes"].append(result)
        if opts.plot and len(factors) == 3:
            plot({f"--capacity {mode}": series[mode] for mode in ("equal", "auto")},
                 opts.plot, f"{len(factors)} ranks, per-sample times "
                 f"{' : '.join(f'{f:g}' for f in factors)}")
    if "adding" in sections:
        from adding_a_machine import adding_a_machine
        report["adding_a_machine"] = adding_a_machine(
            opts.updates, opts.global_batch,
            opts.adding_rows.split(";") if opts.adding_rows else None)
    emit(report, opts.out)


if __name__ == "__main__":
    main()
