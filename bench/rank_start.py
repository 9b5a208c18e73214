#!/usr/bin/env python
"""How one node of 2 CPU ranks (``python train.py``) starts and ends: its
ranks forked from the command itself (what it does while it has one
thread), the same without freezing the command's objects before the fork
(spawn._frozen_for), from a fork server that ends at once (hetseq/
distributed/quick_exit.py; what it does with more threads), and from one
that runs the interpreter's teardown instead.

Per way: the machine's CPU seconds and the wall seconds of the whole
command, and how long after its last line the command exited and its
output closed (the fork server holds the same standard output, so anything
reading it, ``| tee log``, a CI log, ``subprocess.run``, waits for it).
Alternately each way, so that each sees the same load. Prints JSON.

    python bench/rank_start.py [--repeats N] [--out FILE]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from output import emit  # noqa: E402
from zygote import busy_seconds, free_port  # noqa: E402  (bench/zygote.py)

TOY = ["--task", "toy", "--user-dir", os.path.join(ROOT, "tests", "tasks"), "--cpu",
       "--no-progress-bar", "--max-update", "4", "--max-sentences", "8", "--no-save",
       "--disable-validation", "--distributed-world-size", "2", "--distributed-rank", "0",
       "--distributed-gpus", "2"]
# train.py, as it is ("fork"), forked without freezing first, or as if the
# command had a second thread (a fork server), with the server's preload
# list as it is or without quick_exit.
TRAIN = ("import sys\n"
         "import contextlib\n"
         "from hetseq.distributed import spawn\n"
         "if sys.argv[1] == 'fork, unfrozen':\n"
         "    spawn._frozen_for = lambda method: contextlib.nullcontext()\n"
         "elif sys.argv[1] != 'fork':\n"
         "    spawn.threads_here = lambda: 2\n"
         "if sys.argv[1] == 'fork server, teardown':\n"
         "    spawn.PRELOAD = tuple(m for m in spawn.PRELOAD if not m.endswith('quick_exit'))\n"
         "from hetseq.app.main import main\n"
         "main(sys.argv[2:])\n")
WAYS = ("fork", "fork, unfrozen", "fork server, quick exit", "fork server, teardown")


def timed(way, folder):
    """Seconds from the job's last output line to its command's exit and to
    the end of its output; the machine's CPU seconds and the wall seconds
    of the whole command."""
    argv = [sys.executable, "-c", TRAIN, way, *TOY, "--distributed-init-method",
            f"tcp://127.0.0.1:{free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before, started = busy_seconds(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    exited = []
    waiter = threading.Thread(target=lambda: exited.append((proc.wait(), time.monotonic())))
    waiter.start()
    last, lines = None, []
    for line in proc.stdout:          # to the end: every writer closed it
        last = time.monotonic()
        lines.append(line)
    ended = time.monotonic()
    waiter.join()
    code, exit_at = exited[0]
    if code != 0:
        raise SystemExit(f"{way} failed ({code}):\n{b''.join(lines)[-2000:].decode()}")
    return exit_at - last, ended - last, busy_seconds() - before, ended - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for way in runs:              # alternately: the same load for both
                runs[way].append(timed(way, folder))
    results = {}
    for way, got in runs.items():
        mean = [sum(r[i] for r in got) / len(got) for i in range(4)]
        results[way] = {"exit_after_last_line_s": round(mean[0], 2),
                        "output_closed_after_last_line_s": round(mean[1], 2),
                        "output_closed_max_s": round(max(r[1] for r in got), 2),
                        "machine_cpu_s": round(mean[2], 2),
                        "command_wall_s": round(mean[3], 2)}
    fork, server = results["fork"], results["fork server, quick exit"]
    emit({"benchmark": "python train.py, one node of 2 CPU ranks: ranks forked from the "
                       "command, or from a fork server that exits at once or tears down",
          "fork_cpu_over_fork_server": round(fork["machine_cpu_s"] / server["machine_cpu_s"], 2),
          "fork_wall_over_fork_server": round(fork["command_wall_s"] / server["command_wall_s"],
                                              2),
          "frozen_cpu_over_unfrozen": round(fork["machine_cpu_s"]
                                            / results["fork, unfrozen"]["machine_cpu_s"], 2),
          "machine": f"{os.cpu_count()} cores", "repeats": args.repeats, "results": results},
         args.out)


if __name__ == "__main__":
    main()
