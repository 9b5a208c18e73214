#!/usr/bin/env python
"""How well the time left holds on the README's own jobs: each progress
line's "H:MM:SS left" against what actually remained (the job's end less
the moment the line was read), idle or under load (``--load N``: N busy
processes for the whole run). Prints JSON: per line the update, the
estimate, what remained and their ratio; the worst error after the first
tenth of the run (issue 61's goal: within 25%).

    python bench/time_left.py [--job main|two-node] [--load N] [--out FILE]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"update (\d+)/(\d+) \| (\d+):(\d\d):(\d\d) left")

JOBS = {
    # The README's main job and its two-node example, as printed there.
    "main": lambda save: [sys.executable, "train.py", "--task", "bert", "--max-update", "60",
                          "--max-sentences", "16", "--lr", "5e-4", "--warmup-updates", "10",
                          "--distributed-world-size", "2", "--cpu", "--no-progress-bar",
                          "--log-interval", "10", "--save-dir", save],
    "two-node": lambda save: [sys.executable, "-m", "hetseq.launch", "--hostfile",
                              os.path.join(save, "hosts"), "--launcher", "local", "train.py",
                              "--task", "bert", "--max-update", "20", "--lr", "5e-4",
                              "--warmup-updates", "5", "--log-interval", "5",
                              "--disable-validation", "--save-dir", save],
}


def busy():
    """A process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(job, load):
    with tempfile.TemporaryDirectory() as save:
        if job == "two-node":
            with open(os.path.join(save, "hosts"), "w") as f:
                f.write("localhost slots=1 cpu max-sentences=12\n"
                        "localhost slots=1 cpu max-sentences=4\n")
        hogs = [busy() for _ in range(load)]
        try:
            started = time.monotonic()
            proc = subprocess.Popen(JOBS[job](save), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            seen = []
            for line in proc.stdout:
                found = LINE.search(line)
                if found:
                    update, planned, h, m, s = map(int, found.groups())
                    seen.append((time.monotonic(), update, planned, 3600 * h + 60 * m + s))
            code = proc.wait()
            ended = time.monotonic()
        finally:
            for hog in hogs:
                hog.kill()
    lines = [{"update": update, "estimate_s": left, "remained_s": round(ended - at, 1),
              "ratio": round(left / (ended - at), 3) if ended > at else None}
             for at, update, planned, left in seen]
    planned = seen[0][2] if seen else 0
    counted = [line for line in lines if line["update"] >= planned / 10 and line["ratio"]]
    return {"job": job, "load_processes": load, "exit_code": code,
            "seconds": round(ended - started, 1), "lines": lines,
            "worst_error_after_first_tenth": round(max(abs(line["ratio"] - 1)
                                                       for line in counted), 3)
            if counted else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), action="append")
    parser.add_argument("--load", type=int, action="append",
                        help="busy processes beside the job (several: one run each)")
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = [measure(job, load) for job in args.job or ["main"] for load in args.load or [0]]
    emit({"cpu_count": os.cpu_count(), "runs": runs}, args.out)


if __name__ == "__main__":
    main()
