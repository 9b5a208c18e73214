"""The Controller: the model as trained, the optimizer, the LR schedule and
one update, step by step in ``train_step`` (docs/design.md, "One update"),
with the gradient math that makes it the large-batch single-device update
beside ``apply_update`` and the step it ends with (``Stepper``: scale, clip,
check, step). The --clip-norm norm is the whole gradient's, summed over
shards with an overflow flag every update, so every rank skips the same ones."""

import gc
import logging
import math

import torch

from hetseq.keyed import randomness
from hetseq.data.iterators import move_to
from hetseq.base.errors import TrainingFailed, UserError
from hetseq.base.owned_file import compile_cache
from hetseq.base.sections import Section, flag, section
from hetseq.optim import (OPTIMIZERS, build_lr_scheduler, build_optimizer,
                          check_same_optimizer, keep_own_kernels)
from hetseq.distributed.collectives import broadcast_from
from hetseq.update import modes, precision
from hetseq.update.zero import held, sharding, uneven  # noqa: F401 (registers)
from hetseq.checkpoints.state import ANYTHING, Count, Fields, Number, like
from hetseq.update.exchange import Updates
from hetseq.update.members import Members
# Its part of a checkpoint, and the keys of that part (the exchange mode adds its own).
from hetseq.checkpoints.keys import LOSS_SCALER, LR_SCHEDULER, MODEL, OPTIMIZER, UPDATES
from hetseq.update.stats import ComputeClock

logger = logging.getLogger(__name__)


@section
class UpdateConfig(Section):
    """What the Controller does with a summed gradient: the clip here, the
    count of non-finite updates it tolerates."""
    clip_norm: float = flag(25.0, type=float, metavar="NORM",
                            help="clip the gradient norm to this (0: off; the norm is then "
                                 "measured after the update, for updates that are logged or "
                                 "go to TensorBoard; default: %(default)s)")
    max_nan_updates: int = flag(10, type=int, metavar="N",
                                help="stop after N updates in a row with a non-finite loss or "
                                     "gradient (each is skipped; default: 10)")


class Backward:
    """The ``backward`` a task's ``train_step`` receives for one micro-batch:
    ``backward(loss, sample_size, logs)`` (or ``backward(loss)``: the
    Controller then adds the stats train_step returns) runs the Controller's
    ``_backward``. ``weight`` 0: a padding batch, run so that collectives
    match, that adds nothing; ``loss_scale``: fp16's (the stats keep the true
    loss); ``clock``: the update's, on its last micro-batch only."""

    def __init__(self, run, stats, weight, loss_scale=1.0, clock=None):
        self._run, self.stats, self.weight = run, stats, weight
        self.loss_scale, self.clock, self.last = loss_scale, clock, clock is not None
        self.announced = False    # the stats came with the call (they travel before backward)
        self.called = False

    def __call__(self, loss, sample_size=None, logs=None):
        self.called = True
        self._run(self, loss, sample_size, logs)


class Controller:
    """Owns the model as trained (wrapped by the --zero mode), the optimizer,
    the LR schedule and the loss scale. ``job``: the JobConfig (config.py);
    a node's own flags never reach it."""

    def __init__(self, job, task, model, ctx, state_shares=None):
        self.task, self.ctx, self.cfg = task, ctx, job.update
        self._zero = job.sharding.zero
        # The exchange mode (modes/) and the sharding the ranks train under:
        # the --zero mode, built with the mode's DDP hook, as the mode keeps it.
        self.exchange = modes.build(job.exchange, job.precision, ctx, job.elastic.elastic)
        zero = sharding.build(job.sharding, job.precision, ctx, self.exchange.comm_hook(),
                              state_shares)
        self.sharding = self.exchange.train_under(zero)
        # FSDP moves each shard to the device itself: the whole model never
        # has to fit there (with --cpu-offload the shards stay on the host).
        self.model = model if self.sharding.shards_grads else model.to(ctx.device)
        randomness.name_sites(self.model)   # before wrapping: the names every rank shares
        if job.sharding.compile:
            # The forward, in place: the parameters and their names, hence
            # checkpoints, stay those of the plain model (torch.compile(model)
            # would prefix them; nn.Module.compile() traces nothing in torch
            # 2.13). Graphs are built at the first forward and for new shapes.
            compile_cache()      # a private cache: torch's own, in /tmp, others can plant
            self.model.forward = torch.compile(self.model.forward)
        # What a checkpoint must hold for this model, taken before wrapping:
        # a mode may shard or flatten the parameters, a checkpoint's format
        # is the plain model's whatever the mode (state_kind).
        self._saved_as = held.saved_as(self.model)
        self.wrapped = self.sharding.wrap(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise UserError(f"the model built by task '{job.task}' has no trainable parameters")
        built = build_optimizer(job.optimizer, self.params, job.schedule.lr[0])
        self._plain_optimizer = built     # its kind and settings: what a saved state must fit
        # The settings a saved state must have to fit this kind of optimizer.
        self._optimizer_kind = (job.optimizer.optimizer, set(built.defaults))
        self.optimizer = self.sharding.build_optimizer(built)
        # A fused optimizer (one kernel for the step, build_optimizer chose it
        # for CUDA parameters) skips a non-finite update on the device itself.
        self._fused = type(self.optimizer) is type(built) and bool(built.defaults.get("fused"))
        self._kernels = {k: built.defaults.get(k) for k in ("fused", "foreach")}
        self.exchange.attach(Updates(self))
        self._state_slots = OPTIMIZERS.get(job.optimizer.optimizer).state_slots(job.optimizer)
        self.stepper = Stepper(ctx, self.sharding, self.params, self.optimizer, self._fused,
                               self._state_slots, lambda: self._steps)
        self._offloaded = job.sharding.cpu_offload and ctx.device.type != "cpu"
        self.lr_scheduler = build_lr_scheduler(job.schedule, self.optimizer,
                                               job.training.max_update)
        self.autocast = precision.autocast(job.precision, ctx.device)
        # fairseq's default window: 2**14 updates of one rank's batch.
        window = 2 ** 14 / ctx.world_size / job.training.update_freq[0]
        self.scaler = precision.LossScaler(job.precision, window) if job.precision.fp16 else None
        self.num_updates = 0
        self.lr = self.lr_scheduler.step_update(1)
        self._steps = 0               # train_step calls (a StepResult's norm: until the next)
        self._layout = None           # (stats keys, announced) of the last update with samples
        self._wrapper_ran = False     # the wrapper (DDP) has run a backward since it was built
        self.members = Members(ctx)   # the ranks in the gradient exchange (members.py)
        self.failed_updates = 0       # non-finite updates in a row
        self.wrapped.train()

    def state_bytes(self, on_device=False):
        """Bytes of parameters, gradients and optimizer state this rank holds
        (``on_device``: 0 when --cpu-offload keeps them on the host of a GPU)."""
        if on_device and self._offloaded:
            return 0
        return held.model_state_bytes(self.sharding.counted_params(self.params),
                                          self.optimizer, self._state_slots)

    @property
    def lockstep(self):
        """True when every forward communicates (FSDP): all ranks must then run
        the same number of micro-batches, padding with zero-weight ones."""
        return self.sharding.lockstep and self.ctx.distributed

    def replicated_state(self):
        """The tensors every rank holds a copy of (agreement.py keeps them equal)."""
        return self.exchange.replicated()

    def gradient_bytes(self):
        """Bytes of the gradient one exchange sums (plan/links.py)."""
        return self.sharding.gradient_bytes(self.params)

    def can_sit_out(self):
        """Whether a rank may leave the gradient exchange (members.py): the
        --zero mode keeps the whole state on every rank and the exchange
        sums in the members' group."""
        return self.ctx.distributed and self.sharding.sits_out and self.exchange.sits_out

    def updates_per_exchange(self):
        """Updates one gradient exchange serves (--local-steps: a round's)."""
        return self.exchange.updates_per_exchange

    def set_members(self, active):
        """The ranks in the gradient exchange from the next update (the plan's;
        every rank calls this after the same update). A rank that comes
        back first receives rank 0's whole state: it made no step since it
        left. The wrapper is built again over the members' group."""
        returning = self.members.change(active)
        if returning is None:
            return
        if returning:
            carriers = self.members.group_of((0, *returning))
            if self.ctx.rank in (0, *returning):
                state = broadcast_from(0, self.state_dict, self.ctx, carriers)
                if self.ctx.rank in returning:
                    self.load_state_dict(state)
        # The old DDP's hooks leave the parameters before a new one adds its own.
        self.wrapped = self.model
        gc.collect()
        self.sharding.group = self.members.group
        if not self.members.sitting:
            self.wrapped = self.sharding.wrap(self.model)
        self.exchange.divisor = len(self.members.active)
        self._wrapper_ran = False

    def state_shares(self):
        """Every rank's fraction of the sharded state (None each under --zero 0
        or alone: nothing is split)."""
        world = self.ctx.world_size
        if not self.ctx.distributed or not self._zero:
            return [None] * world
        return list(self.sharding.shares or [1 / world] * world)

    def reshare(self, fractions):
        """New state shares by memory (a collective, before the first
        update): the plan measured each rank's activations after wrapping."""
        self.sharding.reshare(fractions, self.optimizer)

    def describe_sharding(self):
        """How the model and its state are spread over the ranks, in words."""
        return self.sharding.describe()

    def full_model_state(self):
        """The whole model's weights (a collective when they are sharded)."""
        return self.sharding.model_state(self.model)

    def _mode(self, training):
        # Switching walks every module, so only on a change (validation to training).
        if self.model.training != training:
            self.wrapped.train(training)

    # ---- training ----

    def train_step(self, samples, dummy, checksum=0.0, signal=0.0, boundary=True, stop=0.0):
        """One update from this rank's micro-batches ``samples`` (None: no data
        this step; ``dummy`` runs with zero weight where collectives must
        still match). ``checksum``: this rank's for the agreement check (0:
        none this update); ``signal``: 1.0 when the members change after it
        (--elastic); ``boundary``: the run needs one model after it (a round
        of --local-steps must end); ``stop``: the signal that asked this
        rank's node to stop (0: none). Returns the StepResult the run sees, or
        None inside a round. The steps below are the whole update; the mode
        (``self.exchange``) supplies what it changes as hooks."""
        self._steps += 1
        clock = ComputeClock(self.sharding.waited)
        self._mode(True)
        self.optimizer.zero_grad(set_to_none=True)
        # 1. The statistics begun, carrying this rank's report (its speed, its
        #    agreement checksum, the members' signal, a stop asked): the mode's StatsSum.
        stats = self.exchange.begin(checksum, signal, stop)
        if self.members.sitting:      # no forward, no exchange: rank 0's outcome (members.py)
            return self._sit_out(stats, boundary)
        # 2. Forward and backward, micro-batch by micro-batch; DDP sums the
        #    gradients inside the last backward, the stats' sum starts before it.
        seconds = self._forward_backward(samples, dummy, stats, clock)
        # 3. The exchange: the stats summed (N, every rank's report), and the
        #    gradients where the mode sums them itself.
        totals, _ = stats.result()
        self.exchange.sum_gradients()
        # 4. Scale by W/(N S), clip, step (the math is beside apply_update).
        made, norm = self.apply_update(totals["sample_size"])
        # 5. Count the update, or the skip.
        self._count(made, totals["sample_size"])
        # 6. The mode's end of the update (a round's exchange); this rank's
        #    figures are recorded with it (Exchange.finish).
        return self.exchange.finish(stats, made, norm, seconds, boundary)

    def _forward_backward(self, samples, dummy, stats, clock):
        """Step 2: the task's loss and backward on each micro-batch; returns
        this rank's compute seconds. A rank without samples runs none where
        its mode can take part in the exchange without (``_idle``), else
        ``dummy`` with zero weight."""
        if not self.lockstep:   # a padding batch matters only where every forward communicates
            samples = [sample for sample in samples if sample is not None] or [None]
        if samples == [None] and self._wrapper_ran and self.sharding.can_idle():
            self._idle(stats)
            clock.stamp()
            return clock.seconds()
        loss_scale = self.scaler.scale if self.scaler else 1.0
        for i, sample in enumerate(samples):
            micro = Backward(self._backward, stats, weight=0.0 if sample is None else 1.0,
                             loss_scale=loss_scale, clock=clock if i == len(samples) - 1 else None)
            sample, keys = self._keyed(dummy if sample is None else sample)
            with self.sharding.sync(self.wrapped, micro.last), self.autocast, \
                    randomness.using(keys):
                loss, n, logs = self.task.train_step(self.wrapped, sample, backward=micro)
            if not micro.called:
                raise UserError(f"train_step of task '{type(self.task).__name__}' did not call "
                                "the backward it was given; call backward(loss, sample_size, "
                                "logs) instead of loss.backward()")
            if not micro.announced:
                stats.add(loss, n, logs, micro.weight)
        # What an idle update must send: the stats' keys, and whether they
        # travel before the gradients (announced) or after.
        self._layout = (stats.layout(), micro.announced)
        self._wrapper_ran = True
        return clock.seconds()

    @staticmethod
    def _backward(micro, loss, sample_size, logs):
        """What the task's ``backward(loss, sample_size, logs)`` does: the
        micro-batch's stats added; on the last micro-batch their all-reduce
        started (it overlaps this backward) and the clock stamped where this
        rank's own backward work ends (stats.py); then backward, inside
        which DDP all-reduces (FSDP reduce-scatters) the gradients."""
        if sample_size is not None:
            micro.stats.add(loss.detach(), sample_size, logs or {}, micro.weight)
            micro.announced = True
        factor = micro.weight * micro.loss_scale
        total = loss if factor == 1.0 else loss * factor
        if micro.last:
            if micro.announced:
                micro.stats.start()
            micro.clock.stamp_at_end_of_backward(total)
        total.backward()

    def _idle(self, stats):
        """An update without samples on this rank, after one with (DDP has
        built its buckets; the stats' keys are known): zeros in the stats,
        sent where the other ranks send theirs (before the gradients when
        announced), and the mode's part of the gradient exchange, no forward."""
        keys, announced = self._layout
        stats.add_zeros(keys)
        self.sharding.idle(self.wrapped, stats.start if announced else lambda: None)

    def _sit_out(self, stats, boundary):
        """The update of a rank that sits out: zeros in the stats (the layout
        of its last update), no forward, the step as rank 0 made it."""
        stats.add_zeros(self._layout[0])
        totals, _ = stats.result()
        made, updates = self._as_rank_0(totals["sample_size"])
        self._count(made, totals["sample_size"])
        if updates is not None and updates != self.num_updates:
            raise TrainingFailed(f"rank {self.ctx.rank} counts {self.num_updates} updates, rank 0 "
                                 f"{updates}: a rank sitting out lost track of the job; "
                                 "restart it from the last checkpoint")
        return self.exchange.finish(stats, made, None, 0.0, boundary)

    def _keyed(self, batch):
        """(the sample on this rank's device, its samples' keys there, or None
        for a batch that comes without them: a caller of train_step's own)."""
        if isinstance(batch, randomness.KeyedBatch):
            return move_to(batch.sample, self.ctx.device), move_to(batch.keys, self.ctx.device)
        return move_to(batch, self.ctx.device), None

    def apply_update(self, sample_size):
        """Step 4: scale the gradients to the mean-loss gradient (math below),
        clip, step. Returns (whether a step was made, its gradient norm or a
        function measuring it). Only job-wide flags decide what runs here."""
        if sample_size <= 0:
            if not self.exchange.inner_steps:   # an inner step without samples is common
                logger.warning("update %d had no samples on any rank; skipped",
                               self.num_updates + 1)
            return False, None
        grads = self.sharding.local_grads(self.params)
        # Rank r's task returns the SUM of its n_r samples' losses, so it holds
        # g_r = grad(sum_{s in r} l_s); the mode leaves (its shard of) G/W,
        # G = sum_r g_r (DDP and FSDP average over the W members). Times W/N,
        # N = sum_r n_r from the stats all-reduce:
        #     (G/W) * (W/N) = (1/N) sum_r g_r = grad((1/N) sum_s l_s),
        # the global batch's mean-loss gradient, whatever the split (plain DDP
        # averages per-rank means: G/N only when every n_r is the same). fp16
        # scaled the loss by S: W/(N S). W is the mode's divisor (1 under
        # --local-steps, N this rank's own); a rank without samples adds g_r = 0, n_r = 0.
        scale = self.exchange.divisor / (sample_size * (self.scaler.scale if self.scaler else 1.0))
        finite, norm = self.stepper(grads, scale, self.cfg.clip_norm, self._steps)
        try:
            if self.scaler is not None:
                self.scaler.update(overflow=not finite)
        except TrainingFailed:
            self.members.tell(False, self.num_updates, stops=True)
            raise
        if self.members.someone_sits:     # rank 0 tells them, before a skip may stop the run
            self.members.tell(finite, self.num_updates + finite)
        return finite, norm

    def _count(self, made, sample_size):
        """Step 5: one more update when a step was made (and every inner step
        of --local-steps); a non-finite one skipped (with fp16 the loss scale
        decides instead)."""
        if made:
            self.failed_updates = 0
        elif sample_size > 0 and self.scaler is None:
            self._skip_update()
        if made or self.exchange.inner_steps:
            self.count_update()

    def _as_rank_0(self, sample_size):
        """A rank that sits out: (made, the count rank 0 reached) of the
        update as rank 0 made it, from its message; (False, None) without samples."""
        if sample_size <= 0:
            return False, None
        made, updates, stops = self.members.receive_outcome()
        if stops:
            raise TrainingFailed(f"rank 0 stopped the run at update {self.num_updates + 1} "
                                 "(its log says why); this rank sat out of the exchange")
        return made, updates

    def count_update(self):
        """One more update done; the next one's rate."""
        self.num_updates += 1
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def _skip_update(self):
        """A NaN/inf loss or gradient: every rank sees the same all-reduced
        gradient, so all skip this update together; too many in a row stop."""
        self.failed_updates += 1
        logger.warning("non-finite loss or gradient at update %d; update skipped (%d in a row)",
                       self.num_updates + 1, self.failed_updates)
        if self.failed_updates >= self.cfg.max_nan_updates:
            raise TrainingFailed(
                f"{self.failed_updates} updates in a row had a non-finite loss or gradient "
                f"(--max-nan-updates {self.cfg.max_nan_updates}); lower --lr, set --clip-norm, "
                "or check the data for broken samples")

    # ---- measuring and validating ----

    def probe(self, sample):
        """Forward and backward of ``sample`` with no update; returns this
        rank's compute seconds (capacity.py measures speed and memory with it).
        Under FSDP its forward communicates: every rank must probe as often."""
        clock = ComputeClock(self.sharding.waited)
        self._mode(True)
        sample, keys = self._keyed(sample)
        with self.autocast, randomness.using(keys):
            self.task.train_step(self.model, sample)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = clock.seconds()
        self.optimizer.zero_grad(set_to_none=True)
        return seconds

    def valid_step(self, sample, stats, weight=1.0):
        """Add one validation batch's stats to ``stats`` (a StatsSum);
        ``weight`` 0: a padding batch that only keeps the collectives matched."""
        self._mode(False)
        sample, _ = self._keyed(sample)     # evaluation draws nothing
        with self.autocast:
            loss, n, logs = self.task.valid_step(self.model, sample)
        stats.add(loss, n, logs, weight)

    # ---- state ----

    def set_horizon(self, planned):
        """Tell the LR schedule how many updates the run plans (see lr_scheduler)."""
        self.lr_scheduler.set_horizon(planned)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def set_epoch(self, epoch):
        self.lr_scheduler.set_epoch(epoch)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def state_dict(self, local=False):
        """The full state whatever the mode (sharding.py). Under sharding this is
        a collective (call it on every rank); the full optimizer state is then
        on rank 0 only. The exchange mode adds its own entries (--local-steps:
        the outer step's state and every rank's own optimizer state).

        ``local``: an elastic member's snapshot (--zero 0), with no
        collective: the state of the last update every rank completed (under
        --local-steps the last outer step: a round cut short by a lost member
        is trained again), this rank's own optimizer state only."""
        # A round in flight lands (local: one cut short goes back to its mark).
        mark = self.exchange.settle(local)
        if mark is not None:
            self._back_to(mark)
        state = {MODEL: self.full_model_state(),
                 OPTIMIZER: self.sharding.optimizer_state(self.model, self.optimizer),
                 LR_SCHEDULER: self.lr_scheduler.state_dict(), UPDATES: self.num_updates}
        state.update(self.exchange.state_dict(state[OPTIMIZER], local))
        if self.scaler is not None:
            state[LOSS_SCALER] = self.scaler.state_dict()
        return state

    def _back_to(self, mark):
        """Back to an ``Updates.mark()``: its optimizer state, its count and that count's rate."""
        optimizer_state, self.num_updates = mark
        self.optimizer.load_state_dict(optimizer_state)
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)

    def state_kind(self):
        """What a checkpoint's part of the Controller must be to load here
        (hetseq/checkpoints/state.py), checked before any of it loads, on every rank
        alike: the model this run built, an optimizer state of this kind over
        its parameters, a count of updates, and the exchange mode's entries.
        The format is one whatever --zero mode and shares saved it or load
        it, so the kind is too."""
        optimizer = held.optimizer_kind(self._plain_optimizer, self._saved_as.params,
                                        lambda saved: check_same_optimizer(
                                            saved, *self._optimizer_kind))
        optional = {OPTIMIZER: optimizer, LR_SCHEDULER: like(self.lr_scheduler.state_dict()),
                    **self.exchange.state_kind(optimizer)}
        if self.scaler is not None:
            # A scale of 0 or less would divide the gradients by it.
            optional[LOSS_SCALER] = Fields({"scale": Number(low=0, strict=True),
                                            "clean_updates": Count()}, extra=ANYTHING)
        # Entries of another exchange mode are left alone (extra).
        return Fields({MODEL: self._saved_as.model, UPDATES: Count()}, optional, extra=ANYTHING)

    def load_state_dict(self, state):
        """What ``state`` holds: always the model; the optimizer, loss scale
        and schedule unless the checkpointer left them out (--reset-*). A state
        saved under any --zero mode loads. The Checkpointer has checked it
        against ``state_kind()``."""
        self.sharding.load_model_state(self.model, state[MODEL])
        if OPTIMIZER in state:
            own = self.exchange.resumed_optimizer(state, state[OPTIMIZER])
            check_same_optimizer(own, *self._optimizer_kind)
            self.sharding.load_optimizer_state(self.model, self.optimizer, own)
            keep_own_kernels(self.optimizer, self._kernels)
        self.exchange.load_state_dict(state)
        if self.scaler is not None and LOSS_SCALER in state:
            self.scaler.load_state_dict(state[LOSS_SCALER])
        if LR_SCHEDULER in state:
            self.lr_scheduler.load_state_dict(state[LR_SCHEDULER])
        self.num_updates = state[UPDATES]
        self.lr = self.lr_scheduler.step_update(self.num_updates + 1)


# Step 4 of an update, after the Controller computed the factor (the math
# beside apply_update): the summed gradient scaled, clipped, checked for
# non-finite values and handed to the optimizer; for a whole gradient on its
# device, or one whose shards are spread over the ranks (--zero 2/3).
class Stepper:
    """``fused``: the optimizer skips a non-finite step on the device itself;
    ``state_slots``: tensors of state it keeps per parameter; ``steps()``:
    the Controller's train_step count (a norm measured later must be of the
    gradient it was made for)."""

    def __init__(self, ctx, sharding, params, optimizer, fused, state_slots, steps):
        self.ctx, self.sharding, self.params, self.optimizer = ctx, sharding, params, optimizer
        self._fused, self._state_slots, self._steps = fused, state_slots, steps

    def __call__(self, grads, scale, clip, step):
        """(finite, the norm or a function measuring it) of the update made
        from ``grads`` times ``scale``, clipped to ``clip`` (0: not)."""
        if self.sharding.shards_grads:
            return self._sharded_step(grads, scale, clip)
        return self._step(grads, scale, clip, step)

    def _step(self, grads, scale, clip, step):
        """Scale (and clip) a whole gradient on its device and step unless it
        is non-finite: (finite, its norm or a function measuring it). The
        host reads one flag per update, after the step is queued when the
        optimizer is fused (it skips on the device, as under GradScaler),
        before it otherwise."""
        if clip > 0:
            # ||scale * g|| = scale * ||g||; the factor in float64, as the host would.
            norm = torch.nn.utils.get_total_norm(grads).double() * scale if grads else \
                torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            found = norm.isfinite().logical_not().float().reshape(1)
            multiply(grads, (clip / (norm + 1e-6)).clamp(max=1.0) * scale)
            shown = read_later(norm)
        else:
            found = scale_and_check(grads, scale, self.ctx.device)
            shown = self._local_norm(step)
        # Once every parameter has its state (or the optimizer keeps none): a
        # fused SGD skipping its first step keeps an uninitialised momentum buffer.
        stateful = self._state_slots and len(self.optimizer.state) < len(self.params)
        if self._fused and not stateful:
            self.optimizer.found_inf = found.reshape(())
            self.optimizer.step()
            return not found.item(), shown
        if found.item():
            return False, shown
        self.optimizer.step()
        return True, shown

    def _sharded_step(self, grads, scale, clip):
        """_step for a gradient whose shards are spread over the ranks (the
        norm and flag come from one all-reduce, read before the step)."""
        norm, finite = self._sharded_norm_and_scale(grads, scale, clip)
        if clip > 0 and finite:   # the scaling and the clipping factor in one pass
            torch._foreach_mul_(grads, scale * min(1.0, clip / (norm + 1e-6)))
        if finite:
            self.optimizer.step()
        return finite, norm

    def _sharded_norm_and_scale(self, grads, scale, clip):
        """(norm, finite) of a gradient whose shards are spread over the ranks:
        one all-reduce of [sum of squares, overflow flag], whatever --clip-norm.
        Without clipping the gradients are scaled (and checked) first."""
        sum_sq = squares(grads, self.ctx.device)
        found = torch.zeros(1, device=self.ctx.device) if clip > 0 else \
            scale_and_check(grads, scale, self.ctx.device)
        summed = self.sharding.reduce(torch.cat([sum_sq, found.to(sum_sq)])).tolist()
        norm = math.sqrt(summed[0]) * scale
        return norm, math.isfinite(norm) and not summed[1]

    def _local_norm(self, step):
        """The norm of this rank's full (scaled) gradient, measured when asked."""
        def measure():
            if step != self._steps():
                return None
            grads = self.sharding.local_grads(self.params)
            return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        return measure


# Passes over a rank's gradients (the math is controller.py's): scaling, the
# non-finite check, norms; all on the gradients' device, read by the host
# only when asked.
def scale_and_check(grads, scale, device):
    """Multiply every gradient by ``scale``; returns a 1-element tensor, nonzero
    if any was NaN or inf. One fused pass: the kernel GradScaler unscales with.
    It takes the factor as a float32 tensor, which is exact for gradients of
    float32 and narrower (their products are float32 roundings anyway); a
    float64 gradient would be scaled 6e-8 off whenever W/N is no binary
    fraction (3/36), so those are scaled in float64 first and only checked."""
    found = torch.zeros(1, device=grads[0].device if grads else device)
    wide = [g for g in grads if g.dtype == torch.float64]
    narrow = [g for g in grads if g.dtype != torch.float64]
    if wide:
        torch._foreach_mul_(wide, scale)
    for group, factor in ((narrow, scale), (wide, 1.0)):
        if group:
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, found, torch.full((1,), factor, device=found.device))
    return found


def multiply(grads, factor):
    """``grads`` times a device scalar, in each gradient's dtype (the fast
    foreach kernel needs the scalar's dtype to match; rounded to it, the
    factor multiplies as a host float of float32 opmath would)."""
    for dtype in {g.dtype for g in grads}:
        group = [g for g in grads if g.dtype == dtype]
        torch._foreach_mul_(group, factor.to(dtype))


def read_later(value):
    """A device value the host reads only when asked (a log line's norm)."""
    return lambda: float(value)


def squares(grads, device):
    """Sum of the squares of ``grads`` (a float64 tensor of one element)."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).double().square().sum().to(total)
    return total
