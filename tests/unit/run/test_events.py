"""The run's events (hetseq/run/events.py): one answer for what follows an
update, asked before it (--local-steps ends its round there) and after it
(the loop validates, saves or stops)."""

from types import SimpleNamespace

from hetseq.run.events import After, Events


def events(validate=0, save=0, max_update=0, disabled=False):
    return Events(SimpleNamespace(validate_interval_updates=validate, max_update=max_update,
                                  disable_validation=disabled),
                  SimpleNamespace(save_interval_updates=save))


def test_what_follows_each_update_comes_from_the_intervals_and_the_end():
    plan = events(validate=3, save=4, max_update=10)
    seen = {n: plan.after(n) for n in range(0, 13)}
    assert [n for n, a in seen.items() if a.validates] == [3, 6, 9, 12]
    assert [n for n, a in seen.items() if a.saves] == [4, 8, 12]
    assert [n for n, a in seen.items() if a.ends] == [10, 11, 12]
    assert [n for n, a in seen.items() if a] == [3, 4, 6, 8, 9, 10, 11, 12]
    assert not seen[0]       # a skipped first update leaves the count at 0: nothing is due


def test_no_interval_means_never_and_disabled_validation_never_validates():
    assert not any(events().after(n) for n in range(50))
    assert not any(events(validate=2, disabled=True).after(n).validates for n in range(50))
    assert After(saves=True) and not After()


def epochs(validate=1, save=1, disabled=False, max_epoch=0, max_update=0, min_lr=0.0):
    return Events(SimpleNamespace(validate_interval=validate, disable_validation=disabled,
                                  max_epoch=max_epoch, max_update=max_update),
                  SimpleNamespace(save_interval=save), SimpleNamespace(min_lr=min_lr))


def test_an_epochs_end_and_the_stop_come_from_the_same_schedule():
    """--validate-interval and --save-interval count epochs; the stop always
    validates and saves; an update that ends no epoch adds nothing here."""
    plan = epochs(validate=2, save=3)
    assert [e for e in range(1, 10) if plan.at_epoch_end(e).validates] == [2, 4, 6, 8]
    assert [e for e in range(1, 10) if plan.at_epoch_end(e).saves] == [3, 6, 9]
    assert not plan.at_epoch_end(None)
    stop = plan.at_epoch_end(None, stopping=True)
    assert stop.validates and stop.saves and stop.ends
    assert not epochs(disabled=True).at_epoch_end(1, stopping=True).validates


def test_the_run_stops_at_its_epoch_its_update_or_its_learning_rate():
    plan = epochs(max_epoch=2, max_update=10, min_lr=1e-5)
    assert plan.stop_reason(2, 9, 0.1) is None
    assert plan.stop_reason(3, 9, 0.1) == "reached --max-epoch 2"
    assert plan.stop_reason(2, 10, 0.1) == "reached --max-update 10"
    assert plan.stop_reason(2, 9, 1e-5) == "learning rate 1e-05 reached --min-lr 1e-05"
    assert epochs().stop_reason(100, 10 ** 6, 0.0) == "learning rate 0 reached --min-lr 0"
