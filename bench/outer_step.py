"""Which outer step keeps local steps at the job's own learning rate.

Three CPU ranks on loopback (file://), the default BERT on the demo corpus,
8 sequences per rank (global batch 24), --warmup-updates 8, 384 updates
(12 rounds of --local-steps 32), validated every 128 updates. For each
--lr: synchronous updates, and rounds of 32 under each outer step:

- diloco:  --outer-lr 0.7 --outer-momentum 0.9 (DiLoCo's; HetSeq's default before)
- average: --outer-lr 1 --outer-momentum 0 (the samples-weighted average; the default)
- outer1.5: --outer-lr 1.5 --outer-momentum 0 (extrapolating the average)
- nesterov0.5: --outer-lr 0.5 --outer-momentum 0.5 (momentum whose long-run
  multiplier eta / (1 - mu) is 1, like the average's)

Prints each run's validation losses and their ratio to the synchronous run's
after the same samples. Loss is independent of the link, so loopback is enough.

    python bench/outer_step.py --out bench/results/outer_step.json     # about 45 minutes
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.output import emit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALID = re.compile(r"valid on 'valid' \| epoch \d+ \| loss=([\d.]+).*\| update (\d+)")
OUTER = {
    "diloco": ["--outer-lr", 0.7, "--outer-momentum", 0.9],
    "average": ["--outer-lr", 1, "--outer-momentum", 0],
    "outer1.5": ["--outer-lr", 1.5, "--outer-momentum", 0],
    "nesterov0.5": ["--outer-lr", 0.5, "--outer-momentum", 0.5],
}


def run(args, lr, flags, batches=(8, 8, 8)):
    """{update: validation loss} of one 3-rank job on loopback."""
    folder = tempfile.mkdtemp(prefix="hetseq-outer-")
    procs = []
    for rank, batch in enumerate(batches):
        argv = [sys.executable, os.path.join(ROOT, "train.py"), "--task", "bert", "--cpu",
                "--max-sentences", batch, "--max-update", args.updates, "--lr", lr,
                "--warmup-updates", 8, "--validate-interval-updates", args.every,
                "--log-format", "simple", "--no-progress-bar", "--no-save",
                "--save-dir", f"{folder}/{rank}", "--distributed-world-size", len(batches),
                "--distributed-rank", rank, "--distributed-gpus", 1,
                "--distributed-init-method", f"file://{folder}/meet", *flags]
        procs.append(subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outputs = [proc.communicate(timeout=args.timeout)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a rank failed:\n{outputs[0][-3000:]}")
    return {int(update): float(loss) for loss, update in VALID.findall(outputs[0])}


def summarize(runs):
    """Every run's validation loss over the synchronous run's at the same LR."""
    table = {}
    for key, valid in runs.items():
        lr, mode = key.split(" ", 1)
        sync = runs.get(f"{lr} sync")
        if sync and mode != "sync":
            table[key] = {str(u): round(valid[u] / sync[u], 4) for u in valid if u in sync}
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", nargs="+", default=["5e-4", "1e-4"])
    parser.add_argument("--outer", nargs="+", default=list(OUTER), choices=list(OUTER))
    parser.add_argument("--updates", type=int, default=384)
    parser.add_argument("--every", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = {}
    for lr in args.lrs:
        runs[f"{lr} sync"] = run(args, lr, [])
        for name in args.outer:
            runs[f"{lr} {name}"] = run(args, lr, ["--local-steps", 32, *OUTER[name]])
            print(f"{lr} {name}: {runs[f'{lr} {name}']}", file=sys.stderr, flush=True)
    emit({"setup": {"ranks": 3, "batch_per_rank": 8, "updates": args.updates,
                    "local_steps": 32, "warmup_updates": 8},
          "valid": {key: {str(u): v for u, v in valid.items()} for key, valid in runs.items()},
          "valid_vs_sync": summarize(runs)}, args.out)


if __name__ == "__main__":
    main()
