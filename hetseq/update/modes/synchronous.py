"""The synchronous update (the default): every update, the gradients are
summed over the ranks inside the --zero mode's backward (DDP's all-reduce
in --reduce-dtype, FSDP's reduce-scatter) and arrive divided by W; the
Controller scales them by W/N (controller.py's math), N the global batch.
Every hook but the DDP one is the base's (update/exchange.py)."""

from hetseq.update import precision
from hetseq.update.exchange import Exchange, register_exchange


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
