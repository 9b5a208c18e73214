"""Honest time left (progress lines and hetseq-status): "measuring" until
there is a rate, validations and saves counted at what they took, never
0:00:00 before the end; a line where each validation and save starts and
ends; each node's lines carry its own ranks from the first line on."""

import re
import types


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
    clock.valid_samples, clock.batch = 24, 8
    clock.tick(1)
    now[0] += 2.0
    clock.tick(2)
    due.update(validation=2, saving=1)
    # Before one ran: a validation of 24 samples at 8 samples an update of
    # 2 s, a forward a third of a step (2 s each); a save at one update's time.
    assert clock.left(2) == 16.0 + 2 * 2.0 + 2.0
    assert clock.left_text(2) == "0:00:22 left"
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
    due.update(saving=1)                 # a save not yet timed: one update's time, never zero
    assert re.fullmatch(r"0:00:0[1-9] left", clock.left_text(10)), clock.left_text(10)


def test_the_time_left_holds_through_a_change_of_speed(monkeypatch):
    """A run of 200 updates logged every 5, validated every 50 (400 samples,
    15 s each), whose updates of 8 samples take 1 s, then ``slow`` s from
    update 100 on (the machine got busy): from the first tenth of the run on,
    the time left is within 25% of what really remained at every line but
    the 3 after the change, and from the third line after it on it is what
    remains at the new speed."""
    for slow, close in ((1.3, 0.25), (2.0, None)):
        said, ended = _run_with_a_change(monkeypatch, slow)
        if close is not None:
            off = {update: round(said[update] / (ended[200] - ended[update]) - 1, 3)
                   for update in said if 20 <= update < 200 and update not in (105, 110, 115)}
            assert all(abs(error) <= close for error in off.values()), (slow, off)
        for update in range(115, 200, 5):      # the new speed, followed
            validations = sum(1 for v in (150, 200) if v > update)
            assert abs(said[update] - ((200 - update) * slow + 15.0 * validations)) < 1e-6, \
                (slow, update, said[update])


def _run_with_a_change(monkeypatch, slow):
    """{update: the time left said at its line}, {update: when it ended} on a fake clock."""
    clock, now = clock_at(monkeypatch, planned=200)
    clock.window, clock.valid_samples, clock.batch = 10, 400, 8
    clock.due = lambda update: {"validation": sum(1 for v in (50, 100, 150, 200) if v > update)}
    said, ended = {}, {}
    for update in range(1, 201):
        now[0] += 1.0 if update <= 100 else slow
        clock.tick(update)
        if update % 5 == 0:
            said[update] = clock.left(update)
        if update % 50 == 0:
            now[0] += 15.0
            clock.paused("validation", 15.0, update)
        ended[update] = now[0]
    return said, ended


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


def test_the_status_shows_the_runs_own_words_for_the_time_left():
    view = status.clean({"update": 1, "planned": 60, "left": "measuring time left",
                         "left_s": None, "ranks": []})
    assert "update 1/60 | measuring time left |" in status.render(view, "tcp://h:1", now=0)[0]
    old = status.clean({"update": 40, "planned": 60, "left_s": 21, "ranks": []})
    assert "| 0:00:21 left |" in status.render(old, "tcp://h:1", now=0)[0]


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
    assert re.fullmatch(r"\d+:\d\d:\d\d left", second), second    # validation counted too
    assert ctx.board.views[0]["left_s"] is None
