#!/usr/bin/env python
"""bf16 vs fp32 on this CPU: step time and the loss curve of the default BERT.

The default BERT of ``--task bert`` (hidden 256, 4 layers, sequences of 128)
on the built-in demo corpus (real text: Python's documentation), one process,
the task's own recipe (AdamW 1e-4, batch 32, clip 1, 1% warm-up):
  - speed: fp32 and bf16 Controllers take turns step by step (the order
    flipping every pair) on the same batches, so the drift of a shared
    machine hits both alike; the ratio is fp32 seconds over bf16 seconds;
  - loss curve: two runs of ``--updates`` updates from the same weights on the
    same batches, fp32 and bf16 (fp32 master weights), and their difference.
Prints JSON; ``--plot`` also writes a PNG of the two curves.

    python bench/precision.py [--updates 100] [--speed-steps 20] [--out FILE] [--plot FILE]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.app import cli  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.tasks import TASKS, import_builtin_tasks  # noqa: E402
from output import emit  # noqa: E402  (bench/output.py)

CTX = DistContext(0, 1, 0, torch.device("cpu"), None)


def controller(flags, inputs, updates):
    import_builtin_tasks()
    args, job, _ = cli.parse(["--task", "bert", "--max-update", str(updates), *flags])
    task = TASKS.get("bert")(args, inputs)
    torch.manual_seed(1)
    ctrl = Controller(job, task, task.build_model(), CTX)
    ctrl.set_horizon(updates)
    return ctrl, task


def batches(task, count, size=32):
    """``count`` training batches as the iterator gives them: keyed, so
    dropout draws per sample (hetseq/keyed/randomness.py), as in a run."""
    from hetseq.keyed.randomness import KeyedBatch, sample_keys
    data = task.load_dataset("train")
    collate = task.collater(data)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data), generator=g).tolist()
    parts = [order[k * size:(k + 1) * size] for k in range(count)]
    return [KeyedBatch(collate([data[i] for i in part]), sample_keys(1, 1, part))
            for part in parts]


def loss_curve(flags, inputs, steps):
    ctrl, task = controller(flags, inputs, len(steps))
    return [task.reduce_metrics(ctrl.train_step([batch], batch).totals)["loss"]
            for batch in steps]


def speed(inputs, steps):
    fp32, _ = controller([], inputs, 10 ** 6)
    bf16, _ = controller(["--bf16"], inputs, 10 ** 6)
    spent = {"fp32": 0.0, "bf16": 0.0}
    for i, batch in enumerate(steps):
        order = (("fp32", fp32), ("bf16", bf16)) if i % 2 == 0 else (("bf16", bf16), ("fp32", fp32))
        for name, ctrl in order:
            start = time.perf_counter()
            ctrl.train_step([batch], batch)
            if i >= 2:   # the first two pairs warm up
                spent[name] += time.perf_counter() - start
    timed = (len(steps) - 2) * len(steps[0].keys)
    return {"fp32_samples_per_s": round(timed / spent["fp32"], 2),
            "bf16_samples_per_s": round(timed / spent["bf16"], 2),
            "bf16_speedup": round(spent["fp32"] / spent["bf16"], 3)}


def plot(path, fp32, bf16):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(fp32) + 1), fp32, label="fp32")
    ax.plot(range(1, len(bf16) + 1), bf16, label="bf16 autocast", alpha=0.8)
    ax.set_xlabel("update")
    ax.set_ylabel("training loss (MLM + NSP)")
    ax.set_title("default BERT on the demo corpus, one CPU process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--speed-steps", type=int, default=20)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="write the two loss curves as a PNG here")
    opts = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    import_builtin_tasks()
    inputs = TASKS.get("bert").resolve_inputs(cli.parse_args(["--task", "bert"]))
    _, task = controller([], inputs, 1)
    steps = batches(task, max(opts.updates, opts.speed_steps))
    result = {"model": "default BERT (hidden 256, 4 layers, seq 128)", "batch": 32,
              "threads": torch.get_num_threads(),
              **speed(inputs, steps[:opts.speed_steps])}
    fp32 = loss_curve([], inputs, steps[:opts.updates])
    bf16 = loss_curve(["--bf16"], inputs, steps[:opts.updates])
    diffs = [abs(a - b) for a, b in zip(fp32, bf16)]
    tail = max(1, opts.updates // 10)
    result.update({
        "updates": opts.updates,
        "fp32_loss_first_last": [round(fp32[0], 4), round(fp32[-1], 4)],
        "bf16_loss_first_last": [round(bf16[0], 4), round(bf16[-1], 4)],
        "mean_abs_loss_difference": round(sum(diffs) / len(diffs), 4),
        "max_abs_loss_difference": round(max(diffs), 4),
        f"mean_loss_last_{tail}_fp32": round(sum(fp32[-tail:]) / tail, 4),
        f"mean_loss_last_{tail}_bf16": round(sum(bf16[-tail:]) / tail, 4),
        "fp32_losses": [round(x, 4) for x in fp32],
        "bf16_losses": [round(x, 4) for x in bf16],
    })
    if opts.plot:
        plot(opts.plot, fp32, bf16)
    emit(result, opts.out)


if __name__ == "__main__":
    main()
