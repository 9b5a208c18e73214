"""The Controller: model wrapping, optimizer, LR schedule and the gradient math.

Gradient math (why the update equals large-batch single-device training)
-----------------------------------------------------------------------
Rank r processes n_r samples and its task returns the SUM of their losses,
so after backward rank r holds g_r = grad( sum_{s in r} l_s ). DDP's own
all-reduce averages over the W ranks, leaving G/W with G = sum_r g_r, and the
counts travel with it (the stats vector of stats.py). We scale by W/N:

    (G/W) * (W/N) = (1/N) * sum_r g_r = grad( (1/N) * sum_s l_s ),   N = sum_r n_r,

which is exactly the gradient of the mean loss over the global batch, as if
one device had processed all N samples. Plain DDP instead averages per-rank
MEAN gradients with equal weights, (1/W) * sum_r g_r / n_r, which equals G/N
only when every n_r is the same: wrong whenever ranks take different batches.
Micro-batches accumulate into the same sums, so --update-freq and local
accumulation change nothing in this formula.

DDP's built-in averaging, rather than a SUM communication hook, keeps the
all-reduce in C++: a Python hook costs 3-5% of a small model's step.
"""

import contextlib
import logging
import math
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from hetseq.errors import TrainingFailed, UserError
from hetseq.optim import build_lr_scheduler, build_optimizer
from hetseq.stats import Backward, Carrier, StatsExchange
from hetseq.utils import move_to

logger = logging.getLogger(__name__)


def _scale_and_check(grads, scale):
    """Multiply every gradient by ``scale``; False if any was NaN or inf. One
    fused pass: the kernel GradScaler unscales with. It takes the factor in
    float32, a relative rounding of at most 6e-8, exact for powers of two."""
    found = torch.zeros(1, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(
        grads, found, torch.full((1,), scale, device=found.device))
    return not found.item()


def wrap_model(model, ctx, args):
    """(DDP around the model and a stats Carrier, the Carrier) when distributed;
    (the bare module, None) otherwise. With --find-unused-parameters DDP marks
    every parameter the forward did not reach as done before backward, the
    carrier's slot included, so the stats then travel on their own."""
    if not ctx.distributed:
        return model, None
    carrier = None if args.find_unused_parameters else Carrier(model, ctx.world_size, ctx.device)
    ddp = DistributedDataParallel(
        carrier or model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb, find_unused_parameters=args.find_unused_parameters)
    return ddp, carrier


class Controller:
    def __init__(self, args, task, model, ctx):
        self.args = args
        self.task = task
        self.ctx = ctx
        self.model = model.to(ctx.device)
        self.wrapped, self._carrier = wrap_model(self.model, ctx, args)
        self._grad_divisor = ctx.world_size if ctx.distributed else 1  # DDP averages
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise UserError(f"the model built by task '{args.task}' has no trainable parameters")
        self.optimizer = build_optimizer(args, self.params)
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)
        self.num_updates = 0
        self.lr = self.lr_scheduler.step_update(1)
        self._previous = (0.0, 0.0, 0.0)  # this rank's stats slots (see stats.py)
        self._checksum = self._parameter_checksum()
        self.failed_updates = 0           # non-finite updates in a row
        self.wrapped.train()

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
        start = time.perf_counter()
        self._mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        stats = StatsExchange(self.ctx, self._previous, carrier=self._carrier)
        for i, sample in enumerate(samples):
            backward = Backward(stats, weight=0.0 if sample is None else 1.0,
                                last=i == len(samples) - 1)
            with self._sync_on(backward.last):
                loss, n, logs = self.task.train_step(
                    self.wrapped, move_to(dummy if sample is None else sample, self.ctx.device),
                    backward=backward)
            if not backward.called:
                raise UserError(f"train_step of task '{self.args.task}' did not call the "
                                "backward it was given; call backward(loss, sample_size, logs) "
                                "instead of loss.backward()")
            if not backward.announced:
                stats.add(loss, n, logs, backward.weight)
        end = backward.compute_end or time.perf_counter()
        self._previous = (end - start, stats.totals["sample_size"], self._checksum)
        totals, (rank_times, rank_samples, checksums) = stats.result()
        self._check_agreement(checksums)
        norm = self._apply_update(totals["sample_size"], grad_norm)
        metrics = self.task.reduce_metrics(totals)
        metrics.update(sample_size=totals["sample_size"], lr=self.lr)
        if norm is not None:
            metrics["grad_norm"] = norm
        metrics["rank_times"], metrics["rank_samples"] = rank_times, rank_samples
        return metrics

    def _sync_on(self, last):
        """Gradient sync only on the last micro-batch of an update."""
        if not self.ctx.distributed or last:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

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
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = self._grad_divisor / sample_size
        clip, norm = self.args.clip_norm, None
        if clip > 0 or want_norm:
            # ||scale * g|| = scale * ||g||: one pass for the norm.
            norm = float(torch.nn.utils.get_total_norm(grads)) * scale
        if clip > 0:
            finite = math.isfinite(norm)
            if finite:   # the scaling and the clipping factor in one pass
                torch._foreach_mul_(grads, scale * min(1.0, clip / (norm + 1e-6)))
        else:   # the norm, when measured, is only reported
            finite = _scale_and_check(grads, scale)
        if not finite:
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

    @torch.no_grad()
    def _parameter_checksum(self):
        # Norm of the per-tensor norms: one fused pass, stays on the device.
        return torch.stack(torch._foreach_norm(self.params)).double().norm()

    def _check_agreement(self, checksums):
        """Every rank must hold the same parameters (as fairseq checks grad norms).
        The tolerance allows for different devices rounding a norm differently."""
        reference = checksums[0]
        if reference == 0.0:
            return
        bad = [r for r, c in enumerate(checksums) if abs(c - reference) > 1e-5 * abs(reference)]
        if bad:
            raise TrainingFailed(
                f"parameters differ between ranks before update {self.num_updates + 1}: norm "
                f"{reference:.9g} on rank 0 but " + ", ".join(
                    f"{checksums[r]:.9g} on rank {r}" for r in bad) + ". Every rank must run "
                "the same code, model and flags; a rank changing parameters outside the "
                "Controller, or a non-deterministic optimizer, does this")

    # ---- validation ----

    def valid_step(self, sample, stats):
        """Add one validation batch's stats to ``stats`` (a StatsExchange)."""
        self._mode(False)
        loss, n, logs = self.task.valid_step(self.model, move_to(sample, self.ctx.device))
        stats.add(loss, n, logs)

    # ---- state ----

    def set_horizon(self, planned):
        """Tell the LR schedule how many updates the run plans (see lr_scheduler)."""
        self.lr_scheduler.set_horizon(planned)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def set_epoch(self, epoch):
        self.lr_scheduler.set_epoch(epoch)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state):
        """The model always; the optimizer and schedule unless --reset-optimizer
        or --reset-lr-scheduler."""
        self.model.load_state_dict(state["model"])
        if not self.args.reset_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        if not self.args.reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.num_updates = state["num_updates"]
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)
        self._checksum = self._parameter_checksum()
