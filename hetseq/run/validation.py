"""Validation: the task's metrics on each --valid-subset, exact across ranks.

Every rank evaluates its slice of each global batch; the summed stats travel
in one all-reduce per split (stats.py), so a metric equals what one process
computes on the whole split. Batches per rank are this node's
--max-sentences-valid when every node gives one, else the training split.
A rank that sits out (update/members.py) holds an old model: it takes no
samples and sends zeros.
"""

import logging

from hetseq.distributed import all_gather_object
from hetseq.update.stats import StatsSum

logger = logging.getLogger(__name__)


class Validation:
    """``splits``: the run's Splits; ``batch_size``: this node's
    --max-sentences-valid (None: each rank's training share); ``balance``:
    the plan in force (its micro-batch caps apply here too)."""

    def __init__(self, task, controller, splits, ctx, batch_size, balance):
        self.task, self.controller, self.splits, self.ctx = task, controller, splits, ctx
        self.batch_size, self.balance = batch_size, balance
        self.iterators = {}     # (split, ranks sitting out) -> its iterator, built on first use
        self.layouts = {}       # split -> its stats' keys (StatsSum.layout)

    def run(self, split):
        """The task's metrics on ``split`` (a collective: every rank calls it)."""
        data = self._iterator(split)
        controller = self.controller
        # Start with the task's keys at zero (a rank may get no samples at all)
        # so every rank all-reduces a vector of the same layout: learnt from
        # one forward at the split's first validation.
        stats = StatsSum(self.ctx)
        if split not in self.layouts:
            controller.valid_step(data.dummy_batch(), stats)
            self.layouts[split] = stats.layout()
        stats.add_zeros(self.layouts[split])
        stats.clear()
        for step in data.next_epoch_itr():
            for sample in step:
                if sample is not None:
                    controller.valid_step(sample, stats)
                elif controller.lockstep:   # its forward communicates: pad
                    controller.valid_step(data.dummy_batch(), stats, weight=0.0)
        totals, _ = stats.result()
        return self.task.reduce_metrics(totals)

    def size(self, split):
        """The samples of ``split`` (a collective the first time: every rank calls it)."""
        return self._iterator(split).dataset_size

    def _iterator(self, split):
        plan = self.balance.plan
        key = (split, tuple(plan.sitting))
        if key not in self.iterators:
            sizes = all_gather_object(self.batch_size, self.ctx)
            shares = plan.batch_sizes if None in sizes else \
                [0 if rank in plan.sitting else size for rank, size in enumerate(sizes)]
            self.iterators[key] = self.splits.iterator(
                self.splits.load(split), shares, shuffle=False,
                micro_cap=plan.micro_caps[self.ctx.rank],
                min_micro_batches=self.balance.micro_batches(shares))
        return self.iterators[key]
