"""What a new user sees: progress lines they can read, a line per node when it
joins, waits and ends, the LR horizon actually used, TensorBoard and a
picture of every run without asking."""

import json


def test_plot_draws_each_validation_metric_of_each_subset(tmp_path):
    from hetseq.reporting.plot import figure
    (tmp_path / "balance.jsonl").write_text("".join(
        json.dumps({"update": u, "time": u, "batch_sizes": [4], "loss": 1.0 / u}) + "\n"
        for u in range(1, 5)))
    (tmp_path / "valid.jsonl").write_text("".join(
        json.dumps({"update": u, "epoch": 1, "split": split, "time": u, "loss": 2.0 / u,
                    "accuracy": u / 4}) + "\n" for u in (2, 4) for split in ("valid", "test"))
        + '{"update": 5, "loss": 1.0}\n'     # no split (another writer): drawn as '?'
        + '{"update": 6, "cut sh')      # a run killed mid-line
    fig = figure(tmp_path)
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "loss", "", "samples/s (own compute)", "share of the global batch"]
    assert fig.axes[1].get_title() == "accuracy: test 1, valid 1"
    labels = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert labels == {"'test'": [0.5, 1.0], "'valid'": [0.5, 1.0]}
    loss = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert loss["validation '?'"] == [1.0] and loss["validation 'test'"] == [1.0, 0.5]


def test_plan_changes_are_found():
    from hetseq.reporting.plot import plan_changes
    lines = [{"update": u, "batch_sizes": sizes}
             for u, sizes in enumerate([[2, 2], [2, 2], [3, 1], [3, 1], [2, 2]], 1)]
    assert plan_changes(lines) == [3, 5]
