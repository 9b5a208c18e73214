"""The synchronous update (the default): every update, the gradients are
summed over the ranks inside the --zero mode's backward (DDP's all-reduce
in --reduce-dtype, FSDP's reduce-scatter) and arrive divided by W; the
Controller scales them by W/N (controller.py's math), N the global batch."""

from hetseq.update import precision
from hetseq.update.exchange import Exchange, register_exchange
from hetseq.update.stats import StepResult


@register_exchange("synchronous")
class Synchronous(Exchange):
    """The gradient collectives run inside backward, the stats in their own
    all-reduce (stats.py)."""
    # A rank may sit out (update/members.py): its gradient collectives run
    # in the members' group, and nothing else of the mode spans the world.
    sits_out = True

    def comm_hook(self):
        hook = precision.ddp_comm_hook(self.precision)
        return (None, hook) if hook is not None else None

    def finish(self, stats, seconds, boundary):
        """The gradients are summed (inside backward): scale, clip, step."""
        totals, ranks = stats.result()
        updated, norm = self.updates.step(totals["sample_size"])
        self.record(seconds, stats.own_samples())
        return StepResult(totals, ranks, self.updates.lr, updated, norm)

    def sit(self, stats):
        """A rank that sits out: its zeros in the stats, the update as rank 0
        made it (``Controller.update_as_rank_0``)."""
        totals, ranks = stats.result()
        updated = self.updates.update_as_rank_0(totals["sample_size"])
        self.record(0.0, 0.0)
        return StepResult(totals, ranks, self.updates.lr, updated, None)
