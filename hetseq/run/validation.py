"""Validation: the task's metrics on each --valid-subset, exact across ranks.

Every rank evaluates its slice of each global batch; the summed stats travel
in one all-reduce per split (stats.py), so a metric equals what one process
computes on the whole split. Batches per rank are this node's
--max-sentences-valid when every node gives one, else the training split.
"""

import logging

from hetseq.distributed import all_gather_object
from hetseq.update.stats import StatsExchange

logger = logging.getLogger(__name__)


class Validation:
    """``splits``: the run's Splits; ``batch_size``: this node's
    --max-sentences-valid (None: each rank's training share); ``balance``:
    the plan in force (its micro-batch caps apply here too)."""

    def __init__(self, task, controller, splits, ctx, batch_size, balance):
        self.task, self.controller, self.splits, self.ctx = task, controller, splits, ctx
        self.batch_size, self.balance = batch_size, balance
        self.iterators = {}     # split -> its iterator, built on first use

    def run(self, split):
        """The task's metrics on ``split`` (a collective: every rank calls it)."""
        data = self._iterator(split)
        controller = self.controller
        # Start with the task's keys at zero (a rank may get no samples at all)
        # so every rank all-reduces a vector of the same layout.
        stats = StatsExchange(self.ctx)
        controller.valid_step(data.dummy_batch(), stats)
        stats.clear()
        for step in data.next_epoch_itr():
            for sample in step:
                if sample is not None:
                    controller.valid_step(sample, stats)
                elif controller.lockstep:   # its forward communicates: pad
                    controller.valid_step(data.dummy_batch(), stats, weight=0.0)
        totals, _ = stats.result()
        return self.task.reduce_metrics(totals)

    def _iterator(self, split):
        if split not in self.iterators:
            plan = self.balance.plan
            sizes = all_gather_object(self.batch_size, self.ctx)
            shares = plan.batch_sizes if None in sizes else sizes
            self.iterators[split] = self.splits.iterator(
                self.splits.load(split), shares, shuffle=False,
                micro_cap=plan.micro_caps[self.ctx.rank],
                min_micro_batches=self.balance.micro_batches(shares))
        return self.iterators[split]
