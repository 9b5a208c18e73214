#!/usr/bin/env python
"""The keyed kernels alone against what torch runs instead, side by side in
one process (docs/gpu.md): attention forward + backward at BERT-base's
shapes (12 heads of 64, bf16), HetSeq's keyed kernels (the draw of the keep
bits included) with dropout 0.1, against torch's flash SDPA without dropout
and without a mask (the backend named with sdpa_kernel); the same with a
key padding mask (BERT's case); and elementwise keyed dropout against
torch's. Goals (issue 57): keyed / flash within 1.3x at
sequence 512 and 1.5x at 128.

Variants alternate (the order rotating each round) and each figure is
written to --out the moment it is measured, so a run stopped at its time
limit keeps what it measured.

    python bench/attention_kernels.py [--seq 128 512] [--tokens 32768] --out FILE
    python bench/attention_kernels.py --device cpu --seq 64 --tokens 128 --heads 2 \\
        --head-dim 16 --rounds 1 --steps 1 --out FILE   # a smoke test (Triton's interpreter)
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.keyed.kernels import ops, philox  # noqa: E402
from hetseq.keyed.randomness import sample_keys  # noqa: E402

GOALS = {128: 1.5, 512: 1.3}    # keyed / flash, forward + backward


def attention_variants(seq, batch, device, heads=12, d=64):
    """name -> a function that runs one forward and backward."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=g).to(device, dtype).requires_grad_()
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, d, generator=g).to(device, dtype)
    keys = sample_keys(0, 0, range(batch)).to(device)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    mask[:, seq - seq // 8:] = False                   # an eighth padding
    cut = philox.cut(0.1)
    site = philox.site_word(1, 0)

    def keyed(key_mask):
        def run():
            out = ops.keyed_attention(q, k, v, key_mask, keys, site, cut, philox.keep_scale(cut),
                                      d ** -0.5)[0]
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    def sdpa():
        backend = "FLASH_ATTENTION" if device.type == "cuda" else "MATH"
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad)
        return run
    return {"keyed": keyed(None), "keyed_masked": keyed(mask), "sdpa_flash": sdpa()}


def dropout_variants(seq, batch, device, hidden=768):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    keys = sample_keys(0, 0, range(batch)).to(device)
    cut = philox.cut(0.1)
    return {"keyed_dropout": lambda: ops.keyed_dropout(x, keys, 1, cut, philox.keep_scale(cut)),
            "torch_dropout": lambda: F.dropout(x, 0.1, training=True)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variants, device, rounds, steps, warmup, record):
    """Seconds a call of each variant, alternating; ``record`` after each round."""
    for run in variants.values():
        for _ in range(warmup):
            run()
    seconds = dict.fromkeys(variants, 0.0)
    calls = dict.fromkeys(variants, 0)
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                variants[name]()
            sync(device)
            seconds[name] += time.perf_counter() - start
            calls[name] += steps
        record({name: round(seconds[name] / calls[name] * 1e3, 4) for name in names})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--tokens", type=int, default=32768, help="batch x sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="calls per variant per round")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/attention_kernels.py: no CUDA device (--device cpu runs the smoke test)")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "tables": {}}

    def write():
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)

    for seq in opts.seq:
        batch = max(1, opts.tokens // seq)
        table = result["tables"][str(seq)] = {"batch": batch, "ms": {}, "ratios": {}}

        def record(ms, table=table, seq=seq):
            table["ms"].update(ms)
            t = table["ms"]
            if "keyed" in t and "sdpa_flash" in t:
                table["ratios"] = {
                    f"keyed_over_flash (goal <= {GOALS.get(seq, 1.3)})":
                        round(t["keyed"] / t["sdpa_flash"], 3),
                    "keyed_masked_over_flash": round(t["keyed_masked"] / t["sdpa_flash"], 3)}
            if "keyed_dropout" in t:
                table["ratios"]["keyed_dropout_over_torch"] = round(
                    t["keyed_dropout"] / t["torch_dropout"], 3)
            write()
        measure(attention_variants(seq, batch, device, opts.heads, opts.head_dim), device,
                opts.rounds, opts.steps, 2, record)
        measure(dropout_variants(seq, batch, device, opts.heads * opts.head_dim), device,
                opts.rounds, opts.steps, 2, record)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
