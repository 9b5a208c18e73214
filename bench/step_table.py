#!/usr/bin/env python
"""HetSeq's training step against what a user would run instead, side by
side in one process: the table of issue 46 (docs/gpu.md).

BERT-base (768 x 12, vocab 30522) on random token batches, bf16 autocast,
AdamW (lr 1e-4), clip 1, dropout 0.1. Every variant is built once, stays
alive, and is timed in alternating rounds (the order rotating each round),
so a GPU's clocks and a shared machine's drift hit all alike:

    hetseq            Controller.train_step on a KeyedBatch: the training
                      default, dropout drawn per sample (hetseq/keyed/kernels/)
    hetseq_compile    the same with --compile
    hetseq_unkeyed    the Controller on the bare batch: torch's dropout and
                      fused attention (the Controller's own cost)
    bare              HetSeq's model in a plain loop: torch's dropout, fused
                      AdamW, clip_grad_norm_, mean loss
    bare_compile      the plain loop with the forward compiled
    transformers      transformers' BertForPreTraining (sdpa) in the plain
                      loop (its MLM head scores every position)

Per variant: samples/s, MFU (FLOPs of one step counted by
torch.utils.flop_counter on the eager twin, over --peak-tflops), peak
memory of a step above what was allocated before it (activations,
gradients, temporaries; GiB), and the first step's seconds (compile).
Ratios: the issue's goals. With --out the file holds the table as it stands
after the first steps, the memory and every round (each run in a GPU
checklist step of its own, bench/gpu_checklist.sh, keeps what it measured).

    python bench/step_table.py [--seq 128 --batch 256] [--out FILE]
    python bench/step_table.py --device cpu --model tiny --seq 32 --batch 8 \\
        --rounds 1 --compile-backend aot_eager      # a smoke test of the code
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import Bert, BertBase, register  # noqa: E402  (bench/models.py)
from output import emit  # noqa: E402

from hetseq.app import cli  # noqa: E402
from hetseq.distributed.spawn import DistContext  # noqa: E402
from hetseq.keyed.randomness import KeyedBatch, sample_keys  # noqa: E402
from hetseq.tasks import TASKS  # noqa: E402
from hetseq.data.iterators import move_to  # noqa: E402
from hetseq.update.controller import Controller  # noqa: E402

MODELS = {"bert-base": BertBase, "bert": Bert}


class Tiny(Bert):
    """A smoke-test size."""
    name = "bench_bert_tiny"
    VOCAB = 128
    CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64)


MODELS["tiny"] = Tiny


def batch(kind, size, seq, device, seed=0):
    """Random token ids at length ``seq``, masked positions 15% of it."""
    g = torch.Generator().manual_seed(seed)
    pred = max(1, int(0.15 * seq + 0.5))
    positions = torch.sort(torch.randint(1, seq, (size, pred), generator=g), 1).values
    sample = {"input_ids": torch.randint(5, kind.VOCAB, (size, seq), generator=g),
              "segment_ids": (torch.arange(seq) >= seq // 2).long().expand(size, -1).clone(),
              "input_mask": torch.ones(size, seq, dtype=torch.long),
              "masked_lm_positions": positions,
              "masked_lm_ids": torch.randint(5, kind.VOCAB, (size, pred), generator=g),
              "next_sentence_labels": torch.randint(0, 2, (size,), generator=g)}
    return move_to(sample, device)


class Variant:
    def __init__(self, name, step, flops_step=None, release=None):
        self.name, self.step = name, step
        self.flops_step = flops_step or step    # an eager twin the flop counter can see
        self.release = release or (lambda: None)   # frees the last step's gradients
        self.seconds, self.steps, self.first_s, self.peak = 0.0, 0, None, None


def hetseq(kind, sample, device, keyed=True, compile=False):
    register(kind)
    flags = ["--task", kind.name, "--optimizer", "adamw", "--lr", "1e-4", "--lr-scheduler",
             "fixed", "--clip-norm", "1", "--bf16", *(["--compile"] if compile else [])]
    args, job, _ = cli.parse(flags)
    ctx = DistContext(0, 1, device.index or 0, device)
    ctrl = Controller(job, TASKS.get(kind.name)(args), kind.build(), ctx)
    size = len(sample["input_ids"])
    given = KeyedBatch(sample, sample_keys(1, 1, range(size))) if keyed else sample
    return (lambda: ctrl.train_step([given], given),
            lambda: ctrl.optimizer.zero_grad(set_to_none=True))


def bare(kind, sample, device, compile=False, backend="inductor"):
    model = kind.build().to(device).train()
    fused = True if device.type == "cuda" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    forward = torch.compile(model.forward, backend=backend) if compile else model.forward
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(forward=forward):
        with autocast:
            mlm, nsp = forward(sample["input_ids"], sample["segment_ids"],
                               sample["input_mask"], sample["masked_lm_positions"])
            loss = (F.cross_entropy(mlm.flatten(0, 1).float(), sample["masked_lm_ids"].flatten())
                    + F.cross_entropy(nsp.float(), sample["next_sentence_labels"]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, lambda: step(model.forward)


def transformers_bert(kind, sample, device):
    import transformers
    config = transformers.BertConfig(vocab_size=kind.VOCAB, **kind.CONFIG,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).to(device).train()
    fused = True if device.type == "cuda" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    labels = torch.full_like(sample["input_ids"], -100)
    labels.scatter_(1, sample["masked_lm_positions"], sample["masked_lm_ids"])
    inputs = dict(input_ids=sample["input_ids"], token_type_ids=sample["segment_ids"],
                  attention_mask=sample["input_mask"], labels=labels,
                  next_sentence_label=sample["next_sentence_labels"])

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def variants(kind, sample, device, backend, only):
    made = []

    def add(name, build):
        if only and name not in only:
            return
        made.append(Variant(name, *build()))
    def controller(**how):
        step, release = hetseq(kind, sample, device, **how)
        return step, None, release
    add("hetseq", lambda: controller())
    add("hetseq_compile", lambda: controller(compile=True))
    add("hetseq_unkeyed", lambda: controller(keyed=False))
    add("bare", lambda: bare(kind, sample, device)[:1] + (None,))
    add("bare_compile", lambda: bare(kind, sample, device, compile=True, backend=backend))
    add("transformers", lambda: (transformers_bert(kind, sample, device), None))
    return made


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_steps(made, device, warmup):
    """The first step of each (its compile, if any), then warm-up steps."""
    for variant in made:
        sync(device)
        start = time.perf_counter()
        variant.step()
        sync(device)
        variant.first_s = round(time.perf_counter() - start, 2)
        for _ in range(warmup):
            variant.step()


def peak_memory(made, device):
    if device.type != "cuda":
        return
    for variant in made:
        variant.release()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        variant.step()
        sync(device)
        variant.peak = round((torch.cuda.max_memory_allocated(device) - before) / 2**30, 2)


def alternate(made, device, rounds, steps, record):
    for r in range(rounds):
        for variant in made[r % len(made):] + made[:r % len(made)]:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                variant.step()
            sync(device)
            variant.seconds += time.perf_counter() - start
            variant.steps += steps
        record()


def flops_of(step):
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def table(kind, seq, size, device, rounds=5, steps=4, warmup=2, peak=989.0,
          backend="inductor", only=(), record=lambda table: None):
    """The table; ``record`` gets it as it stands after the first steps, the
    memory and every round (a run stopped at its limit keeps those)."""
    sample = batch(kind, size, seq, device)
    made = variants(kind, sample, device, backend, only)
    counted = {}

    def current(done=False):
        rows = {}
        for variant in made:
            per_s = size * variant.steps / variant.seconds if variant.steps else None
            key = "transformers" if variant.name == "transformers" else "hetseq"
            mfu = counted[key] * per_s / size / (peak * 1e12) \
                if per_s and key in counted else None
            rows[variant.name] = {"samples_per_s": per_s and round(per_s, 1),
                                  "mfu": mfu and round(mfu, 4),
                                  "activation_gib": variant.peak, "first_step_s": variant.first_s}
        return {"seq": seq, "batch": size, "model": kind.__name__, "rows": rows,
                "ratios": ratios(rows), "complete": done}
    first_steps(made, device, warmup)
    record(current())
    peak_memory(made, device)
    record(current())
    # The model's FLOPs per step: the unkeyed Controller's forward and backward
    # are the plain model's (the keyed kernels are operators the counter
    # cannot see into; the same arithmetic runs inside).
    for variant in made:
        key = "transformers" if variant.name == "transformers" else "hetseq"
        if key not in counted:
            twin = variant.flops_step if key == "transformers" else next(
                (v.flops_step for v in made if v.name in ("hetseq_unkeyed", "bare")),
                bare(kind, sample, device)[1])
            counted[key] = flops_of(twin)
    alternate(made, device, rounds, steps, lambda: record(current()))
    return current(done=True)


def ratios(rows):
    """The issue's goals, where both sides were measured."""
    def ratio(a, b, what="samples_per_s"):
        if a in rows and b in rows and rows[a][what] and rows[b][what]:
            return round(rows[a][what] / rows[b][what], 3)
        return None
    return {"default_over_bare (goal >= 0.95)": ratio("hetseq", "bare"),
            "compile_over_bare_compile (goal >= 1.0)": ratio("hetseq_compile", "bare_compile"),
            "compile_over_transformers (goal >= 1.7)": ratio("hetseq_compile", "transformers"),
            "unkeyed_over_bare (goal >= 0.97)": ratio("hetseq_unkeyed", "bare"),
            "activation_memory_keyed_over_bare (goal <= 1.1 at 512)":
                ratio("hetseq", "bare", "activation_gib")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-base")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--only", nargs="*", default=(), help="these variants only")
    parser.add_argument("--out")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/step_table.py: no CUDA device (--device cpu runs the smoke test)")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "peak_tflops": opts.peak_tflops, "tables": []}
    def record(partial):
        # Written as it stands, so a step killed at its limit keeps what it measured.
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump(dict(result, tables=result["tables"] + [partial]), f, indent=2)
    for seq, size in zip(opts.seq, opts.batch):
        result["tables"].append(table(MODELS[opts.model], seq, size, device, opts.rounds,
                                      opts.steps, peak=opts.peak_tflops,
                                      backend=opts.compile_backend, only=opts.only,
                                      record=record))
    emit(result, opts.out)
    return result


if __name__ == "__main__":
    main()
