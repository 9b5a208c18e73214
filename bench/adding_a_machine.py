"""bench/hetero.py's section "adding a machine": is a job of a fast rank and
a second machine ever slower than the best set of its ranks?

Each row is a fast rank (host A) and a second rank (host B), namespace hosts
on one machine (tests/machinery/cluster.py) with their own addresses; host
B's link is 1 Gbit/s or 10 Mbit/s (``tc``). Ranks sleep factor x
``ms`` per sample on a tiny model with ``extra_mb`` MB of parameters more (the
gradient the exchange sums). Three jobs per row, train.py on the hosts:

- ``alone``: rank 0 alone (one process, no exchange);
- ``both``: both ranks, with the plan fixed at the speeds' ratio
  (``--capacity f1,f0``: every rank in the exchange, whatever it costs);
- ``auto``: ``--capacity auto``, which may let rank 1 sit out.

``auto_over_best`` is auto's samples/s over the better of alone and both
(goal: >= 0.97); for two equal ranks ``auto_over_sum`` is over the sum of
two ranks alone (>= 0.95). Needs root (namespaces).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "tests"))     # machinery: the test helpers

from machinery import cluster as netns  # noqa: E402

WARM = 8             # updates left out of each rate (start-up, the first plan)
# name: (per-sample factors, ms of the fast rank, link of host B, extra MB)
# 5 ms a sample, as bench/hetero.py's mixes: an update of 64 samples then
# takes 0.32 s, and a step's fixed cost (about 13 ms here: the optimizer,
# the stats, the data) is the few percent it is on a real model, not the
# 10% it is of 2 ms samples. The 2000x row keeps 0.5 ms (its slow rank
# takes 1 s a sample as it is).
ROWS = {
    "2000x slower": ([1, 2000], 0.5, "1gbit", 0.25),
    "10x slower": ([1, 10], 5.0, "1gbit", 0.25),
    "10x slower behind 10 Mbit/s": ([1, 10], 5.0, "10mbit", 0.25),
    "two equal ranks": ([1, 1], 5.0, "1gbit", 0.25),
}


def _flags(factors, ms, extra_mb, updates, batch, save_dir):
    return [sys.executable, os.path.join(ROOT, "train.py"), "--task", "bench_hetero",
            "--user-dir", os.path.join(ROOT, "bench", "tasks"), "--cpu", "--no-progress-bar",
            "--log-interval", "1000", "--optimizer", "sgd", "--lr", "0.01", "--lr-scheduler",
            "fixed", "--clip-norm", "0", "--disable-validation", "--max-update", str(updates),
            "--global-batch-size", str(batch), "--save-dir", save_dir,
            "--save-interval-updates", "100000", "--bench-factors",
            ",".join(map(str, factors)), "--bench-ms-per-sample", str(ms),
            "--bench-extra-mb", str(extra_mb), "--distributed-timeout", "300"]


def _rate(save_dir):
    """Samples/s of the job's updates after WARM (rank 0's balance.jsonl)."""
    with open(os.path.join(save_dir, "balance.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    span = lines[-1]["time"] - lines[WARM]["time"]
    return sum(line["samples"] for line in lines[WARM + 1:]) / span, lines


def _job(hosts, base, world, capacity, port):
    """One job on the hosts: rank r on host r; returns (samples/s, rank 0's log)."""
    procs = []
    for rank in range(world):
        argv = [*base, "--capacity", capacity]
        if world > 1:
            argv += ["--distributed-world-size", str(world), "--distributed-rank", str(rank),
                     "--distributed-init-method", f"tcp://{netns.SUBNET}.1:{port}"]
        # The hosts share this machine's cores: one thread each, as the
        # ranks of one node get (a process alone would take all of them).
        procs.append(hosts.popen(rank, argv, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a job failed:\n{outputs[0][-3000:]}\n{outputs[-1][-3000:]}")
    return outputs[0]


def row(name, updates, batch, port):
    factors, ms, link, extra_mb = ROWS[name]
    result = {"factors": factors, "ms_per_sample": ms, "link_of_rank_1": link,
              "extra_mb": extra_mb}
    with netns.VirtualCluster(2, rate="1gbit") as hosts:
        hosts.set_host_rate(1, link)
        rates = {}
        for job, world, capacity in (("alone", 1, "equal"),
                                     ("both", 2, f"{factors[1]},{factors[0]}"),
                                     ("auto", 2, "auto")):
            with tempfile.TemporaryDirectory() as save_dir:
                base = _flags(factors[:world], ms, extra_mb, updates, batch, save_dir)
                log = _job(hosts, base, world, capacity, port)
                port += 1
                rates[job], lines = _rate(save_dir)
            result[f"{job}_samples_per_s"] = round(rates[job], 1)
            result[f"{job}_final_split"] = lines[-1]["batch_sizes"]
            if job == "auto":
                result["auto_sits_out"] = [line.split(" | ")[-1] for line in log.splitlines()
                                           if " sits out: " in line]
    best = max(rates["alone"], rates["both"])
    result["auto_over_best"] = round(rates["auto"] / best, 3)
    if factors[0] == factors[1]:
        result["auto_over_sum"] = round(rates["auto"] / (2 * rates["alone"]), 3)
    return result, port


def adding_a_machine(updates=40, batch=128, names=None):
    """Every row (or ``names``): {name: result}."""
    available, why = netns.available()
    if not available:
        return {"skipped": why}
    netns.remove_stale()
    report, port = {}, 29700
    for name in names or ROWS:
        report[name], port = row(name, updates, batch, port)
    ratios = [r["auto_over_best"] for r in report.values()]
    report["worst_auto_over_best"] = min(ratios)
    report["median_auto_over_best"] = statistics.median(ratios)
    return report
