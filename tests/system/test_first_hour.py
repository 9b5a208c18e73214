"""What a new user sees: progress lines they can read, a line per node when it
joins, waits and ends, the LR horizon actually used, TensorBoard and a
picture of every run without asking.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/reporting/test_first_hour.py."""

import re
import subprocess
import sys

from machinery.commands import node_commands, run_nodes, run_train
from machinery.settings import ROOT, TOY, child_env


COMMON = [*TOY, "--optimizer", "sgd", "--lr", "0.1", "--max-update", 6, "--log-interval", 2,
          "--disable-validation"]


def test_two_nodes_print_progress_rates_and_their_own_lines(tmp_path):
    save = tmp_path / "run"
    (a, out_a), (b, out_b) = run_nodes(node_commands(
        [*COMMON, "--save-dir", save, "--total-num-update", 40],
        [["--max-sentences", 24], ["--max-sentences", 8]]))
    assert a == 0 and b == 0, out_a[-3000:] + out_b[-3000:]
    # Rank 0: where the run is, of how many updates, and the time left
    # (its saves included: never 0:00:00 before the end)...
    assert re.findall(r"\| epoch 001 \| update (\d+)/6 \| \d+:\d\d:\d\d left[^|]* \| loss=",
                      out_a) == ["2", "4"], out_a[-3000:]
    assert re.search(r"\| epoch 002 \| update 6/6 \| \d+:\d\d:\d\d left \| loss=", out_a)
    assert "0:00:00 left" not in out_a
    # ... each rank's rate and share every log interval ...
    ranks = re.findall(r"ranks: 0 ([\d.]+)/s 24 \(75%\) \| 1 ([\d.]+)/s 8 \(25%\)", out_a)
    assert len(ranks) == 3 and all(float(r) > 0 for pair in ranks for r in pair), out_a[-3000:]
    # ... and the horizon the schedule uses (--total-num-update, not the 6 planned).
    assert "then to 0 at update 40 (--total-num-update); the run plans 6 updates" in out_a
    # Every node, not only rank 0's, says when it joined (ranks, interface) and ended.
    for out, rank in ((out_a, 0), (out_b, 1)):
        assert re.search(rf"node \S+ joined the job at tcp://127\.0\.0\.1:\d+: ranks {rank} of 2 "
                         r"\(gloo, ranks from command line\) on lo 127\.0\.0\.1", out), out[-3000:]
        assert f"finished its part: ranks {rank}" in out
    assert "update 2/6" not in out_b          # progress is rank 0's
    # TensorBoard by default, and the two ways to look at the run.
    assert list((save / "tensorboard" / "train").glob("events.out.tfevents.*"))
    assert f"picture of this run: hetseq-plot {save} (writes {save}/run.png)" in out_a
    assert f"TensorBoard: tensorboard --logdir {save}/tensorboard" in out_a


def test_the_schedule_line_names_the_planned_run_when_it_sets_the_horizon(tmp_path):
    result = run_train(*COMMON, "--max-sentences", 8, "--total-num-update", 0, "--warmup-updates",
                       2, "--no-save")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "peak 0.1, warm-up 2 updates, then to 0 at update 7 (the planned run); the run plans " \
        "6 updates" in result.stderr
    assert "update 6/6" in result.stderr


def test_no_tensorboard_and_no_save_write_nothing(tmp_path):
    off = run_train(*COMMON, "--max-sentences", 8, "--save-dir", tmp_path / "a", "--no-tensorboard")
    assert off.returncode == 0 and not (tmp_path / "a" / "tensorboard").exists()
    assert "TensorBoard:" not in off.stderr and "hetseq-plot" in off.stderr
    nothing = run_train(*COMMON, "--max-sentences", 8, "--save-dir", tmp_path / "b", "--no-save")
    assert nothing.returncode == 0 and not (tmp_path / "b").exists()


def test_waiting_node_names_the_missing_ranks_and_the_time_left(tmp_path):
    """Rank 0 of 2 started alone: a line every 12 s, then one error at the timeout."""
    command = node_commands([*COMMON, "--max-sentences", 8, "--no-save"], [["--max-sentences", 8],
                                                                          []])[0]
    command = [*command, "--distributed-timeout", 14]      # the last one wins
    result = run_train(*command)
    assert result.returncode == 2, result.stderr[-3000:]
    waits = re.findall(r"waiting at tcp://\S+ for ranks 1 of 2: (\d+) s left before "
                       r"--distributed-timeout", result.stderr)
    assert len(waits) == 1 and 0 < int(waits[0]) <= 2, result.stderr[-3000:]
    assert "timed out waiting" in result.stderr.strip().splitlines()[-1]


def test_plot_of_a_real_run(tmp_path):
    save = tmp_path / "run"
    validating = [f for f in COMMON if f != "--disable-validation"]
    assert run_train(*validating, "--max-sentences", 8, "--save-dir", save,
                     "--validate-interval-updates", 2).returncode == 0
    plot = subprocess.run([sys.executable, "-m", "hetseq.reporting.plot", str(save)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(save / "run.png")
    assert (save / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The figures it drew from: every update's loss and lr, and the plan.
    from hetseq.reporting.plot import plan_changes, read_balance
    lines = read_balance(save)
    assert [line["update"] for line in lines] == list(range(1, 7))
    assert all(line["loss"] > 0 and 0.09 < line["lr"] <= 0.1 for line in lines)
    assert plan_changes(lines) == []
    # Every validation (valid.jsonl), drawn beside the training loss.
    from hetseq.reporting.plot import figure, read_lines
    valid = read_lines(save / "valid.jsonl")
    assert [(v["update"], v["split"]) for v in valid] == [(2, "valid"), (4, "valid"),
                                                          (6, "valid")]
    loss_axes = figure(save).axes[0]
    drawn = {line.get_label(): list(line.get_xdata()) for line in loss_axes.get_lines()}
    assert drawn["validation 'valid'"] == [2, 4, 6] and len(drawn["training"]) == 6


def test_plot_without_a_run_is_one_line(tmp_path):
    plot = subprocess.run([sys.executable, "-m", "hetseq.reporting.plot", str(tmp_path)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert plot.returncode == 2
    assert plot.stderr.strip().splitlines() == [
        f"hetseq-plot: error: {tmp_path}: no balance.jsonl; pass the --save-dir of a run that "
        "trained at least one update without --no-save"]


def test_a_node_without_a_gpu_says_it_trains_on_cpu_unless_told(tmp_path):
    """Without --cpu, a node that finds no GPU says in one WARNING line that
    it trains on CPU and how to silence it; --cpu is that silence."""
    command = [sys.executable, str(ROOT / "train.py"), "--no-progress-bar", *map(str, COMMON),
               "--max-sentences", "8", "--no-save"]
    env = child_env({"CUDA_VISIBLE_DEVICES": ""})      # no GPU, whatever this host has
    said = "no GPU found on this node: it trains on CPU (pass --cpu to say that is meant"
    for extra, lines in (([], 1), (["--cpu"], 0)):
        done = subprocess.run(command + extra, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        warned = [line for line in done.stderr.splitlines() if said in line]
        assert len(warned) == lines and all("WARNING" in line for line in warned), done.stderr
