"""The Controller: model wrapping, optimizer, LR schedule and the gradient math.

Gradient math (why the update equals large-batch single-device training)
-----------------------------------------------------------------------
Rank r processes n_r samples and its task returns the SUM of their losses,
so after backward rank r holds g_r = grad( sum_{s in r} l_s ). Every sharding
mode (sharding.py) then leaves, on each rank, (its shard of) G/W with
G = sum_r g_r: DDP all-reduces and averages, FSDP reduce-scatters and
averages. The counts travel in the stats all-reduce (stats.py). We scale by W/N:

    (G/W) * (W/N) = (1/N) * sum_r g_r = grad( (1/N) * sum_s l_s ),   N = sum_r n_r,

which is exactly the gradient of the mean loss over the global batch, as if
one device had processed all N samples. Plain DDP instead averages per-rank
MEAN gradients with equal weights, (1/W) * sum_r g_r / n_r, which equals G/N
only when every n_r is the same: wrong whenever ranks take different batches.
Micro-batches accumulate into the same sums, so --update-freq and local
accumulation change nothing in this formula. With fp16 the loss was
multiplied by the loss scale S, so the factor becomes W / (N * S): one pass.

The norm for --clip-norm is the norm of the whole gradient: with sharded
gradients each rank sums the squares of its shard and one all-reduce adds
them; an overflow flag found in one shard is summed the same way, so every
rank skips the same updates.

DDP's built-in averaging, rather than a SUM communication hook, keeps the
all-reduce in C++: a Python hook costs 3-5% of a small model's step.
"""

import logging
import math
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from hetseq import agreement, precision, sharding
from hetseq.errors import TrainingFailed, UserError
from hetseq.optim import OPTIMIZERS, build_lr_scheduler, build_optimizer
from hetseq.stats import Backward, StatsExchange
from hetseq.utils import move_to

logger = logging.getLogger(__name__)


def _scale_and_check(grads, scale, device):
    """Multiply every gradient by ``scale``; returns a 1-element tensor, nonzero
    if any was NaN or inf. One fused pass: the kernel GradScaler unscales with.
    It takes the factor in float32, a relative rounding of at most 6e-8,
    exact for powers of two."""
    found = torch.zeros(1, device=grads[0].device if grads else device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, torch.full((1,), scale, device=found.device))
    return found


class Controller:
    def __init__(self, args, task, model, ctx):
        self.args = args
        self.task = task
        self.ctx = ctx
        self.sharding = sharding.build(args, ctx)
        # FSDP moves each shard to the device itself: the whole model never
        # has to fit there (with --cpu-offload the shards stay on the host).
        self.model = model if self.sharding.shards_grads else model.to(ctx.device)
        self.wrapped = self.sharding.wrap(self.model)
        hook = precision.ddp_comm_hook(args)
        if hook is not None and isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.register_comm_hook(None, hook)
        self._grad_divisor = ctx.world_size if ctx.distributed else 1  # every mode averages
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise UserError(f"the model built by task '{args.task}' has no trainable parameters")
        self.optimizer = self.sharding.build_optimizer(build_optimizer(args, self.params))
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)
        self.scaler = precision.LossScaler(args, ctx.world_size) if args.fp16 else None
        self.num_updates = 0
        self.lr = self.lr_scheduler.step_update(1)
        self._previous = (0.0, 0.0, 0.0)  # this rank's stats slots (see stats.py)
        self._checksum = self._parameter_checksum()
        self.failed_updates = 0           # non-finite updates in a row
        self.wrapped.train()

    def state_bytes(self, on_device=False):
        """Bytes of parameters, gradients and optimizer state this rank holds
        (``on_device``: 0 when --cpu-offload keeps them on the host of a GPU)."""
        if on_device and self.args.cpu_offload and self.ctx.device.type != "cpu":
            return 0
        slots = OPTIMIZERS.get(self.args.optimizer).state_slots(self.args)
        return sharding.model_state_bytes(self.params, self.optimizer, slots)

    @property
    def lockstep(self):
        """True when every forward communicates (FSDP): all ranks must then run
        the same number of micro-batches, padding with zero-weight ones."""
        return self.sharding.lockstep and self.ctx.distributed

    def _mode(self, training):
        # Switching walks every module, so only on a change (validation to training).
        if self.model.training != training:
            self.wrapped.train(training)

    # ---- training ----

    def train_step(self, samples, dummy, grad_norm=True):
        """One update from this rank's micro-batches ``samples`` (None: no data
        this step; ``dummy`` is run with zero weight so collectives still match).
        ``grad_norm=False`` skips measuring the gradient norm when clipping does
        not need it either (it costs one pass over the gradients)."""
        start, waited = time.perf_counter(), self.sharding.waited()
        self._mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        stats = StatsExchange(self.ctx, self._previous)
        loss_scale = self.scaler.scale if self.scaler else 1.0
        for i, sample in enumerate(samples):
            backward = Backward(stats, weight=0.0 if sample is None else 1.0,
                                last=i == len(samples) - 1, loss_scale=loss_scale,
                                waited=self.sharding.waited)
            with self.sharding.sync(self.wrapped, backward.last), \
                    precision.autocast(self.args, self.ctx.device):
                loss, n, logs = self.task.train_step(
                    self.wrapped, move_to(dummy if sample is None else sample, self.ctx.device),
                    backward=backward)
            if not backward.called:
                raise UserError(f"train_step of task '{self.args.task}' did not call the "
                                "backward it was given; call backward(loss, sample_size, logs) "
                                "instead of loss.backward()")
            if not backward.announced:
                stats.add(loss, n, logs, backward.weight)
        if backward.compute_end is None:
            end, waited_end = time.perf_counter(), self.sharding.waited()
        else:
            end, waited_end = backward.compute_end, backward.waited_at_end
        compute = end - start - (waited_end - waited)   # this rank's own work
        self._previous = (compute, stats.totals["sample_size"], self._checksum)
        totals, (rank_times, rank_samples, checksums) = stats.result()
        self._check_agreement(checksums)
        norm = self._apply_update(totals["sample_size"], grad_norm)
        metrics = self.task.reduce_metrics(totals)
        metrics.update(sample_size=totals["sample_size"], lr=self.lr)
        if norm is not None:
            metrics["grad_norm"] = norm
        metrics["rank_times"], metrics["rank_samples"] = rank_times, rank_samples
        return metrics

    def _apply_update(self, sample_size, want_norm):
        """Scale the gradients to the mean-loss gradient (math above), clip, step.
        Returns the norm of the mean-loss gradient, or None when not measured.

        What decides the update depends only on job-wide flags (--clip-norm),
        never on ``want_norm``: that comes from a node's own log settings
        (--log-interval, --tensorboard-logdir), and ranks that scaled by
        different kernels (a float64 factor here, a float32 one there) or
        skipped on different checks would drift apart."""
        if sample_size <= 0:
            logger.warning("update %d had no samples on any rank; skipped", self.num_updates + 1)
            return float("nan")
        grads = self.sharding.local_grads(self.params)
        scale = self._grad_divisor / (sample_size * (self.scaler.scale if self.scaler else 1.0))
        clip, norm = self.args.clip_norm, None
        if clip > 0 or want_norm:
            # ||scale * g|| = scale * ||g||: one pass for the norm.
            norm = self._grad_norm(grads) * scale
        if clip > 0:
            finite = math.isfinite(norm)
            if finite:   # the scaling and the clipping factor in one pass
                torch._foreach_mul_(grads, scale * min(1.0, clip / (norm + 1e-6)))
        else:   # the norm, when measured, is only reported
            found = _scale_and_check(grads, scale, self.ctx.device)
            finite = not self.sharding.reduce(found).item()
        if self.scaler is not None:
            self.scaler.update(overflow=not finite)
        if not finite:
            if self.scaler is None:
                self._skip_update()
            return norm
        self.failed_updates = 0
        self.optimizer.step()
        self.num_updates += 1
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)
        every = self.args.divergence_check_interval
        self._checksum = self._parameter_checksum() if every and self.num_updates % every == 0 \
            else 0.0   # 0: nothing to compare in the next update's stats
        return norm

    def _grad_norm(self, grads):
        """Norm of the whole gradient (all shards), as a float."""
        if not self.sharding.shards_grads:
            return float(torch.nn.utils.get_total_norm(grads))
        squares = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        if grads:
            squares += torch.stack(torch._foreach_norm(grads)).double().square().sum().to(squares)
        return float(self.sharding.reduce(squares).sqrt())

    def _skip_update(self):
        """A NaN/inf loss or gradient: every rank sees the same all-reduced
        gradient, so all skip this update together; too many in a row stop."""
        self.failed_updates += 1
        logger.warning("non-finite loss or gradient at update %d; update skipped (%d in a row)",
                       self.num_updates + 1, self.failed_updates)
        if self.failed_updates >= self.args.max_nan_updates:
            raise TrainingFailed(
                f"{self.failed_updates} updates in a row had a non-finite loss or gradient "
                f"(--max-nan-updates {self.args.max_nan_updates}); lower --lr, set --clip-norm, "
                "or check the data for broken samples")

    def _parameter_checksum(self):
        return agreement.checksum(self.sharding.replicated_state(self.params, self.optimizer))

    def _check_agreement(self, checksums):
        """Every rank must hold rank 0's parameters and optimizer state: rounding
        apart is undone, a real divergence stops the run (agreement.py)."""
        if agreement.disagreeing(checksums):
            agreement.resync(self.sharding.replicated_state(self.params, self.optimizer),
                             self.ctx, self.args.divergence_tolerance, self.num_updates + 1)

    # ---- validation ----

    def valid_step(self, sample, stats, weight=1.0):
        """Add one validation batch's stats to ``stats`` (a StatsExchange);
        ``weight`` 0: a padding batch that only keeps the collectives matched."""
        self._mode(False)
        with precision.autocast(self.args, self.ctx.device):
            loss, n, logs = self.task.valid_step(self.model, move_to(sample, self.ctx.device))
        stats.add(loss, n, logs, weight)

    # ---- state ----

    def set_horizon(self, planned):
        """Tell the LR schedule how many updates the run plans (see lr_scheduler)."""
        self.lr_scheduler.set_horizon(planned)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def set_epoch(self, epoch):
        self.lr_scheduler.set_epoch(epoch)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def state_dict(self):
        """The full state whatever the mode (sharding.py). Under sharding this is
        a collective (call it on every rank); the full optimizer state is then
        on rank 0 only."""
        state = {"model": self.sharding.model_state(self.model),
                 "optimizer": self.sharding.optimizer_state(self.model, self.optimizer),
                 "lr_scheduler": self.lr_scheduler.state_dict(), "num_updates": self.num_updates}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state):
        """The model always; the optimizer and schedule unless --reset-optimizer
        or --reset-lr-scheduler. A state saved under any --zero mode loads."""
        self.sharding.load_model_state(self.model, state["model"])
        if not self.args.reset_optimizer:
            self.sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            if self.scaler is not None and "loss_scaler" in state:
                self.scaler.load_state_dict(state["loss_scaler"])
        if not self.args.reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.num_updates = state["num_updates"]
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)
        self._checksum = self._parameter_checksum()
