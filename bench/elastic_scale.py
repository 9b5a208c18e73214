"""Elastic membership at 8 to 64 nodes: what grows with the node count.

N namespace hosts (tests/machinery/cluster.py, root needed) on one 1 Gbit/s
switch, one CPU rank each, run the float64 toy of the tests with sleeping
compute (--toy-sample-ms): 4 samples per node in every update, so an update
computes for 4 x --sample-ms whatever N. What is measured is the meeting, the
heartbeats, the process group and the state transfer, not compute; N
processes share this machine's cores, so the absolute times include their
start (about 2 s of CPU each to import torch) and their contention.

For each N, in order:
- start: N nodes started at once (--max-nodes N: the first round closes as
  soon as all are there); seconds from the launch to the leader's
  ``generation 1`` line (every node started and met) and to the first update;
- steady: over --window s of training, the busiest store's (the leader's,
  host A) connections and bytes per second (``ss`` in host A's namespace,
  every socket on the store's port), the CPU that host A's processes use
  per second, and updates per second;
- kill: the last host killed (SIGKILL: its port refuses); seconds to the
  next update;
- freeze: the next host frozen (SIGSTOP: silent, found by the heartbeats);
  seconds to the next update;
- join: a node started on a spare host; seconds from its launch to the first
  update it takes part in (after its state arrived), from its first line of
  output (its process up) to that update, and the members' stall: from
  their last update without it to the first with it.

``growth`` gives, per measurement, the exponent k of cost ~ N^k between the
smallest and largest N (log-log slope): 1 is linear, 2 quadratic.

    python bench/elastic_scale.py --nodes 8 16 32 64 --out bench/results/elastic_scale.json
"""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests"))      # machinery: the test helpers

from bench.elastic import RESUMED, ROOT, SECRET, UPDATE, job_flags, wait_until  # noqa: E402
from bench.output import emit  # noqa: E402
from machinery import cluster as netns  # noqa: E402
from machinery.watched import Watched  # noqa: E402

PORT = 29700
PER_NODE = 4          # samples per node and update
SS_BYTES = re.compile(r"bytes_(sent|received):(\d+)")


class StoreWatch:
    """Samples every socket on the leader's store port in host A's namespace
    (``ss``) twice a second: the most connections seen, and each
    connection's byte counters (for bytes per second over a window)."""

    def __init__(self, cluster):
        self.cluster, self.peak, self.samples = cluster, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self):
        out = subprocess.run(["ip", "netns", "exec", self.cluster.namespaces[0], "ss", "-tinH",
                              "state", "established", f"( sport = :{PORT} )"],
                             capture_output=True, text=True, timeout=10).stdout
        sockets, current = {}, None
        for line in out.splitlines():
            if not line.startswith((" ", "\t")):
                current = line.split()[-1]            # the peer's address:port
                sockets[current] = 0
            elif current is not None:
                sockets[current] += sum(int(n) for _, n in SS_BYTES.findall(line))
        return sockets

    def _run(self):
        while not self._stop.wait(0.5):
            sockets = self._sample()
            self.peak = max(self.peak, len(sockets))
            self.samples.append((time.monotonic(), sockets))

    def between(self, start, end):
        """(connections, bytes per second) over [start, end]: sockets open at
        both ends of the window; the connections as of its end."""
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        (t0, first), (t1, last) = inside[0], inside[-1]
        moved = sum(last[peer] - first[peer] for peer in last if peer in first)
        return len(last), moved / (t1 - t0)

    def stop(self):
        self._stop.set()
        self._thread.join()


def host_cpu_s(cluster, host):
    """CPU seconds (user + system) of every process on ``host`` so far."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.namespaces[host]],
                          capture_output=True, text=True).stdout.split()
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks


class Scale:
    """One run of ``n`` nodes on ``n + 1`` hosts (the last one spare)."""

    def __init__(self, cluster, n, args, folder):
        self.cluster, self.n, self.args, self.folder = cluster, n, args, folder
        self.nodes, self.launched = [], {}

    def start(self, host):
        flags = job_flags(self.args, os.path.join(self.folder, f"host{host}"),
                          batch=PER_NODE * self.n)
        argv = [sys.executable, os.path.join(ROOT, "train.py"), *map(str, flags),
                "--elastic", "--min-nodes", "2", "--max-nodes", str(self.n),
                "--max-sentences", str(2 * PER_NODE), "--no-save",
                "--heartbeat-timeout", str(self.args.heartbeat),
                "--distributed-init-method", f"tcp://{self.cluster.addresses[0]}:{PORT}"]
        env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
               "HETSEQ_JOB_SECRET": SECRET}
        proc = self.cluster.popen(host, argv, env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.launched[host] = time.monotonic()
        watched = Watched(proc)
        watched.host = host
        self.nodes.append(watched)
        return watched

    def leader(self):
        return self.nodes[0]

    def updates(self):
        return [t for t, line in self.leader().stamped if UPDATE.search(line)]

    def next_update(self, after):
        """Seconds from ``after`` to the leader's first update after it."""
        when = wait_until(lambda: [t for t in self.updates() if t > after], self.args.limit,
                          self)[0]
        return when - after


def run(n, args):
    with netns.VirtualCluster(n + 1) as cluster, tempfile.TemporaryDirectory() as folder:
        store = StoreWatch(cluster)
        scale, result = Scale(cluster, n, args, folder), {"nodes": n}
        try:
            measure(scale, store, result)
        except SystemExit as stuck:      # a step that never came: say which, go on with the next N
            result["stuck"] = str(stuck).splitlines()[0]
        except Exception as err:         # the bench's own bug: keep the other N's results
            result["error"] = repr(err)
        finally:
            store.stop()
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                for host, node in enumerate(scale.nodes):
                    with open(os.path.join(args.logs, f"n{n}-host{host}.log"), "w") as f:
                        f.write("".join(f"{t:.2f} {line}" for t, line in node.stamped))
        return result


def measure(scale, store, result):
    """Each step's measurements into ``result``, as they come."""
    n, args, cluster = scale.n, scale.args, scale.cluster
    for host in range(n):
        scale.start(host)
    launched = time.monotonic()
    met = wait_until(lambda: [t for t, line in scale.leader().stamped
                              if "generation 1:" in line], args.limit, scale)[0]
    first = scale.next_update(launched) + launched
    result["start"] = {"to_met_s": round(met - launched, 1),
                       "to_first_update_s": round(first - launched, 1),
                       "peak_connections": store.peak}
    # Steady training: a few updates in, then the window.
    wait_until(lambda: len(scale.updates()) >= 5, args.limit, scale)
    start, cpu0 = time.monotonic(), host_cpu_s(cluster, 0)
    time.sleep(args.window)
    end, cpu1 = time.monotonic(), host_cpu_s(cluster, 0)
    connections, rate = store.between(start, end)
    done = len([t for t in scale.updates() if start <= t <= end])
    result["steady"] = {"store_connections": connections,
                        "store_bytes_per_s": round(rate),
                        "leader_host_cpu_s_per_s": round((cpu1 - cpu0) / (end - start), 3),
                        "updates_per_s": round(done / (end - start), 2)}
    faults = result["faults"] = {}
    for kind, host, sig in (("kill", n - 1, signal.SIGKILL), ("freeze", n - 2, signal.SIGSTOP)):
        at = time.monotonic()
        cluster.signal_host(host, sig)
        faults[kind] = {"to_next_update_s": round(scale.next_update(at), 1)}
        wait_until(lambda: len([t for t in scale.updates() if t > at]) >= 3, args.limit,
                   scale)
    joiner = scale.start(n)
    # Rank 0 says when the generation with the joiner took its state.
    resumed = wait_until(lambda: [t for t, line in scale.leader().stamped
                                  if t > scale.launched[n] and RESUMED.search(line)],
                         args.limit, scale)[0]
    joined = resumed + scale.next_update(resumed)
    up = wait_until(lambda: joiner.stamped, args.limit, scale)[0][0]
    before = max(t for t in scale.updates() if t < resumed)
    faults["join"] = {"to_next_update_s": round(joined - scale.launched[n], 1),
                      "from_its_first_line_s": round(joined - up, 1),
                      "members_stalled_s": round(joined - before, 1)}
    result["peak_connections"] = store.peak


def growth(results):
    """Per measurement: the exponent k of cost ~ N^k between the smallest
    and largest N (1: linear, 2: quadratic)."""
    done = [r for r in results if "stuck" not in r and "error" not in r]
    if len(done) < 2:
        return {}
    small, large = done[0], done[-1]
    ratio = math.log(large["nodes"] / small["nodes"])
    picks = {"to_met_s": lambda r: r["start"]["to_met_s"],
             "to_first_update_s": lambda r: r["start"]["to_first_update_s"],
             "store_bytes_per_s": lambda r: r["steady"]["store_bytes_per_s"],
             "store_connections": lambda r: r["steady"]["store_connections"],
             "leader_host_cpu_s_per_s": lambda r: r["steady"]["leader_host_cpu_s_per_s"],
             **{f"{kind}_to_next_update_s": (lambda r, k=kind: r["faults"][k]["to_next_update_s"])
                for kind in ("kill", "freeze", "join")}}
    return {name: round(math.log(pick(large) / pick(small)) / ratio, 2)
            for name, pick in picks.items() if pick(small) > 0 and pick(large) > 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--sample-ms", type=float, default=25.0,
                        help="each node's compute per sample (4 samples: 100 ms)")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="--heartbeat-timeout")
    parser.add_argument("--timeout", type=float, default=60, help="--distributed-timeout")
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds of steady training measured")
    parser.add_argument("--limit", type=float, default=600, help="seconds one step may take")
    parser.add_argument("--logs", help="write every node's output into this folder")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.updates = 10 ** 6           # the run is stopped after the joiner took part
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"bench/elastic_scale.py needs namespace hosts: {why}")
    netns.remove_stale()
    results = []
    for n in sorted(args.nodes):
        results.append(run(n, args))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)    # as they come
    emit({"setup": {k: v for k, v in vars(args).items() if k not in ("out", "updates", "logs")},
          "per_node_samples": PER_NODE, "runs": results, "growth": growth(results)}, args.out)


if __name__ == "__main__":
    main()
