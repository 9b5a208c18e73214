"""Rebalancing while training: a new ``auto`` plan when, and only when, a
rank's speed has changed by more than the noise of its measurements, so the
split follows real changes of speed and not a neighbour's burst; a change
that did not pay is undone. Under a plan the user fixed it only advises.
docs/capacity.md gives the rules in numbers and what they did on real runs.
"""

import dataclasses
import logging
import math
import statistics

from hetseq.plan import links as exchange_links
from hetseq.plan.capacity import Plan, describe

logger = logging.getLogger(__name__)

_GAUSSIAN_MAD = 0.954     # median |x - y| / sigma for x, y independent N(0, sigma^2)


class Rebalancer:
    """``links``: the exchange's costs (links.py; None: not counted);
    ``can_sit``: ranks may sit out; ``per_update``: updates one exchange
    serves (--local-steps H); ``advisory``: the plan is the user's, only
    advice comes back (once)."""

    def __init__(self, plan, links=None, can_sit=False, per_update=1, advisory=False,
                 window=6, history=30, z=3.0, min_gain=0.02, hold=200, patience=2):
        self.plan = plan
        self.links, self.can_sit, self.per_update = links, can_sit, per_update
        self.advisory, self.advised = advisory, False
        self.overheads, self.excess = [], 0.0   # measured beyond the modelled exchange (_overhead)
        self.window, self.history, self.z, self.min_gain = window, history, z, min_gain
        self.patience = patience         # decisions in a row that must agree
        self.ahead = 0                   # decisions in a row so far
        self.hold = hold                 # updates a failed change blocks its like (doubling)
        self.series = [[] for _ in plan.batch_sizes]     # per rank: recent rates, oldest first
        self.update_times = []           # measured compute seconds of the slowest rank
        self.gains = []                  # the predicted gain at each decision, oldest first
        self.since_change = 0
        self.trial = None                # (previous plan, its update time, predicted gain)
        self.blocked = (0, 0.0)          # (updates left, gain a change must beat meanwhile)
        self.failures = 0
        self.reason = None               # why the last plan change was made (for the log)

    def levels(self):
        """Each rank's rate: the median of the faster half of its last
        ``window`` rates. A device does not get faster by accident: slow
        updates are interference (another process, the collectives' threads
        on a busy CPU) and come in bursts; a burst shorter than half the window
        leaves the level alone, a lasting change moves it."""
        return self._known([statistics.median(sorted(s[-self.window:])[-(self.window // 2):])
                            if s else 0.0 for s in self.series])   # window 6: the 2nd fastest

    def _known(self, levels):
        """``levels`` with a sitting rank's (or one never measured: no samples
        yet) replaced by the last one known, the plan's (0: unknown)."""
        return [self.plan.rates[rank] if rank in self.plan.sitting or not level else level
                for rank, level in enumerate(levels)]

    def _members(self):
        return [rank for rank in range(len(self.series)) if rank not in self.plan.sitting]

    def noise(self, levels):
        """Relative standard error of each member's level (0 for the others)."""
        return [_standard_error(self.series[rank], min(len(self.series[rank]), self.window)) /
                levels[rank] if rank in self._members() and self.series[rank] else 0.0
                for rank in range(len(levels))]

    def _gain_noise(self):
        """Twice the 90th percentile of the gains predicted before the last
        ``window`` updates (from the second update on, while levels are still
        taken from fewer rates). Interference comes in bursts that make a rank look
        slow for several updates in a row, which the noise of single rates
        (``noise``) underrates; the gains seen while nothing lasting happened
        measure it directly. A real change predicts a gain far above them."""
        past = sorted(self.gains[:-self.window])
        return 2 * past[int(0.9 * (len(past) - 1))] if len(past) >= 3 else 0.0

    def observe(self, rank_times, rank_samples, walls=None):
        """Feed one update's per-rank compute seconds, samples and wall
        seconds (rank 0's is the job's); returns a new Plan when the split
        should change, else None."""
        for series, t, n in zip(self.series, rank_times, rank_samples):
            if t > 0 and n > 0:
                series.append(n / t)
                del series[:-self.history]
        wall = walls[0] if walls else 0.0
        if wall > 0 or max(rank_times) > 0:
            self.update_times = (self.update_times + [wall or max(rank_times)])[-self.window:]
        if wall > 0 and max(rank_times) > 0:
            self._overhead(wall - max(rank_times))
        self.since_change += 1
        self.blocked = (max(0, self.blocked[0] - 1), self.blocked[1])
        members = [self.series[rank] for rank in self._members() if self.plan.batch_sizes[rank]]
        if any(len(s) < 2 for s in members) or self.advised:
            return None
        levels, new, gain = self._predict()
        if new is None:      # a rate not known (a rank the user left without samples)
            return None
        if self.since_change < self.window or any(len(s) < self.window for s in members):
            self.gains = (self.gains + [gain])[-self.history:]
            return None
        if self.trial is not None:
            return self._judge_trial()
        return self._consider(levels, new, gain)

    def _predict(self):
        """(levels, the best plan for them, its predicted gain over the current one)."""
        levels = self.levels()
        return (levels, *self._best(levels))

    def _best(self, levels):
        """(the best plan for ``levels``, its predicted gain over the current
        one); (None, 0) while a rate is not known."""
        if levels[0] <= 0:
            return None, 0.0
        new = exchange_links.best_plan(self.plan.global_batch, levels, self.plan.micro_caps,
                                       self.links, self.can_sit or self.advisory,
                                       self.per_update, self.excess).plan
        return new, self._seconds(self.plan, levels) / self._seconds(new, levels) - 1

    def _seconds(self, plan, rates):
        """Predicted seconds of an update under ``plan``: compute, exchange,
        and with other members the overhead measured beyond the exchange."""
        members = [rank for rank in range(len(rates)) if rank not in plan.sitting]
        return sum(exchange_links.update_seconds(plan.batch_sizes, rates, members, self.links,
                                                 self.per_update)) + \
            (self.excess if len(members) > 1 else 0.0)

    def _overhead(self, seconds):
        """An update's wall time beyond its slowest rank's compute, under a
        plan of several members: what the links' model leaves out of an
        exchange (waiting on each other, the collectives' own work, a busy
        host) is measured, and counted in every prediction with several
        members. Kept while ranks sit out: no update shows it then."""
        members = [rank for rank in range(len(self.series)) if rank not in self.plan.sitting]
        if len(members) < 2 or self.links is None:
            return
        self.overheads = (self.overheads + [seconds])[-self.window:]
        if len(self.overheads) >= self.window // 2:
            modelled = self.links.seconds(members) / self.per_update
            self.excess = max(0.0, statistics.median(self.overheads) - modelled)

    def _blocking(self):
        return self.blocked[1] if self.blocked[0] else 0.0

    def _long_view(self):
        """(levels, best plan, gain, threshold, what) from the median of every
        rate measured under the current plan, or None while there are fewer
        than 4 x ``window`` of them (the first two updates after a change may
        still report the old plan's rates). Interference on a shared machine
        wanders for tens of updates, which the standard error of i.i.d. rates
        underrates: each half of the span must show the gain on its own,
        moving the same ranks the same way."""
        k = min(self.since_change - 2, self.history) // 2 * 2
        if k < 4 * self.window:
            return None
        spans = [[s[-k:] for s in self.series], [s[-k:-k // 2] for s in self.series],
                 [s[-k // 2:] for s in self.series]]
        views = [self._view(span) for span in spans]
        if any(view[1] is None for view in views):
            return None
        if any(_direction(self.plan, view[1]) != _direction(self.plan, views[0][1])
               or view[2] <= view[3] for view in views[1:]):
            return None
        levels, new, gain, threshold = views[0]
        threshold = max(threshold, *(view[3] for view in views[1:]))
        return levels, new, gain, threshold, (f"the noise of {k} updates' rates and of "
                                              f"each half, at least {100 * self.min_gain:g}%")

    def _view(self, series):
        """(levels, best plan, gain, threshold) from the medians of ``series``."""
        members = self._members()
        levels = self._known([statistics.median(s) if s and rank in members else 0.0
                              for rank, s in enumerate(series)])
        new, gain = self._best(levels)
        error = max(_standard_error(series[rank], len(series[rank])) / levels[rank]
                    for rank in members if series[rank])
        return levels, new, gain, max(self.min_gain, self.z * error, self._blocking())

    def _consider(self, levels, new, gain):
        threshold = max(self.min_gain, self.z * max(self.noise(levels)), self._gain_noise(),
                        self._blocking())
        self.gains = (self.gains + [gain])[-self.history:]
        short = (levels, new, gain, threshold, "the noise of the rates and of past "
                                               f"predictions, at least {100 * self.min_gain:g}%")
        views = [short, self._long_view()]
        chosen = next((view for view in views if view and view[2] > view[3]), None)
        # Two decisions in a row must agree, unless the gain is twice the bar.
        self.ahead = self.ahead + 1 if chosen else 0
        if chosen is None:
            return None
        levels, new, gain, threshold, why = chosen
        sure = self.ahead >= self.patience or gain > 2 * threshold
        same = (new.batch_sizes, new.sitting) == (self.plan.batch_sizes, self.plan.sitting)
        if not sure or same:
            return None
        self.ahead = 0
        overhead = f", {1000 * self.excess:.1f} ms a step measured beyond the exchange" \
            if self.excess else ""
        self.reason = (f"rates {'/'.join(f'{r:.1f}' for r in levels)} samples/s{overhead}, "
                       f"predicted {100 * gain:.1f}% faster (threshold {100 * threshold:.1f}%: "
                       f"{why})")
        if self.advisory:      # the user's plan stays; advice about leaving a rank out, once
            unknown = {rank for rank, level in enumerate(levels) if level <= 0}
            self.advised = bool(set(new.sitting) - set(self.plan.sitting) - unknown)
            return new if self.advised else None
        self.trial = (self.plan, statistics.median(self.update_times), gain)
        return self.adopt(new)

    def _judge_trial(self):
        """Keep a change unless it made updates slower by more than half the
        gain it predicted (then it was wrong, not noise): undo it. A rank's
        rate is not quite independent of its share (a fixed cost per update
        makes a small share look slow), so a prediction can be wrong: the
        measured update time is the judge. After an undo, any change must
        promise twice the failed gain for ``hold`` updates (doubling with
        each failure)."""
        previous, before, gain = self.trial
        self.trial = None
        after = statistics.median(self.update_times)
        if after <= before * (1 + gain / 2):
            return None
        self.failures += 1
        self.blocked = (self.hold * 2 ** (self.failures - 1), 2 * gain)
        self.reason = (f"undoing the last change: updates took {1000 * after:.1f} ms "
                       f"after it, {1000 * before:.1f} ms before (predicted "
                       f"{100 * gain:.1f}% faster)")
        return self.adopt(previous)

    def adopt(self, plan):
        """The plan in force from now on (its own choice, or a resumed one)."""
        self.plan, self.since_change, self.overheads = plan, 0, []
        return plan


def _standard_error(rates, k):
    """Standard error of the median of ``k`` of these rates: 1.25 sigma /
    sqrt(k), sigma from the median absolute difference of successive rates."""
    steps = [abs(b - a) for a, b in zip(rates, rates[1:])]
    sigma = statistics.median(steps) / _GAUSSIAN_MAD if steps else math.inf
    return 1.25 * sigma / math.sqrt(k)


def _direction(plan, new):
    """Which ranks a new plan gives more (1) or fewer (-1) samples."""
    return [(b > a) - (b < a) for a, b in zip(plan.batch_sizes, new.batch_sizes)]


class Balance:
    """The plan in force: every rank's share of each global batch, applied to
    this rank's training iterator, and who takes part in the exchange
    (``members``: the Controller's set_members, called after the first
    update and after each that changes them). With ``rebalancer`` it is re-planned (or,
    advisory, advised on) while training from the per-rank compute times
    each update brings. A checkpoint component: the split is saved, and
    resumed when the global batch and the world are the same."""

    def __init__(self, plan, devices, iterator, ctx, lockstep, rebalancer=None,
                 members=lambda active: None, can_sit=False):
        self.plan, self.devices, self.iterator = plan, devices, iterator
        self.ctx, self.lockstep, self.rebalancer = ctx, lockstep, rebalancer
        self.members, self.can_sit = members, can_sit
        self._told = None       # the members last handed to ``members``

    def micro_batches(self, shares):
        """Micro-batches every rank runs per step when forwards communicate
        (FSDP): the most any rank needs; 1 (no padding) otherwise."""
        return self.plan.most_micro_batches(shares) if self.lockstep else 1

    def observe(self, update, rank_times, rank_samples, walls=None):
        """After update ``update``: the rebalancer's view of the rates, then
        the plan's members take (or leave) their places in the exchange: a
        plan's first update, its sitting ranks still run one (so that the
        stats' layout is known on every rank)."""
        new = self.rebalancer and self.rebalancer.observe(rank_times, rank_samples, walls)
        if new and self.rebalancer.advisory:
            self._advise(new)
        elif new:
            self.set_plan(new, self.rebalancer.reason, update)
            if self.rebalancer.links is not None:    # the links again, under the new plan
                self.rebalancer.links = exchange_links.measure(
                    self.ctx, self.rebalancer.links.gradient_bytes)
        members = tuple(rank for rank in range(len(self.plan.batch_sizes))
                        if rank not in self.plan.sitting)
        if members != self._told:       # the members change after this update
            self._told = members
            self.members(members)

    def _advise(self, better):
        if self.ctx.is_main:
            how = "--capacity auto lets such a rank sit out" if self.rebalancer.can_sit else \
                "leave it out of the job: this --zero mode and exchange keep every rank in it"
            logger.warning("the job would be faster without rank(s) %s (%s); the plan is the "
                           "one you fixed (--capacity manual or weights), so it stays: %s",
                           ", ".join(str(r) for r in better.sitting if r not in self.plan.sitting),
                           self.rebalancer.reason, how)

    def set_plan(self, plan, reason, update):
        old, self.plan = self.plan, plan
        self.iterator.set_shares(plan.batch_sizes, self.micro_batches(plan.batch_sizes))
        if self.rebalancer is not None:
            self.rebalancer.adopt(plan)
        if self.ctx.is_main:
            logger.info("capacity plan changed at update %d: batches %s -> %s; %s", update,
                        "/".join(map(str, old.batch_sizes)), "/".join(map(str, plan.batch_sizes)),
                        reason)
            if plan.sitting != old.sitting:
                links = self.rebalancer.links if self.rebalancer is not None else None
                per_update = self.rebalancer.per_update if self.rebalancer is not None else 1
                for line in exchange_links.why_sitting(plan, links, self.devices, per_update) \
                        or ["every rank takes part in the exchange again"]:
                    logger.info("%s", line)
            logger.debug("capacity plan:\n%s", describe(plan, self.devices))

    def state_dict(self):
        return self.plan.state_dict()

    def state_kind(self):
        return Plan.state_kind()

    def load_state_dict(self, state):
        """The saved split continues the run; a different world or batch starts
        afresh (the data position, loaded before, is kept in samples)."""
        saved, plan = Plan.from_state_dict(state), self.plan
        same_batch = saved.global_batch == plan.global_batch
        same_world = len(saved.batch_sizes) == len(plan.batch_sizes)
        # Ranks sat out: only where this run's mode lets them (else they take
        # part without samples), and never rank 0 or a rank with samples.
        if not self.can_sit:
            saved = dataclasses.replace(saved, sitting=[])
        sound = all(rank and not saved.batch_sizes[rank] for rank in saved.sitting) \
            if same_world else True
        if not (same_batch and same_world and sound):
            self._log_resume(saved)
        elif (saved.batch_sizes, saved.sitting) != (plan.batch_sizes, plan.sitting):
            self.set_plan(saved, "the split saved in the checkpoint", 0)

    def _log_resume(self, saved):
        data, plan = self.iterator, self.plan
        resumed = data.epoch > 1 or data.samples_in_epoch   # not --reset-dataloader
        if self.ctx.is_main and resumed:
            logger.info("resuming epoch %d at sample %d of %d with a global batch of %d on %d "
                        "ranks (saved: %d on %d ranks): the epoch goes on from that sample, "
                        "none repeated or skipped", data.epoch, data.samples_in_epoch,
                        data.dataset_size, plan.global_batch, len(plan.batch_sizes),
                        saved.global_batch, len(saved.batch_sizes))
