"""Elastic jobs under faults: HetSeq --elastic beside torchrun's elastic restarts.

Three namespace hosts (tests/machinery/cluster.py, root needed), one CPU rank
each, global batch 48. The model is the float64 toy of the tests, each node
computing 6.25 ms per sample (``--toy-sample-ms``: 100 ms for its 16 of 48,
150 ms for 24 when a node is missing): what is measured is what a fault
costs the job (detection, meeting again, moving the state, redone work,
the capacity of the absent node), not compute, and three ranks on two
cores would not compute evenly anyway.

Runs, each until --updates updates are done:
- ``hetseq_clean``: ``--elastic``, no faults (the baseline);
- ``hetseq_faults``: the same job with a fault every --period seconds:
  host C killed, C back, host B frozen (SIGSTOP), B back (killed and
  restarted), host C switched off (link cut, then killed), C back;
- ``torchrun_faults``: the usual recipe, ``torchrun --nnodes 2:3
  --max-restarts N`` (c10d rendezvous on host A) running HetSeq with a
  checkpoint every --save-every updates in a save dir all hosts share
  (torchrun restarts every worker from it), with the same faults at the
  same moments;
- ``hetseq_one_kill`` and ``torchrun_one_kill``: host C killed once, at
  --kills-period: the cost of one restart (torchrun's re-rendezvous waits
  up to 30 s, c10d's last call, for more nodes);
- ``hetseq_leader_faults``: the faults hit host A, the meeting point and
  rank 0: frozen, back, switched off, back;
- ``hetseq_slowlink_clean`` and ``hetseq_slowlink_faults``: the default BERT
  over 100 Mbit/s links, in rounds of --local-steps (32), 8 sequences per
  node (B = 24), for --bert-updates updates: without faults, and with the
  faults above every --slow-period (30) seconds. A fault inside a round
  costs the round (docs/elastic.md: it is trained again).

Reported: per fault, the seconds from the fault to the next completed
update (for a node coming back: from its start to the first update it takes
part in); goodput = updates done x 48 / wall time from the first update,
and its ratio to the clean run (a job that stopped before --updates:
until it stopped, with its last error); updates trained twice (torchrun's
work since the last checkpoint). The PNG shows samples/s over time with the faults.

    python bench/elastic.py --out bench/results/elastic.json --png bench/results/elastic.png
"""

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests"))      # machinery: the test helpers

from bench.output import emit  # noqa: E402
from machinery import cluster as netns  # noqa: E402
from machinery.watched import Watched  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "5f0c1d2e3b4a69788796a5b4c3d2e1f0"   # generated-looking: the secret rules refuse counting runs
BATCH = 48
UPDATE = re.compile(r"\| epoch \d+ \| update (\d+)")
RESUMED = re.compile(r"resumed from .*: epoch \d+, (\d+) updates done")
# (kind, host): what happens at each --period.
FAULTS = [("kill", 2), ("back", 2), ("freeze", 1), ("back", 1), ("switch_off", 2), ("back", 2)]
# One host lost at --kills-period: the cost of one restart.
ONE_KILL = [("kill", 2)]
# The meeting point itself (host A, rank 0, the URL's address): frozen, back,
# switched off, back. A node back on A names B's address (any member serves
# the meeting point's port). torchrun has no counterpart: its c10d rendezvous
# lives in host A's agent, and the job ends with it.
LEADER = [("freeze", 0), ("back", 0), ("switch_off", 0), ("back", 0)]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the nodes train: ``flags(args, save)`` (job and node flags but
    the launcher's), the global batch, the updates of a run (``updates(args)``)
    and the hosts' links."""
    flags: object
    batch: int
    updates: object
    rate: str = "1gbit"


def job_flags(args, save, batch=BATCH):
    return ["--task", "toy", "--user-dir", os.path.join(ROOT, "tests", "tasks"), "--cpu",
            "--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "fixed", "--clip-norm", "0",
            "--disable-validation", "--toy-size", 960, "--max-update", args.updates,
            "--global-batch-size", batch, "--toy-sample-ms", args.sample_ms,
            "--distributed-timeout", args.timeout, "--log-format", "simple",
            "--log-interval", 1, "--no-progress-bar", "--save-dir", save]


def slowlink_flags(args, save):
    """The default BERT in rounds of --local-steps (docs/slow-links.md), 8
    sequences per node: the state a joiner receives is 5.4 M parameters
    with their Adam moments and the outer momentum."""
    return ["--task", "bert-slowed", "--user-dir", os.path.join(ROOT, "bench", "tasks"), "--cpu",
            "--max-sentences", 8, "--global-batch-size", SLOWLINK_BATCH,
            "--local-steps", args.local_steps, "--max-update", args.bert_updates,
            "--disable-validation", "--distributed-timeout", 60, "--log-format", "simple",
            "--log-interval", 1, "--no-progress-bar", "--save-dir", save]


SLOWLINK_BATCH = 24
TOY = Workload(lambda args, save: [*job_flags(args, save), "--max-sentences", 16], BATCH,
               lambda args: args.updates)
SLOWLINK = Workload(slowlink_flags, SLOWLINK_BATCH, lambda args: args.bert_updates,
                    rate="100mbit")


class Job:
    """The nodes of one run, started and faulted by host."""

    def __init__(self, cluster, launcher, args, folder, workload=TOY):
        self.cluster, self.launcher, self.args, self.folder = cluster, launcher, args, folder
        self.workload = workload
        self.nodes, self.dead = [], []
        self.started = {}

    def start(self, host):
        argv, secret = self.launcher(self, host)
        env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
               **({"HETSEQ_JOB_SECRET": SECRET} if secret else {})}
        proc = self.cluster.popen(host, argv, env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        watched = Watched(proc)
        watched.host = host
        self.nodes.append(watched)
        self.started[host] = time.monotonic()
        return watched

    def fault(self, kind, host):
        """Every process of the host (torchrun's agent with its worker) at once."""
        if kind == "switch_off":
            self.cluster.cut(host)
        if kind == "back":
            self.cluster.signal_host(host, signal.SIGKILL)     # a frozen machine is rebooted
            self.cluster.plug(host)
        else:
            self.cluster.signal_host(host, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
        self.dead += [n for n in self.nodes if n.host == host and n not in self.dead]
        if kind == "back":
            self.start(host)

    def updates(self):
        """([(time, updates done)] from every node's log, in time order; the
        updates trained, again ones included). Under --local-steps a line
        stands for a round of updates."""
        events = sorted((t, line) for node in self.nodes for t, line in node.stamped
                        if UPDATE.search(line) or RESUMED.search(line))
        done, trained, timeline = 0, 0, []
        for t, line in events:
            resumed = RESUMED.search(line)
            if resumed:
                done = int(resumed.group(1))
                continue
            number = int(UPDATE.search(line).group(1))
            trained, done = trained + max(0, number - done), number
            timeline.append((t, done))
        return timeline, trained


def hetseq_launcher(job, host):
    save = os.path.join(job.folder, f"host{host}")
    # A's node back after A was lost finds the job through B.
    entry = 1 if host == 0 and host in job.started else 0
    url = f"tcp://{job.cluster.addresses[entry]}:29600"
    return [sys.executable, os.path.join(ROOT, "train.py"),
            *map(str, job.workload.flags(job.args, save)), "--elastic", "--min-nodes", "2",
            "--distributed-init-method", url], True


def torchrun_launcher(job, host):
    save = os.path.join(job.folder, "shared")      # torchrun resumes from a shared disk
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3",
            "--nproc-per-node", "1", "--max-restarts", str(job.args.max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.cluster.names[0]}:29400",
            "--rdzv-id", "bench", os.path.join(ROOT, "train.py"),
            *map(str, job_flags(job.args, save)), "--capacity", "equal",
            "--save-interval-updates", str(job.args.save_every)], False


def run(launcher, faults, period, args, workload):
    """One job on three fresh hosts, a fault every ``period`` s; the measurements."""
    with netns.VirtualCluster(3, rate=workload.rate) as cluster, \
            tempfile.TemporaryDirectory() as folder:
        job = Job(cluster, launcher, args, folder, workload)
        for host in range(3):
            job.start(host)
        first = wait_until(lambda: job.updates()[0], args.limit, job,
                           give_up=lambda: all_ended(job))[0][0]
        moments = []
        for index, (kind, host) in enumerate(faults):
            wait_until(lambda: time.monotonic() >= first + (index + 1) * period or
                       finished(job, args), args.limit, job)
            if finished(job, args):
                break
            moments.append((time.monotonic(), kind, host))
            job.fault(kind, host)
        # A job that cannot go on may also hang: it has until --limit.
        wait_until(lambda: finished(job, args) or all_ended(job), args.limit, fatal=False)
        ended = time.monotonic()
        for node in job.nodes:
            if node not in job.dead and node.proc.poll() is None:
                node.finish(60 if finished(job, args) else 0.1)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for index, node in enumerate(job.nodes):
                with open(os.path.join(args.logs, f"{launcher.__name__}-{index}-host"
                                                  f"{'ABC'[node.host]}.log"), "w") as f:
                    f.write(node.output())
        timeline, trained = job.updates()
        return summarize(timeline, trained, moments, (first, ended), job, args)


def finished(job, args):
    timeline = job.updates()[0]
    return bool(timeline) and timeline[-1][1] >= job.workload.updates(args)


def all_ended(job):
    return all(node.proc.poll() is not None for node in job.nodes if node not in job.dead)


def wait_until(condition, limit, job=None, fatal=True, give_up=lambda: False):
    """``condition()``'s value once true; after ``limit`` s, or at once when
    ``give_up()`` (every node ended), exit with the first nodes' last lines."""
    deadline = time.monotonic() + limit
    while not (value := condition()):
        if time.monotonic() > deadline or give_up():
            if not fatal:
                return None
            tails = "".join(f"\n--- {netns.host_name(n.host)} ---\n" + "".join(n.lines[-15:])
                            for n in (job.nodes[:4] if job else []))
            raise SystemExit(f"bench/elastic.py: nothing happened within {limit} s{tails}")
        time.sleep(0.2)
    return value


def summarize(timeline, trained, moments, span, job, args):
    (first, ended), (end, done) = span, timeline[-1]
    completed = done >= job.workload.updates(args)
    end = end if completed else ended     # an unfinished job: until it gave up
    faults = []
    for at, kind, host in moments:
        start = job.started[host] if kind == "back" else at
        after = [t for t, _ in timeline if t > start]
        if kind == "back":   # the first update after the state was handed out again
            resumed = [t for node in job.nodes for t, line in node.stamped
                       if t > start and RESUMED.search(line)]
            after = [t for t in after if resumed and t > min(resumed)]
        faults.append({"kind": kind, "host": "ABC"[host], "at_s": round(at - first, 1),
                       "to_next_update_s": round(after[0] - start, 1) if after else None})
    errors = [line.strip()[:240] for node in job.nodes for _, line in node.stamped
              if re.search(r"Error:|ERROR", line)]
    return {"completed": completed, "updates": done, "wall_s": round(end - first, 1),
            **({} if completed else {"last_error": errors[-1] if errors else None}),
            "global_batch": job.workload.batch,
            "goodput_samples_per_s": round(done * job.workload.batch / (end - first), 1),
            "updates_trained_twice": trained - done, "stalled_s": stalled_s(timeline),
            "faults": faults,
            "timeline": [(round(t - first, 2), n) for t, n in timeline]}


def stalled_s(timeline):
    """Seconds without an update beyond the usual step: what faults cost
    besides the capacity of the absent nodes (the rest of the goodput lost:
    fewer nodes take more micro-batches each)."""
    gaps = sorted(b[0] - a[0] for a, b in zip(timeline, timeline[1:]))
    usual = gaps[len(gaps) // 2] if gaps else 0.0
    return round(sum(gap - usual for gap in gaps if gap > 3 * usual), 1)


FIGURE = ("hetseq_clean", "hetseq_faults", "torchrun_faults")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, result in results.items():
        times = [t for t, _ in result["timeline"]]
        end = result["wall_s"]
        grid = [i / 4 for i in range(int(end * 4) + 1)]     # every 0.25 s until the job ended
        rate = [sum(1 for s in times if t - 5 < s <= t) * result.get("global_batch", BATCH) / 5
                for t in grid]
        ax.plot(grid, rate, label=name)
    for fault in results.get("hetseq_faults", {}).get("faults", []):
        ax.axvline(fault["at_s"], color="grey", linestyle=":")
        ax.text(fault["at_s"], ax.get_ylim()[1] * 0.95, f"{fault['kind']} {fault['host']}",
                rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds since the first update")
    ax.set_ylabel("samples/s (5 s window)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--sample-ms", type=float, default=6.25,
                        help="each node's compute per sample (16 samples: 100 ms)")
    parser.add_argument("--period", type=float, default=20, help="seconds between faults")
    parser.add_argument("--kills-period", type=float, default=30,
                        help="when the *_one_kill runs lose host C (seconds)")
    parser.add_argument("--timeout", type=float, default=10, help="--distributed-timeout")
    parser.add_argument("--save-every", type=int, default=50,
                        help="torchrun's checkpoint interval (updates)")
    parser.add_argument("--max-restarts", type=int, default=10)
    parser.add_argument("--bert-updates", type=int, default=256,
                        help="updates of the slow-link runs (BERT over 100 Mbit/s)")
    parser.add_argument("--local-steps", type=int, default=32,
                        help="the slow-link runs' --local-steps")
    parser.add_argument("--slow-period", type=float, default=30,
                        help="seconds between faults in the slow-link run")
    parser.add_argument("--limit", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--only", action="append",
                        choices=["hetseq_clean", "hetseq_faults", "torchrun_faults",
                                 "hetseq_one_kill", "torchrun_one_kill",
                                 "hetseq_leader_faults", "hetseq_slowlink_clean",
                                 "hetseq_slowlink_faults"])
    parser.add_argument("--logs", help="write every node's output into this folder")
    parser.add_argument("--out")
    parser.add_argument("--replot", metavar="JSON", help="only draw --png from an earlier --out")
    parser.add_argument("--add", action="store_true", help="keep the other runs already in --out")
    parser.add_argument("--png")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot({k: v for k, v in json.load(f).items() if k in FIGURE}, args.png)
        return
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"bench/elastic.py needs namespace hosts: {why}")
    netns.remove_stale()
    runs = {"hetseq_clean": (hetseq_launcher, [], 0, TOY),
            "hetseq_faults": (hetseq_launcher, FAULTS, args.period, TOY),
            "torchrun_faults": (torchrun_launcher, FAULTS, args.period, TOY),
            "hetseq_one_kill": (hetseq_launcher, ONE_KILL, args.kills_period, TOY),
            "hetseq_leader_faults": (hetseq_launcher, LEADER, args.period, TOY),
            "torchrun_one_kill": (torchrun_launcher, ONE_KILL, args.kills_period, TOY),
            "hetseq_slowlink_clean": (hetseq_launcher, [], 0, SLOWLINK),
            "hetseq_slowlink_faults": (hetseq_launcher, FAULTS, args.slow_period, SLOWLINK)}
    results = {name: run(launcher, faults, period, args, workload)
               for name, (launcher, faults, period, workload) in runs.items()
               if not args.only or name in args.only}
    if args.add and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            results = {**{k: v for k, v in json.load(f).items()
                          if k not in ("setup", "global_batch")}, **results}
    for name, result in results.items():
        result["stalled_s"] = stalled_s(result["timeline"])
        # Against the clean run of the same workload.
        baseline = "hetseq_slowlink_clean" if "slowlink" in name else "hetseq_clean"
        clean = results.get(baseline, {}).get("goodput_samples_per_s")
        if clean:
            result["goodput_vs_clean"] = round(result["goodput_samples_per_s"] / clean, 3)
    if args.png:
        plot({k: v for k, v in results.items() if k in FIGURE}, args.png)
    emit({"setup": {k: v for k, v in vars(args).items()
                    if k not in ("out", "png", "only", "logs", "add", "replot")},
          "global_batch": BATCH, **results}, args.out)


if __name__ == "__main__":
    main()
