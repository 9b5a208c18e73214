#!/usr/bin/env python
"""What a test's train.py command costs started anew against forked from the
test zygote (tests/machinery/zygote.py), side by side on this machine: the
same toy commands (one process of 4 updates, and a job of two 1-rank nodes)
run alternately each way, wall seconds and the machine's CPU seconds
(/proc/stat) of each. Prints JSON with the ratios.

    python bench/zygote.py [--repeats N] [--out FILE]
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.append(os.path.join(ROOT, "tests"))     # machinery: the test helpers
from output import emit  # noqa: E402

from machinery.zygote import Zygote  # noqa: E402

TOY = [os.path.join(ROOT, "train.py"), "--task", "toy", "--user-dir",
       os.path.join(ROOT, "tests", "tasks"), "--cpu", "--no-progress-bar", "--max-update", "4",
       "--no-save", "--disable-validation"]


def busy_seconds():
    """CPU seconds the whole machine has been busy (user, nice, system, irq)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(kind):
    if kind == "one process":
        return [[*TOY, "--max-sentences", "8"]]
    url = f"tcp://127.0.0.1:{free_port()}"
    return [[*TOY, "--max-sentences", "8", "--distributed-world-size", "2",
             "--distributed-rank", str(rank), "--distributed-init-method", url]
            for rank in (0, 1)]


def timed(start, kind, folder):
    """(wall s, CPU s) of ``kind``'s commands started with ``start`` and waited for."""
    before, began = busy_seconds(), time.monotonic()
    procs = [start(argv, folder) for argv in commands(kind)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} failed ({proc.returncode}):\n{out[-2000:]}")
    return time.monotonic() - began, busy_seconds() - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    zygote = Zygote()
    ways = {"fresh": lambda argv, cwd: subprocess.Popen([sys.executable, *argv], cwd=cwd,
                                                         env=env, **pipes),
            "zygote": lambda argv, cwd: zygote.popen(argv, cwd, env, **pipes)}
    results = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for kind in ("one process", "two nodes"):
                runs = {way: [] for way in ways}
                for _ in range(args.repeats):
                    for way, start in ways.items():      # alternately: the same load for both
                        runs[way].append(timed(start, kind, folder))
                mean = {way: [sum(r[i] for r in got) / len(got) for i in (0, 1)]
                        for way, got in runs.items()}
                results[kind] = {
                    "fresh_wall_s": round(mean["fresh"][0], 2),
                    "zygote_wall_s": round(mean["zygote"][0], 2),
                    "fresh_cpu_s": round(mean["fresh"][1], 2),
                    "zygote_cpu_s": round(mean["zygote"][1], 2),
                    "wall_ratio_fresh_over_zygote": round(mean["fresh"][0] / mean["zygote"][0], 1),
                    "cpu_ratio_fresh_over_zygote": round(mean["fresh"][1] / mean["zygote"][1], 1)}
    finally:
        zygote.close()
    emit({"benchmark": "test commands started anew vs forked from the zygote",
          "machine": f"{os.cpu_count()} cores", "repeats": args.repeats, "results": results},
         args.out)


if __name__ == "__main__":
    main()
