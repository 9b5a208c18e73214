"""``--exchange allreduce``: the synchronous update with the gradients summed
by the mode itself, one explicit all-reduce of the flat gradients (in
--allreduce-chunks pieces), instead of DDP's inside backward. A test-only
mode: it proves a mode is added from outside hetseq/, through the public
seams only (exchange.Exchange's hooks, Updates, register_exchange).

Rank r holds g_r, the gradient of the SUM of its n_r sample losses (the
task returns sums), i.e. n_r times the gradient of its mean loss: summed,

    G = sum_r g_r = sum_r n_r grad(mean loss of rank r),

the ranks' mean gradients weighted by their sample counts. G arrives as a
sum, so the divisor is 1 and the Controller's step scales by 1/N: G/N is the
gradient of the mean loss over the global batch (controller.py), one
device's large-batch update. A rank without samples adds zeros.
"""

import torch
import torch.distributed as dist

from hetseq.base.errors import UserError
from hetseq.base.sections import Section, flag, section
from hetseq.update.exchange import Exchange, register_exchange
from hetseq.update.modes.local_steps import FlatParams
from hetseq.update.zero.sharding import Sharding


@section
class AllReduceConfig(Section):
    """Its flags, declared once: each field is its flag (hetseq/base/sections.py)."""
    allreduce_chunks: int = flag(1, type=int, metavar="K",
                                 help="--exchange allreduce: sum the flat gradients in K "
                                      "all-reduces (default: 1)")


class OwnReplicas(Sharding):
    """Whole replicas on every rank, nothing summed inside backward."""

    def describe(self):
        return "replicas, gradients summed by --exchange allreduce"


@register_exchange("allreduce")
class AllReduce(Exchange):
    Config = AllReduceConfig

    @classmethod
    def check_args(cls, args, defaults, chosen):
        super().check_args(args, defaults, chosen)     # its flag without the mode: refused
        if chosen and args.allreduce_chunks < 1:
            raise UserError(f"--allreduce-chunks {args.allreduce_chunks}: expected K >= 1")
        if chosen and args.zero:
            raise UserError(f"--exchange allreduce keeps whole replicas: --zero 0, not "
                            f"--zero {args.zero}")

    def __init__(self, cfg, precision_cfg, ctx, rewindable=False):
        super().__init__(cfg, precision_cfg, ctx, rewindable)
        self.divisor = 1               # G arrives summed, not averaged

    def train_under(self, zero):
        """The job's --zero 0 gives its settings only: nothing is summed in backward."""
        return OwnReplicas(zero.cfg, zero.precision, zero.ctx)

    def attach(self, updates):
        super().attach(updates)
        self.flat = FlatParams(updates.params)

    @torch.no_grad()
    def sum_gradients(self):
        if not self.ctx.distributed:
            return
        flats = [torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                            for p in group]) for group in self.flat.groups]
        for flat in flats:
            for chunk in flat.chunk(self.cfg.allreduce_chunks):
                dist.all_reduce(chunk)          # in place: a chunk is a view of ``flat``
        self.flat.set_grads(flats)
