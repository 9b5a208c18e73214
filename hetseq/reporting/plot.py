"""A picture of a run: ``hetseq-plot SAVE_DIR`` writes ``SAVE_DIR/run.png``
from ``balance.jsonl`` and ``valid.jsonl``, so that a user sees the losses,
each rank's speed and the plan's shares without writing a plotting script
(figure() returns the Figure, plot() saves it).
docs/capacity.md, "What a run records" (the panels).
"""

import contextlib
import json
import logging
import os
import sys

from hetseq.base.errors import UserError
from hetseq.base.flags import Parser
from hetseq.base.logs import disk_of, why_not_written
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
    """Write the picture; returns its path. It is drawn into a file beside
    ``out`` and renamed onto it: a full disk leaves the previous picture
    whole, and is one line (UserError) naming the file and the disk."""
    fig = figure(save_dir)
    out = out or os.path.join(save_dir, "run.png")
    import matplotlib.pyplot as plt        # (figure imported it)
    folder, name = os.path.split(os.path.abspath(out))
    partial = os.path.join(folder, f".{name}.partial")
    try:
        fig.savefig(partial, dpi=100, format=os.path.splitext(name)[1][1:] or "png")
        os.replace(partial, out)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise UserError(f"cannot write {out} ({why_not_written(err)}; {disk_of(out)}); "
                        "free space there or pass --out on another disk") from None
    finally:
        plt.close(fig)
    return out


MARKERS_UP_TO = 50      # points in a series: more, and it is drawn as a thin line alone


def style(count, lw=1.5):
    """Line style for a series of ``count`` points: marked when short, thin when long."""
    if count <= MARKERS_UP_TO:
        return {"marker": "o", "markersize": 4, "lw": lw}
    return {"lw": 0.7 if count > 10 * MARKERS_UP_TO else 1}


def set_limits(ax, values, bottom=None):
    """y-limits around ``values`` that never collapse: a constant series
    sits in the upper part of an axis that reaches 0."""
    values = [v for v in values if v == v]      # (drop NaN)
    if not values:
        return
    low, high = min(values), max(values)
    room = 0.08
    if high - low <= 1e-9 * max(abs(high), abs(low), 1e-30):
        low, high, room = min(low, 0.0), max(high, 0.0), 0.3
        if low == high:
            low, high = -1.0, 1.0
    pad = room * (high - low)
    ax.set_ylim(low - pad if bottom is None else bottom, high + pad)


def is_loss(name):
    """Validation metrics drawn with the losses (on the loss axis), not the accuracies."""
    return "loss" in name or name in ("ppl", "perplexity")


def figure(save_dir):
    """The picture of the run in ``save_dir``, a matplotlib Figure.

    Panels: losses (training, validation; the learning rate on a twin axis);
    the other validation metrics (accuracy, f1, ...) on their own axis, when
    some metric has two or more validations (one validation is written as
    values beside its point on the loss panel instead); each rank's
    samples/s; the ranks' shares of the global batch, stacked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("hetseq-plot needs matplotlib: pip install matplotlib") from None
    lines = read_balance(save_dir)
    valid = validation_series(read_lines(os.path.join(save_dir, ValidLog.NAME)))
    metrics = {key: v for key, v in valid.items() if not is_loss(key[1])}
    with_panel = any(len(steps) >= 2 for steps, _ in metrics.values())
    fig, axes = plt.subplots(4 if with_panel else 3, 1, figsize=(9, 12 if with_panel else 9))
    ax_loss, ax_rate, ax_share = axes[0], axes[-2], axes[-1]
    updates = [line["update"] for line in lines]
    _losses(ax_loss, lines, updates, valid, annotate=not with_panel)
    ax_loss.set(xlabel="update", ylabel="loss", title=os.path.abspath(save_dir))
    if with_panel:
        _metrics(axes[1], metrics)
    _learning_rate(ax_loss, lines, updates)
    _speeds_and_shares(ax_rate, ax_share, lines, updates)
    fig.tight_layout()
    return fig


def _losses(ax, lines, updates, valid, annotate):
    """Training and validation losses; with ``annotate`` (no metrics
    panel), a single validation's values written beside its point."""
    losses = [(u, line["loss"]) for u, line in zip(updates, lines) if line.get("loss") is not None]
    drawn = [v for _, v in losses]
    if losses:
        ax.plot(*zip(*losses), color="tab:blue", label="training", **style(len(losses), 1))
    for color, ((split, name), (steps, values)) in zip(VALID_COLORS, sorted(
            v for v in valid.items() if is_loss(v[0][1]))):
        label = f"validation '{split}'" if name == "loss" else f"{name} on '{split}'"
        ax.plot(steps, values, color=color, label=label,
                **dict(style(len(steps)), markersize=4 if len(steps) > 1 else 8))
        drawn += values
    for split in sorted({split for split, _ in valid}):
        single = {name: v[1][0] for (s, name), v in valid.items() if s == split and len(v[0]) == 1}
        if single and annotate:        # one validation: its values where it is drawn
            steps, values = valid.get((split, "loss"), ([], []))
            text = "\n".join(f"{name} {v:.4g}" for name, v in sorted(single.items()))
            if len(values) == 1:
                ax.annotate(text, (steps[0], values[0]), xytext=(-8, 8), ha="right",
                            textcoords="offset points", fontsize="small")
            else:
                ax.text(0.02, 0.95, f"'{split}': {text}", transform=ax.transAxes,
                        va="top", fontsize="small")
    set_limits(ax, drawn)


def _metrics(ax, metrics):
    """The validation metrics that are not losses, on their own axis."""
    for (split, name), (steps, values) in sorted(metrics.items()):
        ax.plot(steps, values, label=f"{name} on '{split}'", **style(len(steps)))
    set_limits(ax, [v for _, values in metrics.values() for v in values])
    ax.legend(loc="best", fontsize="small")
    ax.set(xlabel="update", ylabel="validation metrics")


def _learning_rate(ax_loss, lines, updates):
    """The learning rate on a twin axis of the loss panel; one legend for both."""
    rates = [(u, line["lr"]) for u, line in zip(updates, lines) if line.get("lr") is not None]
    handles = list(ax_loss.get_lines())
    if rates:
        ax_lr = ax_loss.twinx()
        ax_lr.plot(*zip(*rates), color="tab:orange", lw=1, label="learning rate")
        set_limits(ax_lr, [r for _, r in rates], bottom=0)
        ax_lr.set_ylabel("learning rate", color="tab:orange")
        handles += list(ax_lr.get_lines())
    if handles:
        ax_loss.legend(handles=handles, loc="upper right", fontsize="small")


def _speeds_and_shares(ax_rate, ax_share, lines, updates):
    """Each rank's samples/s and the ranks' shares, stacked, over seconds;
    dotted where the plan changed."""
    start = lines[0]["time"]
    times = [line["time"] - start for line in lines]
    if len(times) == 1:     # one update: a band as wide as it took
        times, lines = [0.0, lines[0].get("wall_s") or 1.0], lines * 2
    for rank, (seconds, values) in sorted(per_rank(lines, "rank_samples_per_s").items()):
        ax_rate.plot(seconds, values, label=f"rank {rank}", **style(len(values), 1))
    set_limits(ax_rate, [v for line in lines for v in line.get("rank_samples_per_s") or []], 0)
    ax_rate.set(xlabel="seconds since the first update", ylabel="samples/s (own compute)")
    # Shares stacked: equal shares show as equal bands, a rank absent (elastic) as none.
    count = max(len(line["batch_sizes"]) for line in lines)
    stacked = [[(line["shares"] + [0.0] * count)[rank] for line in shares(lines)]
               for rank in range(count)]
    ax_share.stackplot(times, *stacked, labels=[f"rank {r}" for r in range(count)], alpha=0.8)
    ax_share.set(xlabel="seconds since the first update", ylabel="share of the global batch",
                 ylim=(0, 1))
    changed = dict(zip(updates, times))
    for ax in (ax_rate, ax_share):
        for update in plan_changes(lines):
            ax.axvline(changed[update], color="grey", ls=":", lw=1)
        if ax.get_legend_handles_labels()[0]:       # beside the panel: it hides nothing
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small",
                      ncol=1 + (count - 1) // 12)
    if plan_changes(lines):
        ax_share.set_title("dotted: the plan changed", fontsize="small")


def main(argv=None):
    parser = Parser(
        prog="hetseq-plot",
        description="Draw a run (SAVE_DIR/balance.jsonl) into SAVE_DIR/run.png.")
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
