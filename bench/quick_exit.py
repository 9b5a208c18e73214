#!/usr/bin/env python
"""How long a user's ``python train.py`` (one node, 2 CPU ranks) keeps them
waiting at its end, with the ranks' fork server ending at once
(hetseq/distributed/quick_exit.py) and with the interpreter's teardown instead.

The command's own process ends with os._exit either way (main.py); its fork
server holds the same standard output and ends after it, so a terminal's
prompt comes back at the first end, and anything reading the output
(``| tee log``, a CI log, ``subprocess.run``) at the second. Measured from
the last line the job printed, alternately each way. Prints JSON. It is why
quick_exit.py stays: without it, what reads the output waits for the teardown.

    python bench/quick_exit.py [--repeats N] [--out FILE]
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
# train.py, with the fork server's preload list as it is or without quick_exit.
TRAIN = ("import sys\n"
         "from hetseq.distributed import launch\n"
         "if sys.argv[1] == 'teardown':\n"
         "    launch.PRELOAD = tuple(m for m in launch.PRELOAD if not m.endswith('quick_exit'))\n"
         "from hetseq.main import main\n"
         "main(sys.argv[2:])\n")


def timed(way, folder):
    """Seconds from the job's last output line to its command's exit and to
    the end of its output; the machine's CPU seconds for the whole command."""
    argv = [sys.executable, "-c", TRAIN, way, *TOY, "--distributed-init-method",
            f"tcp://127.0.0.1:{free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = busy_seconds()
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
    return exit_at - last, ended - last, busy_seconds() - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = {"quick_exit": [], "teardown": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for way in runs:              # alternately: the same load for both
                runs[way].append(timed(way, folder))
    results = {}
    for way, got in runs.items():
        mean = [sum(r[i] for r in got) / len(got) for i in range(3)]
        results[way] = {"exit_after_last_line_s": round(mean[0], 2),
                        "output_closed_after_last_line_s": round(mean[1], 2),
                        "output_closed_max_s": round(max(r[1] for r in got), 2),
                        "machine_cpu_s": round(mean[2], 2)}
    emit({"benchmark": "the end of python train.py, one node of 2 CPU ranks: the fork "
                       "server's quick exit against the interpreter's teardown",
          "machine": f"{os.cpu_count()} cores", "repeats": args.repeats, "results": results},
         args.out)


if __name__ == "__main__":
    main()
