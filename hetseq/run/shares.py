"""A run's state shares (--state-shares, plan/state_shares.py): chosen by
all ranks before the model is wrapped, from each rank's memory less what
every rank holds whole, then once more after the capacity plan, less each
rank's activations at its planned micro-batch, which only the wrapped
model can measure. The second choice moves the state (update/zero/uneven.py)
only where it changes a share by more than ``MOVE``, before the first update.

Under --capacity auto the micro-batches are themselves sized from what the
shares leave (startup.py): the activations then take the rest of each
rank's memory, and the shares stay the first ones.
"""

import dataclasses

from hetseq.distributed import all_gather_object
from hetseq.base.errors import UserError
from hetseq.optim import OPTIMIZERS
from hetseq.plan import startup, state_shares
from hetseq.update.exchange import EXCHANGES

MOVE = 0.005        # a change of share worth moving the state for


class StateSharing:
    """``fractions``: every rank's share of the split state by memory, or
    None for even shares (torch's engines). A collective, as ``again``."""

    def __init__(self, job, node, ctx, model):
        self.ctx, self.capacity = ctx, job.capacity.capacity
        cfg = _allowed(job)
        slots = OPTIMIZERS.get(job.optimizer.optimizer).state_slots(job.optimizer)
        # One process holds everything (sharding.build), but a GPU's state on the host.
        alone = not ctx.distributed and not (cfg.cpu_offload and ctx.device.type == "cuda")
        self.size = state_shares.state_size(0 if alone else cfg.zero, cfg.cpu_offload,
                                            ctx.device.type, model, slots)
        self.memory = state_shares.memory_bytes(node.shares, ctx, ctx.local_world_size)
        self.given = node.shares.max_memory_gb is not None
        shares = state_shares.agree(cfg, self.memory, self.size, ctx, given=self.given)
        self.fractions = shares.fractions if shares.kind == "memory" else None
        # The second choice keeps the first one's kind (auto decided it).
        self.cfg = dataclasses.replace(cfg, state_shares="memory")

    def again(self, controller, plan, dataset, collate_fn):
        """After the plan: the shares less each rank's activations at its
        micro-batch, moved where they changed. Returns whether they moved."""
        if self.fractions is None or self.capacity == "auto":
            return False
        rank = self.ctx.rank
        batch, cap = plan.batch_sizes[rank], plan.micro_caps[rank]
        activation = startup.activation_bytes(controller, dataset, collate_fn,
                                              min(batch, cap) if cap else batch)
        shares = state_shares.agree(self.cfg, self.memory, self.size, self.ctx,
                                    given=self.given, activation=activation)
        if max(abs(a - b) for a, b in zip(shares.fractions, self.fractions)) <= MOVE:
            return False
        self.fractions = shares.fractions
        controller.reshare(self.fractions)
        return True


def _allowed(job):
    """The ShardingConfig with the shares this job can take: the exchange
    modes that keep even shares, and --compile under --zero 2/3 (the units'
    hooks split its graph), take even shares under auto."""
    cfg = job.sharding
    reasons = [why for why, holds in (
        (f"--exchange {job.exchange.exchange} keeps even shares",
         not EXCHANGES.get(job.exchange.exchange).shares_by_memory),
        ("--compile traces whole forwards, which --zero 2/3 by memory splits unit by unit",
         cfg.compile and cfg.zero >= 2)) if holds]
    if reasons and cfg.state_shares == "memory":
        raise UserError(f"--state-shares memory: {reasons[0]}; use --state-shares even")
    return dataclasses.replace(cfg, state_shares="even") if reasons else cfg


def held_bytes(controller, ctx):
    """Every rank's count of the model state it holds (a collective)."""
    return all_gather_object(controller.state_bytes(), ctx)
