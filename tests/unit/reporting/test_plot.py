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


def metric_panels(fig):
    """{title: axes} of the small panels of validation metrics."""
    return {ax.get_title(): ax for ax in fig.axes if not ax.get_ylabel() and ax.get_title()}


def boxes(fig):
    """(what, bounding box) of every piece of text a reader reads as a label:
    the title, each panel's title, axis labels, written texts and legends."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = [("title", fig._suptitle.get_window_extent(renderer))]
    for index, ax in enumerate(fig.axes):
        for what, text in (("title", ax.title), ("xlabel", ax.xaxis.label),
                           ("ylabel", ax.yaxis.label), *(("text", t) for t in ax.texts)):
            if text.get_text() and text.get_visible():
                found.append((f"axes {index} {what} {text.get_text()!r}",
                              text.get_window_extent(renderer)))
        if ax.get_legend() is not None:
            found.append((f"axes {index} legend", ax.get_legend().get_window_extent(renderer)))
    return found


def assert_no_label_overlaps(fig):
    found = boxes(fig)
    for i, (a, box_a) in enumerate(found):
        for b, box_b in found[i + 1:]:
            assert not box_a.overlaps(box_b), f"{a} overlaps {b}"
    # ...and no legend covers a drawn point of any panel.
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes
               if ax.get_legend() is not None]
    for ax in fig.axes:
        for line in ax.get_lines():
            points = ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata())))
            assert not any(box.contains(x, y) for box in legends for x, y in points), \
                f"a legend covers a point of {line.get_label()!r}"


def test_a_short_run_with_one_validation_and_equal_shares(tmp_path):
    write_run(tmp_path, 10, lambda u: [8, 8], loss=lambda u: 10.0 - 0.5 * u, lr=lambda u: 0.1,
              validations=[10])
    fig = figure(tmp_path)
    axes = panels(fig)
    # Loss, one small panel for the accuracy, samples/s, shares (and the lr twin).
    assert len(fig.axes) == 5
    assert list(axes) == ["loss", "learning rate", "", "samples/s (own compute)",
                          "share of the global batch"]
    assert fig._suptitle.get_text() == f"run: {tmp_path.name}"
    loss = axes["loss"]
    # The one validation loss: a marked point on the loss panel; the accuracy
    # on its own panel with its value in the title; nothing written over them.
    drawn = lines(loss)
    point = drawn["validation 'valid'"]
    assert list(point.get_xdata()) == [10] and list(point.get_ydata()) == [0.5]
    assert point.get_marker() == "o" and point.get_markersize() >= 6
    assert not loss.texts
    accuracy = metric_panels(fig)["accuracy: 0.6001"]
    assert [list(line.get_xdata()) for line in accuracy.get_lines()] == [[10]]
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
    # One x-axis, updates, for every panel.
    assert {ax.get_xlabel() for ax in fig.axes if ax.get_ylabel() != "learning rate"} == \
        {"update"}
    assert_no_label_overlaps(fig)


def test_bert_validation_metrics_read_each_on_its_own_scale(tmp_path):
    """The main job's picture: a loss falling from 9.8 to 7.2, one
    validation of five metrics. nsp_loss (0.69) gets a panel of its own, so
    the loss panel still spans the fall; no label overlaps another or a legend."""
    write_run(tmp_path, 60, lambda u: [16, 16], loss=lambda u: 9.8 - 2.6 * u / 60,
              lr=lambda u: 5e-4, validations=[])
    (tmp_path / "valid.jsonl").write_text(json.dumps({
        "update": 60, "epoch": 1, "split": "valid", "time": 1060.0, "loss": 7.081,
        "mlm_loss": 6.4, "mlm_accuracy": 0.05044, "nsp_loss": 0.6931, "nsp_accuracy": 0.5}) + "\n")
    fig = figure(tmp_path)
    assert list(metric_panels(fig)) == ["mlm_loss: 6.4", "nsp_loss: 0.6931",
                                        "mlm_accuracy: 0.05044", "nsp_accuracy: 0.5"]
    low, high = panels(fig)["loss"].get_ylim()
    assert 6.5 < low < 7.2 and 9.8 < high < 10.5
    assert_no_label_overlaps(fig)


def test_a_long_run_with_validations_and_unequal_shares(tmp_path):
    updates = 10_000
    write_run(tmp_path, updates,
              lambda u: [12, 4] if u <= 5000 else [10, 6],         # re-planned at 5001
              loss=lambda u: 2 + 8 * math.exp(-u / 1000) + 0.1 * math.sin(u),
              lr=lambda u: 0.1 * (1 - u / updates), validations=range(1000, 10_001, 1000))
    fig = figure(tmp_path)
    axes = panels(fig)
    assert len(fig.axes) == 5
    assert list(axes) == ["loss", "learning rate", "", "samples/s (own compute)",
                          "share of the global batch"]
    # Long series: no markers, thin lines; ten validations marked on their own line.
    drawn = lines(axes["loss"])
    training = drawn["training"]
    assert training.get_marker() in ("None", None, "") and training.get_linewidth() < 1
    assert len(training.get_xdata()) == updates
    assert list(drawn["validation 'valid'"].get_xdata()) == list(range(1000, 10_001, 1000))
    assert not axes["loss"].texts
    # Accuracy on its own axis, not the loss's; its limits around its values.
    (title, metric), = metric_panels(fig).items()
    assert title == "accuracy: 0.7" and len(metric.get_lines()[0].get_xdata()) == 10
    low, high = metric.get_ylim()
    assert 0.59 < low < 0.61 and 0.7 < high < 0.71
    assert axes["loss"].get_ylim()[1] > 9
    # Unequal shares: two stacked bands (75/25, then 62.5/37.5), every rank in the legend.
    share = axes["share of the global batch"]
    assert len(share.collections) == 2 and legend(share) == ["rank 0", "rank 1"]
    bottom = share.collections[0].get_paths()[0].vertices[:, 1]
    assert set(bottom.round(4)) >= {0.75, 0.625}
    # The plan's change marked in both lower panels, at its update.
    for name in ("samples/s (own compute)", "share of the global batch"):
        assert [list(line.get_xdata()) for line in axes[name].get_lines()
                if line.get_linestyle() == ":"] == [[5001, 5001]]
    assert all(line.get_marker() in ("None", None, "")
               for line in axes["samples/s (own compute)"].get_lines()
               if line.get_linestyle() != ":")
    assert_no_label_overlaps(fig)
