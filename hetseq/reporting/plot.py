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
    """{rank: values} of a per-rank list field, one per line (NaN, a gap in
    the line drawn, where a line has no value for that rank: it took no part)."""
    count = max((len(line.get(key) or []) for line in lines), default=0)
    gaps = [float("nan")] * count
    return {rank: [((line.get(key) or []) + gaps)[rank] for line in lines]
            for rank in range(count)}


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
    """Validation metrics that are losses (drawn before the accuracies)."""
    return "loss" in name or name in ("ppl", "perplexity")


METRICS_PER_ROW = 4     # small panels of validation metrics side by side


def figure(save_dir):
    """The picture of the run in ``save_dir``, a matplotlib Figure, titled
    with the run's name (its folder's), every panel over updates.

    Panels: the training loss with the validation loss (the same quantity,
    one scale) and the learning rate on a twin axis; one small panel per
    other validation metric (each on its own scale: nsp_loss near 0.7 must
    not flatten a loss falling from 9.8 to 7.2), its last value in its
    title; each rank's samples/s; the ranks' shares of the global batch,
    stacked. Every legend sits beside its panel, so no label covers a point."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("hetseq-plot needs matplotlib: pip install matplotlib") from None
    lines = read_balance(save_dir)
    valid = validation_series(read_lines(os.path.join(save_dir, ValidLog.NAME)))
    names = sorted({name for _, name in valid if name != "loss"},
                   key=lambda name: (not is_loss(name), name))
    columns = max(1, min(METRICS_PER_ROW, len(names)))
    metric_rows = -(-len(names) // METRICS_PER_ROW)
    fig = plt.figure(figsize=(10, 9 + 2.2 * metric_rows), layout="constrained")
    grid = fig.add_gridspec(3 + metric_rows, columns,
                            height_ratios=[3] + [2] * metric_rows + [2.2, 2.2])
    ax_loss = fig.add_subplot(grid[0, :])
    updates = [line["update"] for line in lines]
    _losses(ax_loss, lines, updates, valid)
    _learning_rate(ax_loss, lines, updates)
    for index, name in enumerate(names):
        row, column = divmod(index, METRICS_PER_ROW)
        _metric(fig.add_subplot(grid[1 + row, column], sharex=ax_loss), name,
                {split: series for (split, n), series in valid.items() if n == name})
    ax_rate = fig.add_subplot(grid[1 + metric_rows, :], sharex=ax_loss)
    ax_share = fig.add_subplot(grid[2 + metric_rows, :], sharex=ax_loss)
    _speeds_and_shares(ax_rate, ax_share, lines, updates)
    fig.suptitle(f"run: {os.path.basename(os.path.abspath(save_dir))}")
    return fig


def _losses(ax, lines, updates, valid):
    """Training loss and every split's validation loss."""
    losses = [(u, line["loss"]) for u, line in zip(updates, lines) if line.get("loss") is not None]
    drawn = [v for _, v in losses]
    if losses:
        ax.plot(*zip(*losses), color="tab:blue", label="training", **style(len(losses), 1))
    for color, ((split, _), (steps, values)) in zip(VALID_COLORS, sorted(
            v for v in valid.items() if v[0][1] == "loss")):
        ax.plot(steps, values, color=color, label=f"validation '{split}'",
                **dict(style(len(steps)), markersize=4 if len(steps) > 1 else 8))
        drawn += values
    set_limits(ax, drawn)
    ax.set(xlabel="update", ylabel="loss")


def _metric(ax, name, splits):
    """One validation metric of every split, on its own scale; the last
    values in the title."""
    last = []
    for color, (split, (steps, values)) in zip(VALID_COLORS, sorted(splits.items())):
        ax.plot(steps, values, color=color, label=f"'{split}'",
                **dict(style(len(steps)), markersize=4 if len(steps) > 1 else 7))
        last.append(f"{values[-1]:.4g}" if len(splits) == 1 else f"{split} {values[-1]:.4g}")
    set_limits(ax, [v for _, values in splits.values() for v in values])
    ax.set_title(f"{name}: {', '.join(last)}", fontsize="small")
    ax.tick_params(labelsize="x-small")
    ax.set_xlabel("update", fontsize="x-small")


def _learning_rate(ax_loss, lines, updates):
    """The learning rate on a twin axis of the loss panel; one legend for
    both, beside the panel."""
    rates = [(u, line["lr"]) for u, line in zip(updates, lines) if line.get("lr") is not None]
    handles = list(ax_loss.get_lines())
    if rates:
        ax_lr = ax_loss.twinx()
        ax_lr.plot(*zip(*rates), color="tab:orange", lw=1, label="learning rate")
        set_limits(ax_lr, [r for _, r in rates], bottom=0)
        ax_lr.set_ylabel("learning rate", color="tab:orange")
        handles += list(ax_lr.get_lines())
    if handles:
        ax_loss.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1),
                       fontsize="small")


def _speeds_and_shares(ax_rate, ax_share, lines, updates):
    """Each rank's samples/s and the ranks' shares, stacked, over updates;
    dotted where the plan changed."""
    steps = list(updates)
    if len(steps) == 1:     # one update: a band one update wide
        steps, lines = [steps[0] - 0.5, steps[0] + 0.5], lines * 2
    for rank, values in sorted(per_rank(lines, "rank_samples_per_s").items()):
        ax_rate.plot(steps[:len(values)], values, label=f"rank {rank}", **style(len(values), 1))
    set_limits(ax_rate, [v for line in lines for v in line.get("rank_samples_per_s") or []], 0)
    ax_rate.set(xlabel="update", ylabel="samples/s (own compute)")
    # Shares stacked: equal shares show as equal bands, a rank absent (elastic) as none.
    count = max(len(line["batch_sizes"]) for line in lines)
    stacked = [[(line["shares"] + [0.0] * count)[rank] for line in shares(lines)]
               for rank in range(count)]
    ax_share.stackplot(steps, *stacked, labels=[f"rank {r}" for r in range(count)], alpha=0.8)
    ax_share.set(xlabel="update", ylabel="share of the global batch", ylim=(0, 1))
    for ax in (ax_rate, ax_share):
        for update in plan_changes(lines):
            ax.axvline(update, color="grey", ls=":", lw=1)
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
