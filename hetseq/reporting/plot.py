"""A picture of a run: ``hetseq-plot SAVE_DIR`` (or ``python -m hetseq.reporting.plot
SAVE_DIR``) writes ``SAVE_DIR/run.png`` from ``SAVE_DIR/balance.jsonl``
(logging/balance.py, one line per update, written by rank 0):

- the training loss and the learning rate over updates, with the
  validation loss of each --valid-subset (``valid.jsonl``) beside it;
- the other validation metrics (accuracy, f1, ...) over updates, when the
  task has any;
- each rank's samples/s over time;
- each rank's share of the global batch over time, with the updates where
  the plan changed (--capacity auto re-planned) marked in both lower panels.

Runs where the ranks came and went (--elastic) have lines of different
lengths: a rank's series is drawn where it took part.
"""

import argparse
import json
import logging
import os
import sys

from hetseq.errors import UserError
from hetseq.reporting.balance import BalanceLog, ValidLog

logger = logging.getLogger("hetseq.reporting.plot")


VALID_COLORS = ("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive") * 4


def read_balance(save_dir):
    """The lines of ``save_dir/balance.jsonl``, oldest first."""
    path = os.path.join(save_dir, BalanceLog.NAME)
    if not os.path.exists(path):
        raise UserError(f"{save_dir}: no {BalanceLog.NAME}; pass the --save-dir of a run that "
                        "trained at least one update without --no-save")
    lines = read_lines(path)
    if not lines:
        raise UserError(f"{path} holds no updates yet; plot it once the run has trained")
    return lines


def read_lines(path):
    """The JSON lines of ``path`` ([] when it does not exist)."""
    if not os.path.exists(path):
        return []
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                try:
                    lines.append(json.loads(text))
                except json.JSONDecodeError:
                    # The last line of a run killed mid-write is cut short.
                    logger.warning("%s line %d is not JSON; skipped", path, number)
    return lines


def validation_series(lines):
    """{(split, metric): (updates, values)} of valid.jsonl's lines, in order."""
    series = {}
    for line in lines:
        if not isinstance(line.get("update"), (int, float)):
            continue
        for key, value in line.items():
            if key not in ("update", "epoch", "split", "time") and isinstance(value, (int, float)):
                updates, values = series.setdefault((line.get("split", "?"), key), ([], []))
                updates.append(line["update"])
                values.append(value)
    return series


def plan_changes(lines):
    """Updates whose plan (batch sizes) differs from the update before."""
    return [b["update"] for a, b in zip(lines, lines[1:]) if a["batch_sizes"] != b["batch_sizes"]]


def per_rank(lines, key):
    """{rank: (times, values)} of a per-rank list field, in seconds since the first update."""
    start = lines[0]["time"]
    series = {}
    for line in lines:
        for rank, value in enumerate(line.get(key) or []):
            times, values = series.setdefault(rank, ([], []))
            times.append(line["time"] - start)
            values.append(value)
    return series


def shares(lines):
    return [dict(line, shares=[b / max(sum(line["batch_sizes"]), 1) for b in line["batch_sizes"]])
            for line in lines]


def plot(save_dir, out=None):
    """Write the picture; returns its path."""
    fig = figure(save_dir)
    out = out or os.path.join(save_dir, "run.png")
    fig.savefig(out, dpi=100)
    import matplotlib.pyplot as plt        # (figure imported it)
    plt.close(fig)
    return out


def figure(save_dir):
    """The picture of the run in ``save_dir``, a matplotlib Figure."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("hetseq-plot needs matplotlib: pip install matplotlib") from None
    lines = read_balance(save_dir)
    valid = validation_series(read_lines(os.path.join(save_dir, ValidLog.NAME)))
    metrics = {key: v for key, v in valid.items() if key[1] != "loss"}
    fig, axes = plt.subplots(4 if metrics else 3, 1, figsize=(9, 12 if metrics else 9))
    ax_loss, ax_rate, ax_share = axes[0], axes[-2], axes[-1]
    updates = [line["update"] for line in lines]

    losses = [(u, line["loss"]) for u, line in zip(updates, lines) if line.get("loss") is not None]
    if losses:
        ax_loss.plot(*zip(*losses), color="tab:blue", lw=1, label="training")
    for color, ((split, _), (steps, values)) in zip(VALID_COLORS, sorted(
            v for v in valid.items() if v[0][1] == "loss")):
        ax_loss.plot(steps, values, marker="o", lw=1.5, color=color, label=f"validation '{split}'")
    if valid:
        ax_loss.legend(loc="upper right", fontsize="small")
    ax_loss.set(xlabel="update", ylabel="loss", title=os.path.abspath(save_dir))
    if metrics:
        for (split, name), (steps, values) in sorted(metrics.items()):
            axes[1].plot(steps, values, marker="o", lw=1.5, label=f"{name} on '{split}'")
        axes[1].legend(loc="best", fontsize="small")
        axes[1].set(xlabel="update", ylabel="validation metrics")
    rates = [(u, line["lr"]) for u, line in zip(updates, lines) if line.get("lr") is not None]
    if rates:
        ax_lr = ax_loss.twinx()
        ax_lr.plot(*zip(*rates), color="tab:orange", lw=1)
        ax_lr.set_ylabel("learning rate", color="tab:orange")

    start = lines[0]["time"]
    changed = {line["update"]: line["time"] - start for line in lines}
    for ax, key, label in ((ax_rate, "rank_samples_per_s", "samples/s (own compute)"),
                           (ax_share, "shares", "share of the global batch")):
        for rank, (times, values) in sorted(per_rank(shares(lines), key).items()):
            ax.plot(times, values, lw=1, label=f"rank {rank}")
        for update in plan_changes(lines):
            ax.axvline(changed[update], color="grey", ls=":", lw=1)
        ax.set(xlabel="seconds since the first update", ylabel=label)
    ax_share.set_ylim(0, 1)
    ax_rate.legend(loc="best", fontsize="small", ncol=4)
    if plan_changes(lines):
        ax_share.set_title("dotted: the plan changed", fontsize="small")
    fig.tight_layout()
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="hetseq-plot", description="Draw a run (SAVE_DIR/balance.jsonl) into SAVE_DIR/run.png.")
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="the --save-dir of a run")
    parser.add_argument("--out", metavar="PNG", help="where to write (default: SAVE_DIR/run.png)")
    args = parser.parse_args(argv)
    try:
        print(plot(args.save_dir, args.out))
    except UserError as err:
        print(f"hetseq-plot: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
