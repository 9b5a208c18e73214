"""hetseq-plot's picture reads at a glance for any run length: read from the
Figure's axes (panels, labels, what each draws, legends, y-limits), for a
10-update run with one validation and equal shares, and for a 10,000-update
run with several validations and unequal shares."""

import json
import math

import pytest

pytest.importorskip("matplotlib")

from hetseq.reporting.plot import figure  # noqa: E402


def write_run(folder, updates, batch_sizes, loss, lr, validations):
    """balance.jsonl of ``updates`` updates (one second apart) and valid.jsonl."""
    with open(folder / "balance.jsonl", "w") as f:
        for u in range(1, updates + 1):
            sizes = batch_sizes(u)
            f.write(json.dumps({
                "update": u, "time": 1000.0 + u, "wall_s": 1.0, "samples": sum(sizes),
                "batch_sizes": sizes, "loss": loss(u), "lr": lr(u),
                "rank_compute_s": [0.5] * len(sizes), "rank_samples": sizes,
                "rank_samples_per_s": [2.0 * b for b in sizes]}) + "\n")
    with open(folder / "valid.jsonl", "w") as f:
        for u in validations:
            f.write(json.dumps({"update": u, "epoch": 1, "split": "valid", "time": 1000.0 + u,
                                "loss": 5.0 / u, "accuracy": 0.6 + u / 1e5}) + "\n")


def panels(fig):
    """{y-label: axes} of the figure, the twin learning-rate axis included."""
    return {ax.get_ylabel(): ax for ax in fig.axes}


def legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []


def lines(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_a_short_run_with_one_validation_and_equal_shares(tmp_path):
    write_run(tmp_path, 10, lambda u: [8, 8], loss=lambda u: 10.0 - 0.5 * u, lr=lambda u: 0.1,
              validations=[10])
    fig = figure(tmp_path)
    axes = panels(fig)
    # No validation panel for one validation: loss, samples/s, shares (and the lr twin).
    assert len(fig.axes) == 4
    assert list(axes) == ["loss", "samples/s (own compute)", "share of the global batch",
                          "learning rate"]
    loss = axes["loss"]
    # The one validation: a marked point on the loss panel with its values written beside it.
    drawn = lines(loss)
    point = drawn["validation 'valid'"]
    assert list(point.get_xdata()) == [10] and list(point.get_ydata()) == [0.5]
    assert point.get_marker() == "o" and point.get_markersize() >= 6
    assert [t.get_text() for t in loss.texts] == ["accuracy 0.6001\nloss 0.5"]
    # A short run: every training update marked, so each of the ten shows.
    assert drawn["training"].get_marker() == "o" and len(drawn["training"].get_xdata()) == 10
    assert legend(loss) == ["training", "validation 'valid'", "learning rate"]
    low, high = loss.get_ylim()
    assert low < 0.5 and high > 9.5
    # The constant learning rate on its own axis, from 0, not squeezed to a sliver.
    lr_low, lr_high = axes["learning rate"].get_ylim()
    assert lr_low == 0 and 0.1 < lr_high < 0.2
    # Equal shares of 2 ranks: two bands of a half each, both in the legend.
    share = axes["share of the global batch"]
    bands = share.collections
    assert len(bands) == 2 and legend(share) == ["rank 0", "rank 1"]
    tops = [max(path.vertices[:, 1]) for band in bands for path in band.get_paths()]
    assert tops == pytest.approx([0.5, 1.0])
    assert share.get_ylim() == (0, 1)
    assert legend(axes["samples/s (own compute)"]) == ["rank 0", "rank 1"]
    # Constant samples/s: an axis from 0 above the value, not 16 +- a sliver.
    rate_low, rate_high = axes["samples/s (own compute)"].get_ylim()
    assert rate_low == 0 and 16 < rate_high < 40


def test_a_long_run_with_validations_and_unequal_shares(tmp_path):
    updates = 10_000
    write_run(tmp_path, updates,
              lambda u: [12, 4] if u <= 5000 else [10, 6],         # re-planned at 5001
              loss=lambda u: 2 + 8 * math.exp(-u / 1000) + 0.1 * math.sin(u),
              lr=lambda u: 0.1 * (1 - u / updates), validations=range(1000, 10_001, 1000))
    fig = figure(tmp_path)
    axes = panels(fig)
    assert len(fig.axes) == 5
    assert list(axes) == ["loss", "validation metrics", "samples/s (own compute)",
                          "share of the global batch", "learning rate"]
    # Long series: no markers, thin lines; ten validations marked on their own line.
    drawn = lines(axes["loss"])
    training = drawn["training"]
    assert training.get_marker() in ("None", None, "") and training.get_linewidth() < 1
    assert len(training.get_xdata()) == updates
    assert list(drawn["validation 'valid'"].get_xdata()) == list(range(1000, 10_001, 1000))
    assert not axes["loss"].texts         # values beside a point: only for one validation
    # Accuracy on its own axis, not the loss's; its limits around its values.
    metric = lines(axes["validation metrics"])
    assert list(metric) == ["accuracy on 'valid'"] and len(metric["accuracy on 'valid'"]
                                                           .get_xdata()) == 10
    low, high = axes["validation metrics"].get_ylim()
    assert 0.59 < low < 0.61 and 0.7 < high < 0.71
    assert axes["loss"].get_ylim()[1] > 9
    # Unequal shares: two stacked bands (75/25, then 62.5/37.5), every rank in the legend.
    share = axes["share of the global batch"]
    assert len(share.collections) == 2 and legend(share) == ["rank 0", "rank 1"]
    bottom = share.collections[0].get_paths()[0].vertices[:, 1]
    assert set(bottom.round(4)) >= {0.75, 0.625}
    # The plan's change marked in both lower panels, long lines drawn without markers.
    for name in ("samples/s (own compute)", "share of the global batch"):
        assert [list(line.get_xdata()) for line in axes[name].get_lines()
                if line.get_linestyle() == ":"] == [[5000.0, 5000.0]]
    assert all(line.get_marker() in ("None", None, "")
               for line in axes["samples/s (own compute)"].get_lines())
