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
