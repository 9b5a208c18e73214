"""The Controller: model wrapping, optimizer, LR schedule and the gradient math.

Gradient math (why the update equals large-batch single-device training)
-----------------------------------------------------------------------
Rank r processes n_r samples and its task returns the SUM of their losses,
so after backward rank r holds g_r = grad( sum_{s in r} l_s ). We all-reduce
the gradients as a SUM (a DDP communication hook) and the counts with them
(the stats vector of stats.py), then scale by 1/N:

    G / N = (1/N) * sum_r g_r = grad( (1/N) * sum_s l_s ),   N = sum_r n_r,

which is exactly the gradient of the mean loss over the global batch, as if
one device had processed all N samples. Plain DDP instead averages per-rank
MEAN gradients with equal weights, (1/W) * sum_r g_r / n_r, which equals G/N
only when every n_r is the same: wrong whenever ranks take different batches.
Micro-batches accumulate into the same sums, so --update-freq and local
accumulation change nothing in this formula.
"""

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetseq.errors import TrainingFailed, UserError
from hetseq.optim import build_lr_scheduler, build_optimizer
from hetseq.stats import Backward, StatsExchange
from hetseq.utils import move_to

logger = logging.getLogger(__name__)


class SumHook:
    """DDP communication hook: all-reduce gradient buckets as a SUM (DDP's
    default divides by the world size).

    It also carries the update's stats vector (stats.py) inside the FIRST
    bucket's all-reduce, so stats cost no collective of their own, and records
    when the last bucket became ready, i.e. when this rank's own backward
    compute ended, so the measured compute time excludes waiting for others.
    """

    def __init__(self):
        self.last_ready = None
        self._outgoing = None     # float64 stats to send with the next first bucket
        self._incoming = None     # their sum, once that bucket is reduced

    def carry(self, vec):
        """Send ``vec`` with the first gradient bucket of the coming backward."""
        self._outgoing, self._incoming = vec, None

    def take(self):
        incoming, self._incoming = self._incoming, None
        return incoming

    @staticmethod
    def hook(state, bucket):
        state.last_ready = time.perf_counter()
        buffer = bucket.buffer()
        if state._outgoing is None or bucket.index() != 0:
            work = dist.all_reduce(buffer, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        vec, state._outgoing = state._outgoing, None
        if buffer.dtype not in (torch.float32, torch.float64):
            # Half-precision buckets cannot hold the stats: reduce them beside it.
            state._incoming = vec
            dist.all_reduce(vec)
            work = dist.all_reduce(buffer, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        # In a float32 bucket the stats keep float32 precision: plenty for logs
        # and checks, and counts stay exact (StatsExchange carries only < 2**24).
        joined = torch.cat([buffer, vec.to(buffer.dtype)])
        work = dist.all_reduce(joined, async_op=True)

        def unpack(fut):
            out = fut.value()[0]
            state._incoming = out[buffer.numel():].double()
            buffer.copy_(out[:buffer.numel()])
            return buffer
        return work.get_future().then(unpack)


def wrap_model(model, ctx, args):
    """DDP with the SUM hook when distributed; the bare module otherwise."""
    if not ctx.distributed:
        return model, None
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb, find_unused_parameters=args.find_unused_parameters)
    hook = SumHook()
    ddp.register_comm_hook(hook, SumHook.hook)
    return ddp, hook


class Controller:
    def __init__(self, args, task, model, ctx):
        self.args = args
        self.task = task
        self.ctx = ctx
        self.model = model.to(ctx.device)
        self.wrapped, self._hook = wrap_model(self.model, ctx, args)
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

    # ---- training ----

    def train_step(self, samples, dummy):
        """One update from this rank's micro-batches ``samples`` (None: no data
        this step; ``dummy`` is run with zero weight so collectives still match)."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        stats = StatsExchange(self.ctx, self._previous, carrier=self._hook)
        for i, sample in enumerate(samples):
            last = i == len(samples) - 1
            backward = Backward(stats, weight=0.0 if sample is None else 1.0, last=last)
            with self._sync_on(last):
                loss, n, logs = self.task.train_step(
                    self.wrapped, move_to(dummy if sample is None else sample, self.ctx.device),
                    backward=backward)
            if not backward.announced:
                stats.add(loss, n, logs, backward.weight)
        local_samples = float(stats.totals["sample_size"])
        self._previous = (self._compute_time(start), local_samples, self._checksum)
        totals, (rank_times, rank_samples, checksums) = stats.result()
        self._check_agreement(checksums)
        grad_norm = self._apply_update(totals["sample_size"])
        metrics = self.task.reduce_metrics(totals)
        metrics.update(sample_size=totals["sample_size"], grad_norm=grad_norm, lr=self.lr)
        metrics["rank_times"], metrics["rank_samples"] = rank_times, rank_samples
        return metrics

    def _sync_on(self, last):
        """Gradient sync only on the last micro-batch of an update."""
        if self._hook is None or last:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def _compute_time(self, start):
        end = time.perf_counter()
        if self._hook is not None and self._hook.last_ready is not None:
            end = min(end, self._hook.last_ready)
            self._hook.last_ready = None
        return end - start

    def _apply_update(self, sample_size):
        """Scale the summed gradient by 1/N, clip, step. Returns the grad norm of
        the mean-loss gradient (NaN when the update was skipped)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if sample_size <= 0:
            logger.warning("update %d had no samples on any rank; skipped", self.num_updates + 1)
            return float("nan")
        # ||G/N|| = ||G||/N, so one pass computes the norm and one pass applies
        # both the 1/N scaling and the clipping factor.
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) / sample_size
        if not math.isfinite(grad_norm):
            self._skip_update()
            return grad_norm
        self.failed_updates = 0
        clip = self.args.clip_norm
        scale = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        torch._foreach_mul_(grads, scale / sample_size)
        self.optimizer.step()
        self.num_updates += 1
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)
        every = self.args.divergence_check_interval
        self._checksum = self._parameter_checksum() if every and self.num_updates % every == 0 \
            else 0.0   # 0: nothing to compare in the next update's stats
        return grad_norm

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
        loss, n, logs = self.task.valid_step(self.model, move_to(sample, self.ctx.device))
        stats.add(loss, n, logs)

    # ---- state ----

    def set_epoch(self, epoch):
        self.lr_scheduler.set_epoch(epoch)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state, reset_optimizer=False, reset_lr_scheduler=False):
        self.model.load_state_dict(state["model"])
        if not reset_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        if not reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.num_updates = state["num_updates"]
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)
        self._checksum = self._parameter_checksum()
