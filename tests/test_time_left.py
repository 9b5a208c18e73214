"""Honest time left (progress lines and hetseq-status): "measuring" until
there is a rate, validations and saves counted at what they took, never
0:00:00 before the end; a line where each validation and save starts and
ends; each node's lines carry its own ranks from the first line on."""

import re
import types

from machinery.commands import node_commands, run_nodes, run_train
from machinery.settings import TOY

from hetseq.reporting import progress, status
from hetseq.run.events import Events


def clock_at(monkeypatch, planned=10, due=None):
    """A Clock on a fake time that the test moves (``now[0]``)."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Clock(planned)
    clock.due = due
    return clock, now


def test_before_a_rate_the_time_left_is_measuring(monkeypatch):
    clock, now = clock_at(monkeypatch)
    assert clock.head(1) == "update 1/10 | measuring time left"    # nothing ticked yet
    clock.tick(1)                        # the end of the first update: the rate starts here
    now[0] += 5.0
    assert clock.head(1) == "update 1/10 | measuring time left" and clock.left(1) is None
    clock.tick(2)
    assert clock.head(2) == "update 2/10 | 0:00:40 left"            # 8 left at 5 s each
    assert progress.Clock(None).head(3) == "update 3"                # no end: no time left


def test_validations_and_saves_due_are_counted_at_what_they_took(monkeypatch):
    due = {"validation": 0, "saving": 0}
    clock, now = clock_at(monkeypatch, due=lambda update: dict(due))
    clock.tick(1)
    now[0] += 2.0
    clock.tick(2)
    due.update(validation=2, saving=1)
    # Not yet timed: named, and never '0:00:00 left' before the end.
    assert clock.left_text(2) == "0:00:16 left + validation and saving (not yet timed)"
    now[0] += 30.0                       # a validation (20 s) and a save (10 s) at update 2
    clock.paused("validation", 12.0, 2)
    clock.paused("validation", 8.0, 2)   # a second split of the same validation: summed
    clock.paused("saving", 10.0, 2)
    # 8 updates at 2 s (the 30 s of events left out of the rate) + 2 x 20 s + 10 s.
    assert clock.left(2) == 16.0 + 40.0 + 10.0
    assert clock.left_text(2) == "0:01:06 left"
    now[0] += 4.0
    clock.paused("validation", 4.0, 4)   # another update's validation: the last one counts
    assert clock.left(2) == 16.0 + 8.0 + 10.0
    # At the last update, with its save still due: what the save takes, not zero.
    now[0] += 12.2
    due.update(validation=0, saving=1)
    clock.paused("saving", 0.2, 6)
    assert clock.left_text(10) == "0:00:01 left"
    due.update(saving=0)
    assert clock.left_text(10) == "0:00:00 left"                     # nothing left: the end
    clock.took.clear()
    due.update(saving=1)
    assert clock.left_text(10) == "saving left (not yet timed)"


def test_the_events_still_due_are_counted_from_the_flags():
    flags = types.SimpleNamespace(disable_validation=False, validate_interval_updates=0,
                                  validate_interval=1, max_update=0)
    saving = types.SimpleNamespace(save_interval_updates=0, save_interval=1)
    events = Events(flags, saving)
    # Epochs of 4 updates, the first ending at 4, the run planned to 10: the
    # ends of epochs 1 and 2 (4, 8) and the stop (10) validate and save.
    assert events.still_due(1, 10, 1, 4, 4) == {"validation": 3, "saving": 3}
    # At update 4 its own events are still to come (they follow its line).
    assert events.still_due(4, 10, 1, 4, 4) == {"validation": 3, "saving": 3}
    assert events.still_due(9, 10, 3, 12, 4) == {"validation": 1, "saving": 1}
    flags.validate_interval_updates, saving.save_interval = 3, 2
    # Validations at 3, 6, 9, the epoch ends 4 and 8, and 10; saves at 8 and 10.
    assert events.still_due(1, 10, 1, 4, 4) == {"validation": 6, "saving": 2}
    assert events.still_due(1, 10, 1, 4, 4, saves=False)["saving"] == 0
    flags.disable_validation = True
    assert events.still_due(1, 10, 1, 4, 4)["validation"] == 0


def test_a_run_marks_its_validations_and_saves_and_counts_them_in_the_time_left(tmp_path):
    result = run_train(*TOY, "--optimizer", "sgd", "--lr", "0.1", "--max-update", 8,
                       "--log-interval", 1, "--max-sentences", 8, "--save-dir", tmp_path,
                       "--validate-interval-updates", 3, "--save-interval-updates", 3,
                       "--no-epoch-checkpoints")
    out = result.stderr
    assert result.returncode == 0, out[-3000:]
    lines = [line.split(" | ", 4)[-1] for line in out.splitlines()
             if "hetseq.run |" in line or "hetseq.progress |" in line]
    heads = [re.search(r"update (\d+)/8 \| ([^|]+) \|", line) for line in lines]
    left = {int(m[1]): m[2].strip() for m in heads if m}
    assert left[1] == "measuring time left", left
    # Before the first validation and save: named as not yet timed.
    assert left[2].endswith("left + validation and saving (not yet timed)"), left
    # After them: a time, never zero before the end (update 8 validates and saves).
    assert all(re.fullmatch(r"\d+:\d\d:\d\d left", left[u]) for u in range(4, 9)), left
    assert "0:00:00 left" not in out
    for update in (3, 6, 8):
        start = lines.index(f"validating 'valid' ({_valid_size(out)} samples)...",
                            lines.index(next(l for l in lines if f"update {update}/8 |" in l)))
        assert re.fullmatch(r"validated in \d+\.\d s", lines[start + 2]), lines[start:start + 3]
        assert f"| update {update}" in lines[start + 1]          # the result between them
        save = lines.index(f"saving a checkpoint of update {update}...", start)
        assert re.fullmatch(r"saved in \d+\.\d s", lines[save + 1]), lines[save:save + 2]


def _valid_size(out):
    return re.search(r"validating 'valid' \((\d+) samples\)", out)[1]


def test_the_status_shows_the_runs_own_words_for_the_time_left():
    view = status.clean({"update": 1, "planned": 60, "left": "measuring time left",
                         "left_s": None, "ranks": []})
    assert "update 1/60 | measuring time left |" in status.render(view, "tcp://h:1", now=0)[0]
    old = status.clean({"update": 40, "planned": 60, "left_s": 21, "ranks": []})
    assert "| 0:00:21 left |" in status.render(old, "tcp://h:1", now=0)[0]


def test_every_line_of_a_node_says_its_own_ranks(tmp_path):
    """Node 2's first line (the demo corpus it will read, logged before its
    ranks start) said 'rank 0'; every line of a node names its ranks."""
    from hetseq.bert import demo
    from hetseq.bert.model import BertConfig
    default = demo.pretraining_data()
    with open(default.vocab) as f:
        vocab_size = sum(1 for _ in f)
    config = tmp_path / "tiny.json"
    BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=128).to_json(config)
    common = ["--task", "bert", "--config_file", config, "--max-update", 1, "--no-save",
              "--disable-validation", "--max_pred_length", 20]
    results = run_nodes(node_commands(common, [(1, ["--max-sentences", 4]),
                                               (2, ["--max-sentences", 2])]))
    for (code, out), ranks in zip(results, ("0", "1-2")):
        assert code == 0, out[-3000:]
        said = re.findall(r"^\d\d:\d\d:\d\d \| (rank [\d-]+|node) \|", out, re.M)
        assert said and said[0] == f"rank {ranks}", said
        line = next(line for line in out.splitlines() if "no --data: pretraining" in line)
        assert f"| rank {ranks} |" in line, line
        # Then its ranks' own lines: rank 1's and rank 2's on node 2.
        own = {f"rank {ranks}", *(f"rank {r}" for r in ranks.split("-"))}
        assert set(said) <= own, said


def test_the_status_board_says_measuring_at_the_first_update(tmp_path):
    """hetseq-status showed 0:00:00 left at update 1: rank 0's board now
    publishes the same words as its progress lines."""
    from hetseq.reporting.report import Reporter
    from hetseq.update.stats import RankReport, StepResult

    class Board:
        views = []

        def due(self):
            return True

        def update(self, **figures):
            self.views.append(figures)

        def ranks(self, *args):
            return []
    ctx = types.SimpleNamespace(is_main=True, board=Board())
    log = types.SimpleNamespace(tensorboard_logdir=None, no_progress_bar=True, log_interval=1)
    save = types.SimpleNamespace(save_dir=str(tmp_path), no_save=True)
    task = types.SimpleNamespace(reduce_metrics=lambda totals: {"loss": 1.0})
    report = Reporter(log, save, ctx, task)
    report.plan(60, lambda update: {"validation": 1, "saving": 0})
    report.start_epoch(1, 60)
    result = StepResult({"sample_size": 8}, RankReport([1.0], [8], [1.0]), 0.1, True)
    for update in (1, 2):
        report.update(result, update, 0.01, [8])
    first, second = (view["left"] for view in ctx.board.views)
    assert first == "measuring time left"
    assert re.fullmatch(r"\d+:\d\d:\d\d left \+ validation \(not yet timed\)", second), second
    assert ctx.board.views[0]["left_s"] is None
