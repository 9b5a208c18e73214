#!/usr/bin/env python
"""--compile on this CPU: start-up cost and step time of the default BERT.

The default BERT of ``--task bert`` (hidden 256, 4 layers, sequences of 128)
on the demo corpus, one process, batch 32, the task's recipe. For fp32 and
for bf16: a plain Controller and a ``--compile`` one take turns step by step
on the same batches (the order flipping every pair), so the drift of a
shared machine hits both alike. The compiled Controller's first step, where
the graphs are built, is reported as its start-up cost; the next two pairs
warm up. The ratio is plain seconds over compiled seconds.

    python bench/compile.py [--steps 20] [--out FILE]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output import emit  # noqa: E402  (bench/output.py)
from precision import batches, controller  # noqa: E402  (the same model and batches)

from hetseq.app import cli  # noqa: E402
from hetseq.tasks import TASKS, import_builtin_tasks  # noqa: E402


def compare(flags, inputs, steps):
    plain, _ = controller(flags, inputs, 10 ** 6)
    compiled, _ = controller([*flags, "--compile"], inputs, 10 ** 6)
    start = time.perf_counter()
    compiled.train_step([steps[0]], steps[0])
    first = time.perf_counter() - start
    plain.train_step([steps[0]], steps[0])
    spent = {"plain": 0.0, "compiled": 0.0}
    for i, batch in enumerate(steps[1:]):
        pair = (("plain", plain), ("compiled", compiled))
        for name, ctrl in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            ctrl.train_step([batch], batch)
            if i >= 2:
                spent[name] += time.perf_counter() - start
    timed = (len(steps) - 3) * len(steps[0].keys)
    return {"plain_samples_per_s": round(timed / spent["plain"], 2),
            "compiled_samples_per_s": round(timed / spent["compiled"], 2),
            "compile_speedup": round(spent["plain"] / spent["compiled"], 3),
            "first_compiled_step_s": round(first, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    import_builtin_tasks()
    inputs = TASKS.get("bert").resolve_inputs(cli.parse_args(["--task", "bert"]))
    _, task = controller([], inputs, 1)
    steps = batches(task, opts.steps)
    result = {"model": "default BERT (hidden 256, 4 layers, seq 128)", "batch": 32,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "fp32": compare([], inputs, steps), "bf16": compare(["--bf16"], inputs, steps)}
    emit(result, opts.out)


if __name__ == "__main__":
    main()
