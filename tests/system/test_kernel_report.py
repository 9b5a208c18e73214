"""bench/kernel_report.py: the keyed kernels, compiled on this CPU for an
sm_80 and an sm_90 card exactly as a BERT-base call specializes them (and
every other tile the runtime may pick), meet issue 57's goals read from
their SASS; and the reader finds what it claims to.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/keyed/test_kernel_report.py."""

import json
import os
import subprocess
import sys

from machinery.settings import ROOT, child_env, require_module


sys.path.insert(0, str(ROOT / "bench"))


sys.path[:] = [p for p in sys.path if os.path.abspath(p) != str(ROOT / "bench")]


def test_the_kernels_compiled_for_sm80_and_sm90_meet_their_goals(tmp_path):
    """The goals: forward's loop with dropout at most 1.45x without, each
    backward's 1.3x, the draw 7 instructions an element, at most 1.15 exp
    or reciprocal operations a score element, no spills. Triton's
    interpreter is off there: a GPU's compiler, with the ptxas Triton ships."""
    require_module("triton")
    env = child_env({"TRITON_DEFAULT_FP_FUSION": "1"})
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"),
                             "--arch", "80", "--arch", "90", "--out", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=280)
    assert (tmp_path / "report.json").exists(), result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for arch in ("sm80", "sm90"):
        unmet = {name: check for name, check in report[arch]["goals"].items()
                 if not check["met"]}
        assert not unmet, (arch, unmet)
        kernels = report[arch]["kernels"]
        for kind in ("forward", "backward_dq", "backward_kv", "dropout_draw", "dropout_"):
            assert any(kind in name for name in kernels), (arch, kind, sorted(kernels))
        for name, entry in kernels.items():
            for variant in ("keyed", "plain"):
                if variant in entry:
                    assert (tmp_path / f"{name}-{variant}-{arch}.cubin").exists()
                    assert entry[variant]["stack_bytes"] == 0, (arch, name, variant)
        forward = kernels["attention_forward_128x64x8"]
        assert forward["keyed"]["loop"] and forward["keyed"]["lengths"][:2] == [128, 512]
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_gpu_checklist_fits_one_call_and_keeps_what_it_measured():
    """Its steps' limits add up to at most 480 s of a 10-minute call (a GPU
    is lent for 15 minutes, start-up included, so a second run fits), every
    step is limited and ends with SIGABRT (stacks printed), and the tables
    run each in a process of their own with their files written as they go."""
    import re
    text = (ROOT / "bench" / "gpu_checklist.sh").read_text()
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
    limits = [int(n) for n in re.findall(r"timeout -s ABRT (\d+)", text)]
    commands = [line for line in text.splitlines()
                if re.search(r"\$PY (bench/|train\.py|-m pytest)", line)]
    assert len(limits) >= len(commands) >= 6
    # 4b's two nodes run side by side under one limit each
    assert sum(limits) - 45 <= 480, limits
    assert all(line.lstrip().startswith("timeout -s ABRT") for line in commands), commands
    assert text.index("--seq 128 --batch 256") < text.index("--seq 512 --batch 64") < \
        text.index("attention_kernels.py") < text.index("pytest")
    assert re.search(r"--out \"\$OUT/table_128.json\"", text) and "autotune" not in text
