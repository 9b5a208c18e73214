"""Exchange modes are plugins (update/exchange.py, update/modes/): a mode
defined under tests/ (tests/modes/allreduce.py, ``--user-dir tests/modes``),
with no edit under hetseq/, trains exactly as one process does; a name
registered twice, or an unknown --exchange, is a clear error."""

import pytest

from hetseq.app import cli
from hetseq.base.errors import UserError

from machinery.settings import ROOT, TOY

from machinery.parity import COMMON
# The last --user-dir wins: tests/modes brings the toy task along.
MODE = ["--user-dir", str(ROOT / "tests" / "modes"), "--exchange", "allreduce"]


def job(layout, *extra):
    return [[*COMMON, *MODE, *extra, "--max-sentences", batch, "--no-save"] for batch in layout]


def test_nothing_under_hetseq_names_the_mode():
    library = "\n".join(path.read_text() for path in (ROOT / "hetseq").rglob("*.py"))
    assert "allreduce_chunks" not in library and "tests/modes" not in library


def test_the_modes_flags_are_the_jobs_and_refused_without_it():
    _, job, _ = cli.parse([*TOY, *MODE, "--allreduce-chunks", "3"])
    assert job.exchange.exchange == "allreduce"
    assert job.identity()["allreduce_chunks"] == 3 and job.identity()["exchange"] == "allreduce"
    with pytest.raises(UserError, match="--allreduce-chunks set exchange mode 'allreduce'; "
                                        "add --exchange allreduce"):
        cli.parse([*TOY, *MODE[:2], "--allreduce-chunks", "3"])


def test_a_name_registered_twice_or_unknown_says_what_exists(monkeypatch):
    from hetseq.update.exchange import EXCHANGES, Exchange, register_exchange
    # A copy of the registry for this test: the process's stays as it was.
    monkeypatch.setattr(EXCHANGES, "_entries", dict(EXCHANGES._entries))
    monkeypatch.setattr(EXCHANGES, "_aliases", dict(EXCHANGES._aliases))
    with pytest.raises(ValueError, match=r"exchange mode name 'local-steps' is already "
                       r"registered by hetseq\.update\.modes\.local_steps\.LocalSteps; pick "
                       r"another name \(registered exchange modes: .*local-steps, powersgd, "
                       r"synchronous\)"):
        register_exchange("local-steps")(type("Again", (Exchange,), {}))
    with pytest.raises(UserError, match=r"unknown exchange mode 'nope'; registered exchange "
                       r"modes: .*local-steps, powersgd, synchronous \(a mode of your own"):
        cli.parse([*TOY, "--exchange", "nope"])


def test_the_identity_holds_the_chosen_modes_flags_only():
    """Flags of a mode the job does not run are at their defaults (refused
    otherwise): left out of the identity, a node whose --user-dir registers
    one more mode meets a node without it."""
    cli.parse([*TOY, *MODE])                           # allreduce is registered now
    _, job, _ = cli.parse([*TOY, "--user-dir", str(ROOT / "tests" / "modes")])
    identity = job.identity()
    assert identity["exchange"] == "synchronous"
    assert "allreduce_chunks" not in identity and "local_steps" not in identity


def test_one_mode_is_one_identity_however_it_is_asked_for():
    _, asked, _ = cli.parse([*TOY, "--grad-compression", "powersgd"])
    _, named, _ = cli.parse([*TOY, "--exchange", "powersgd", "--grad-compression", "powersgd"])
    assert asked.identity() == named.identity()
    assert named.identity()["grad_compression"] == "powersgd"
    for contradiction in ([], ["--grad-compression", "none"]):
        with pytest.raises(UserError, match="--exchange powersgd compresses with "
                                            "--grad-compression powersgd, not"):
            cli.parse([*TOY, "--exchange", "powersgd", *contradiction])


def test_a_mode_cannot_forget_its_figures_finish_is_a_template_that_records_them():
    """Rebalancing reads each rank's figures of the update that ended: the
    base's finish records them whatever the mode's ``end`` hook returns, and
    a mode that overrides finish (or begin) cannot be written."""
    from types import SimpleNamespace
    from hetseq.update.exchange import Exchange
    from hetseq.update.stats import RankReport, StatsSum, StepResult

    for template in ("finish", "begin"):
        with pytest.raises(TypeError, match=f"overrides {template}, a template"):
            type("Forgetful", (Exchange,), {template: lambda self, *args: None})

    class Rounds(Exchange):             # a result every second update, as a round of two
        registered_name = "rounds"
        calls = 0

        def end(self, stats, made, norm, boundary):
            self.calls += 1
            return StepResult({}, None, 0.1, made) if self.calls % 2 == 0 else None

    ctx = SimpleNamespace(world_size=1, distributed=False, rank=0)
    mode = Rounds(None, None, ctx)

    def update(samples, seconds):
        stats = mode.begin(0.0, 0.0)
        stats.add(0.0, samples, {})
        return stats, mode.finish(stats, True, None, seconds, False)

    stats, result = update(8, 0.5)
    assert result is None and stats.report == RankReport()      # nothing ended yet
    stats, result = update(4, 0.25)
    assert result.updated
    stats, _ = update(2, 1.0)                                   # the round's figures ride next
    assert (stats.report.seconds, stats.report.samples) == (0.75, 12)
    assert isinstance(stats, StatsSum)


def test_a_rounds_wall_time_ends_before_its_exchange(monkeypatch):
    """Rank 0's wall seconds feed the rebalancer: a round's run from the end
    of the last one to its own end, taken before the mode's end hook makes
    the round's exchange (which the next round's wall then holds)."""
    import time
    from types import SimpleNamespace
    from hetseq.update.exchange import Exchange
    from hetseq.update.stats import StepResult

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class Slow(Exchange):               # every update ends; the first one's exchange takes 5 s
        registered_name = "slow"
        exchanges = [5.0]

        def end(self, stats, made, norm, boundary):
            clock[0] += self.exchanges.pop() if self.exchanges else 0.0
            return StepResult({}, None, 0.1, made)

    mode = Slow(None, None, SimpleNamespace(world_size=1, distributed=False, rank=0))
    walls = []
    for _ in range(3):
        clock[0] += 1.0                 # the update's compute
        stats = mode.begin(0.0, 0.0)
        walls.append(stats.report.wall)
        stats.add(0.0, 1, {})
        mode.finish(stats, True, None, 1.0, False)
    # The first has none; the second holds its compute and the first's exchange.
    assert walls == [0.0, 0.0, 6.0]