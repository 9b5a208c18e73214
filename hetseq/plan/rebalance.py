"""Rebalancing while training: a new ``auto`` plan when, and only when, a
rank's speed has changed by more than the noise of its measurements.

Each update the stats all-reduce brings every rank's compute seconds and
samples of the previous update, so each rank's rate r_i = n_i / t_i.

- Level: the median of a rank's last ``window`` rates. One slow update (a
  garbage collection, a neighbour's job) does not move a median; a real change
  of speed moves it once it fills half the window.
- Noise: sigma_i from the median absolute difference of successive rates over
  the last ``history`` updates (divided by 0.954, its value for Gaussian
  noise). Differences of neighbours see a step change of speed only once, so a
  real slowdown does not inflate the noise that is meant to tell it apart.
  The median of k rates has a standard error of about 1.25 sigma / sqrt(k).
- Gain: the current plan's predicted update time (its slowest rank's
  b_i / r_i) over that of the best whole-sample split for the levels, minus 1.
- Replan when the gain exceeds both ``min_gain`` and ``z`` standard errors of
  the least certain rank's level (a relative error e in a rate moves the
  predicted update time by up to e), then hold ``window`` updates so that the
  next decision sees only rates measured under the new plan.
- A second, slow view: the median of every rate measured since the plan
  last changed (up to ``history``). Its error falls as 1/sqrt(k), so a small
  lasting imbalance (a start-up measurement 8% off) that the short levels
  cannot tell from noise is closed after a few dozen updates; alone, the
  short view would keep such a plan forever on a noisy machine.
- Then check the change: the measured update time (the slowest rank's
  compute) must have dropped by half the predicted gain, or the old plan
  comes back (see ``_judge_trial``).

The global batch never changes: any split gives the same update.
"""

import logging
import math
import statistics

from hetseq.plan.capacity import Plan, describe, proportional

logger = logging.getLogger(__name__)

_GAUSSIAN_MAD = 0.954     # median |x - y| / sigma for x, y independent N(0, sigma^2)


class Rebalancer:
    def __init__(self, plan, window=6, history=30, z=3.0, min_gain=0.02, hold=200,
                 patience=2):
        self.plan = plan
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
        return [statistics.median(sorted(s[-self.window:])[-(self.window // 2):])
                for s in self.series]     # window 6: the 2nd fastest; moves once 5 agree

    def noise(self, levels):
        """Relative standard error of each rank's level."""
        return [_standard_error(rates, min(len(rates), self.window)) / level
                for rates, level in zip(self.series, levels)]

    def _gain_noise(self):
        """Twice the 90th percentile of the gains predicted before the last
        ``window`` updates (from the second update on, while levels are still
        taken from fewer rates). Interference comes in bursts that make a rank look
        slow for several updates in a row, which the noise of single rates
        (``noise``) underrates; the gains seen while nothing lasting happened
        measure it directly. A real change predicts a gain far above them."""
        past = sorted(self.gains[:-self.window])
        return 2 * past[int(0.9 * (len(past) - 1))] if len(past) >= 3 else 0.0

    def observe(self, rank_times, rank_samples):
        """Feed one update's per-rank compute seconds and samples; returns a new
        Plan when the split should change, else None."""
        for series, t, n in zip(self.series, rank_times, rank_samples):
            if t > 0 and n > 0:
                series.append(n / t)
                del series[:-self.history]
        if max(rank_times) > 0:
            self.update_times = (self.update_times + [max(rank_times)])[-self.window:]
        self.since_change += 1
        self.blocked = (max(0, self.blocked[0] - 1), self.blocked[1])
        if any(len(s) < 2 for s in self.series):
            return None
        levels, new, gain = self._predict()
        if self.since_change < self.window or any(len(s) < self.window for s in self.series):
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
        """(the best plan for ``levels``, its predicted gain over the current one)."""
        new = proportional(self.plan.global_batch, levels, self.plan.micro_caps, levels)
        return new, _update_time(self.plan, levels) / _update_time(new, levels) - 1

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
        if any(_direction(self.plan, view[1]) != _direction(self.plan, views[0][1])
               or view[2] <= view[3] for view in views[1:]):
            return None
        levels, new, gain, threshold = views[0]
        threshold = max(threshold, *(view[3] for view in views[1:]))
        return levels, new, gain, threshold, (f"the noise of {k} updates' rates and of "
                                              f"each half, at least {100 * self.min_gain:g}%")

    def _view(self, series):
        """(levels, best plan, gain, threshold) from the medians of ``series``."""
        levels = [statistics.median(s) for s in series]
        new, gain = self._best(levels)
        error = max(_standard_error(s, len(s)) / level for s, level in zip(series, levels))
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
        if not sure or new.batch_sizes == self.plan.batch_sizes:
            return None
        self.ahead = 0
        self.trial = (self.plan, statistics.median(self.update_times), gain)
        self.reason = (f"rates {'/'.join(f'{r:.1f}' for r in levels)} samples/s, "
                       f"predicted {100 * gain:.1f}% faster (threshold {100 * threshold:.1f}%: "
                       f"{why})")
        return self.adopt(new)

    def _judge_trial(self):
        """Keep a change unless it made updates slower by more than half the
        gain it predicted (then it was wrong, not noise): undo it. A rank's rate is not quite independent of its share (a fixed
        cost per update makes a small share look slow), so a prediction can be
        wrong: the measured update time is the judge. After an undo, any change
        must promise twice the failed gain for ``hold`` updates (doubling with
        each failure)."""
        previous, before, gain = self.trial
        self.trial = None
        after = statistics.median(self.update_times)
        if after <= before * (1 + gain / 2):
            return None
        self.failures += 1
        self.blocked = (self.hold * 2 ** (self.failures - 1), 2 * gain)
        self.reason = (f"undoing the last change: updates took {1000 * after:.1f} ms of "
                       f"compute after it, {1000 * before:.1f} ms before (predicted "
                       f"{100 * gain:.1f}% faster)")
        return self.adopt(previous)

    def adopt(self, plan):
        """The plan in force from now on (its own choice, or a resumed one)."""
        self.plan, self.since_change = plan, 0
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


def _update_time(plan, rates):
    """Predicted compute seconds of an update: the slowest rank's share."""
    return max(b / r for b, r in zip(plan.batch_sizes, rates))


class Balance:
    """The plan in force: every rank's share of each global batch, applied to
    this rank's training iterator. With ``rebalancer`` (``--capacity auto``)
    it is re-planned while training from the per-rank compute times each
    update brings. A checkpoint component: the split is saved, and resumed
    when the global batch and the world are the same."""

    def __init__(self, plan, devices, iterator, ctx, lockstep, rebalancer=None):
        self.plan, self.devices, self.iterator = plan, devices, iterator
        self.ctx, self.lockstep, self.rebalancer = ctx, lockstep, rebalancer

    def micro_batches(self, shares):
        """Micro-batches every rank runs per step when forwards communicate
        (FSDP): the most any rank needs; 1 (no padding) otherwise."""
        return self.plan.most_micro_batches(shares) if self.lockstep else 1

    def observe(self, update, rank_times, rank_samples):
        """After update ``update``: the rebalancer's view of the rates."""
        new = self.rebalancer and self.rebalancer.observe(rank_times, rank_samples)
        if new:
            self.set_plan(new, self.rebalancer.reason, update)

    def set_plan(self, plan, reason, update):
        old, self.plan = self.plan, plan
        self.iterator.set_shares(plan.batch_sizes, self.micro_batches(plan.batch_sizes))
        if self.rebalancer is not None:
            self.rebalancer.adopt(plan)
        if self.ctx.is_main:
            logger.info("capacity plan changed at update %d: batches %s -> %s; %s", update,
                        "/".join(map(str, old.batch_sizes)), "/".join(map(str, plan.batch_sizes)),
                        reason)
            logger.debug("capacity plan:\n%s", describe(plan, self.devices))

    def state_dict(self):
        return self.plan.state_dict()

    def load_state_dict(self, state):
        """The saved split continues the run; a different world or batch starts
        afresh (the data position, loaded before, is kept in samples)."""
        saved, plan = Plan.from_state_dict(state), self.plan
        same_batch = saved.global_batch == plan.global_batch
        same_world = len(saved.batch_sizes) == len(plan.batch_sizes)
        if not (same_batch and same_world):
            self._log_resume(saved)
        elif saved.batch_sizes != plan.batch_sizes:
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
