#!/usr/bin/env python
"""What the keyed kernels compile to on a GPU, read on a CPU: every
attention and dropout kernel compiled for sm_80 or sm_90 exactly as a call
specializes it (Triton's own binder over the call's arguments: BERT-base's
strides and shapes, sequences 128 and 512, bf16, head dimension 64, a key
padding mask), once with dropout (keyed) and once without (plain), and read
as SASS: the hottest loop's instructions by kind, registers, stack bytes
(spills), exp and reciprocal operations per score element, and what the
dropout adds per element. Goals (issue 57) are checked in the JSON.

    python bench/kernel_report.py --arch 90 --out DIR [--arch 80]
    PYTHONPATH=/path/to/triton-3.6 python bench/kernel_report.py ...  # the GPU's Triton

Writes DIR/<kernel>-keyed-sm<arch>.cubin and -plain- (the draw kernel has
no plain twin, delta no keyed one) and DIR/report.json; prints the JSON.
Then every other tile the runtime may pick on that card (head dimension
128; queries and keys within 64), and with --float32 the float32 tiles that
only HETSEQ_KERNELS=triton takes, for spills.
"""

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys

if __name__ == "__main__":      # a GPU's compiler, not the interpreter (read at @triton.jit)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from output import emit  # noqa: E402

from hetseq.keyed.kernels import flash, philox, triton_dropout  # noqa: E402
from hetseq.keyed.randomness import sample_keys  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
GOALS = {   # issue 57
    "forward keyed / plain loop": 1.45,
    "backward keyed / plain loop": 1.3,
    "draw instructions per element": 7.0,
    "exp and reciprocal per score element": 1.15,
}


# ---- compiling as a launch would ----

def compile_as_launched(launch, arch):
    """The binary ``launch`` would run on an sm_<arch> card: the signature,
    constants and divisibility that Triton's binder derives from its
    arguments (a pointer or integer divisible by 16, an integer 1)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.constants)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.constants, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


# ---- reading SASS ----

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass(cubin):
    """[(address, opcode, operands)] of a cubin's one kernel."""
    text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INSTRUCTION.finditer(text)]


def resources(cubin):
    """(registers, stack bytes) from cuobjdump -res-usage."""
    text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin],
                          capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return int(found.group(1)), int(found.group(2))


def hottest_loop(instructions):
    """The instructions of the largest innermost loop (a backward branch's
    span), or all of them for a kernel without a loop."""
    loops = []
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:    # not the trailing BRA to itself
            loops.append((int(target.group(1), 16), address))
    inner = [(a, b) for a, b in loops
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    if not inner:
        return instructions, False
    def body(span):
        return [i for i in instructions if span[0] <= i[0] <= span[1]]
    return max((body(span) for span in inner), key=len), True


def read(binary, path, elements):
    """What a compiled kernel is: ``elements`` is what one thread computes
    in one pass of its loop (or in all, without a loop)."""
    with open(path, "wb") as f:
        f.write(binary.asm["cubin"])
    body, looped = hottest_loop(sass(path))
    kinds = collections.Counter(opcode.split(".")[0] for _, opcode, _ in body)
    transcendental = sum(1 for _, opcode, _ in body
                         if opcode.startswith(("MUFU.EX2", "MUFU.RCP")))
    registers, stack = resources(path)
    return dict(cubin=os.path.basename(path), loop=looped, instructions=len(body),
                per_element=round(len(body) / elements, 2), elements_per_thread=elements,
                registers=registers, stack_bytes=stack,
                exp_rcp_per_element=round(transcendental / elements, 3),
                kinds=dict(kinds.most_common()))


# ---- the launches of BERT-base ----

def bert_base(length, dtype=torch.bfloat16, batch=2, heads=12, d=64, masked=True):
    """q, k, v as BERT's attention makes them (views of one qkv projection),
    the key mask, the keys, and everything a call allocates."""
    qkv = torch.empty(batch, length, 3, heads, d, dtype=dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv
    key_mask = torch.ones(batch, length, dtype=torch.bool) if masked else None
    keys = sample_keys(0, 0, range(batch))
    return q, k, v, key_mask, keys


def attention_launches(length, dropout, dtype=torch.bfloat16, d=64, arch=90):
    """Every launch of one keyed (or plain) attention forward and backward,
    with the tiles of an sm_<arch> card."""
    capability = divmod(arch, 10)
    q, k, v, key_mask, keys = bert_base(length, dtype, d=d)
    B, H, L, _ = q.shape
    out, grad = flash._like_heads(q), flash._like_heads(q)
    lse = torch.empty(B * H, L)
    words_f, words_t = flash.keep_words(q, k, capability)
    attend, scales = flash.masks(key_mask, 0.125 * flash.LOG2E, q.device)
    cut = philox.cut(0.1)
    keep_scale = philox.keep_scale(cut)
    launches = [flash.draw_launch(keys, philox.site_word(1, 0), cut, H, words_f, words_t,
                                  capability)] if dropout else []
    launches.append(flash.forward_launch(q, k, v, out, lse, attend, scales, words_f, keep_scale,
                                         0.125, dropout, capability))
    if dropout:
        launches.append(flash.delta_launch(out, grad, torch.empty_like(lse), keep_scale))
    dq, dk, dv = flash._like_heads(q), flash._like_heads(k), flash._like_heads(v)
    launches += flash.backward_launches(grad, q, k, v, lse, torch.empty_like(lse), attend,
                                        scales, words_f, words_t, keep_scale, 0.125, dq, dk, dv,
                                        dropout, capability)
    return launches


def dropout_launch(length, dropout, hidden=768):
    x = torch.empty(2, length, hidden, dtype=torch.bfloat16)
    kernel, grid, args, constants = triton_dropout.launch(
        x, sample_keys(0, 0, range(2)), philox.site_word(1, 0), philox.cut(0.1), 1.1, dropout)
    name = f"dropout_{constants['BLOCK_R']}x{16 * constants['BLOCK_G']}x{constants['num_warps']}"
    return flash.Launch(name + ("-keyed" if dropout else "-plain"), kernel, grid, args, constants)


def elements(launch):
    """Elements one thread computes in a pass of the kernel's loop."""
    c = launch.constants
    threads = 32 * c["num_warps"]
    if "UNITS" in c:                                    # the draw: a unit a thread
        return c["UNITS"] * 512 / threads
    if "BLOCK_R" in c:                                  # dropout: its tile at once
        return c["BLOCK_R"] * 16 * c["BLOCK_G"] / threads
    if "BLOCK_N" not in c:                              # delta: a row block
        return c["BLOCK_M"] * c["BLOCK_D"] / threads
    return c["BLOCK_M"] * c["BLOCK_N"] / threads


# ---- the report ----

def report(arch, out, float32=False):
    """Every kernel a BERT-base call launches (sequences 128 and 512, bf16,
    d 64, keyed and plain), then every other tile the runtime may pick on
    this card (d 128; queries and keys within 64); with ``float32`` also
    the float32 tiles only HETSEQ_KERNELS=triton takes (not in the goals:
    they spill, docs/gpu.md)."""
    kernels = {}
    for length in (128, 512):
        for dropout in (True, False):
            for launch in attention_launches(length, dropout, arch=arch) + \
                    [dropout_launch(length, dropout)]:
                _add(kernels, launch, arch, out, length)
    others = [(64, 64, torch.bfloat16, ""), (128, 512, torch.bfloat16, "-d128")]
    if float32:
        others += [(64, 512, torch.float32, "-float32")]
    for d, length, dtype, suffix in others:
        for dropout in (True, False):
            for launch in attention_launches(length, dropout, dtype, d, arch):
                if "draw" not in launch.name:
                    _add(kernels, launch, arch, out, length, suffix)
    return dict(arch=arch, triton=triton.__version__, kernels=kernels,
                goals=goals({name: entry for name, entry in kernels.items()
                             if "float32" not in name}))


def _add(kernels, launch, arch, out, length, suffix=""):
    name, _, variant = launch.name.rpartition("-")
    if variant not in ("keyed", "plain"):
        name, variant = launch.name, "keyed" if "draw" in launch.name else "plain"
    name += suffix
    entry = kernels.setdefault(name, {})
    if variant in entry:                # the same binary for another length
        entry[variant]["lengths"].append(length)
        return
    # Built on CPU tensors, a launch widens bfloat16 products for the
    # interpreter (triton_attention._dot); a GPU multiplies them natively.
    launch = dataclasses.replace(launch, constants={
        **launch.constants, **({"WIDEN": False} if "WIDEN" in launch.constants else {})})
    binary = compile_as_launched(launch, arch)
    entry[variant] = read(binary, os.path.join(out, f"{name}-{variant}-sm{arch}.cubin"),
                          elements(launch))
    entry[variant]["lengths"] = [length]
    if "keyed" in entry and "plain" in entry:
        keyed, plain = entry["keyed"], entry["plain"]
        entry["keyed_over_plain"] = round(keyed["instructions"] / plain["instructions"], 3)
        entry["dropout_per_element"] = round(
            (keyed["instructions"] - plain["instructions"]) / keyed["elements_per_thread"], 2)


def _scores(name):
    """Whether a kernel computes attention scores (its elements are scores)."""
    return any(part in name for part in ("forward", "backward_dq", "backward_kv"))


def goals(kernels):
    """Each goal's worst kernel and whether it holds."""
    def worst(values):
        name, value = max(values, key=lambda item: item[1])
        return dict(kernel=name, value=value)
    checks = {
        "forward keyed / plain loop": worst(
            (n, e["keyed_over_plain"]) for n, e in kernels.items()
            if "forward" in n and "keyed_over_plain" in e),
        "backward keyed / plain loop": worst(
            (n, e["keyed_over_plain"]) for n, e in kernels.items()
            if "backward" in n and "keyed_over_plain" in e),
        "draw instructions per element": worst(
            [(n, e["keyed"]["per_element"]) for n, e in kernels.items() if "draw" in n] +
            [(n, e["dropout_per_element"]) for n, e in kernels.items()
             if n.startswith("dropout") and "dropout_per_element" in e]),
        "exp and reciprocal per score element": worst(
            (n, e[v]["exp_rcp_per_element"]) for n, e in kernels.items()
            for v in ("keyed", "plain") if v in e and _scores(n)),
    }
    for name, check in checks.items():
        check.update(goal=GOALS[name], met=check["value"] <= GOALS[name])
    stack = [(f"{n}-{v}", e[v]["stack_bytes"]) for n, e in kernels.items()
             for v in ("keyed", "plain") if v in e]
    checks["stack bytes (spills)"] = dict(worst(stack), goal=0,
                                          met=all(value == 0 for _, value in stack))
    return checks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=(80, 90),
                        help="compute capability to compile for (repeat for both; default 90)")
    parser.add_argument("--out", required=True, help="folder for the cubins and report.json")
    parser.add_argument("--float32", action="store_true",
                        help="also the float32 tiles (HETSEQ_KERNELS=triton only; "
                             "not in the goals)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = {f"sm{arch}": report(arch, args.out, args.float32)
              for arch in args.arch or [90]}
    emit(result, os.path.join(args.out, "report.json"))
    return 0 if all(check["met"] for r in result.values() for check in r["goals"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
