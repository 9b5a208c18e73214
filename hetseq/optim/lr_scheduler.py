"""Learning-rate schedules as pure functions of the update number.

``lr_at(update, epoch)`` is the LR used by update number ``update`` (1-based).
Because the schedule is a function of counters the Controller already
checkpoints, resuming needs no scheduler state beyond those counters.
Every schedule's flags are fields of ScheduleConfig, declared once below.
"""

import math

from hetseq.base.errors import UserError
from hetseq.base.registry import Registry
from hetseq.base.sections import Section, flag, float_list, section

DEFAULT_TOTAL = 1000000   # decay horizon when nothing tells the run's length


@section
class ScheduleConfig(Section):
    """The learning-rate schedule: --lr, the flags every schedule reads, then
    each schedule's own (every schedule's are the job's, whichever runs)."""
    lr_scheduler: str = flag("polynomial_decay", names=("--lr_scheduler",),
                             help=lambda: f"one of: {', '.join(SCHEDULERS.names())} "
                                          "(default: %(default)s)")
    lr: tuple = flag([0.25], type=float_list, names=("--learning-rate",),
                     metavar="LR_1,LR_2,...",
                     help="peak learning rate; the fixed schedule reads one per epoch "
                          "(default: %(default)s)")
    warmup_updates: int | None = flag(None, type=int, metavar="N",
                                      help="increase the LR linearly over the first N updates "
                                           "(default: --warmup-ratio of the planned updates, "
                                           "else 0)")
    warmup_ratio: float | None = flag(None, type=float, metavar="F",
                                      help="warm up over this fraction of the planned updates, "
                                           "unless --warmup-updates is given (Hugging Face's "
                                           "warmup_ratio; default: %(default)s)")
    total_num_update: int = flag(DEFAULT_TOTAL, type=int, metavar="N",
                                 help="updates over which polynomial_decay/cosine decay; 0: the "
                                      "planned updates (--max-update, else --max-epoch epochs "
                                      f"of the data, else {DEFAULT_TOTAL}) (default: "
                                      "%(default)s)")
    end_learning_rate: float = flag(0.0, type=float,
                                    help="LR reached at --total-num-update (default: 0)")
    min_lr: float = flag(-1.0, type=float, metavar="LR",
                         help="stop training when the LR falls to this value (default: off)")
    force_anneal: int | None = flag(None, type=int, names=("--fa",), metavar="N",
                                    help="fixed: shrink the LR every epoch after epoch N")
    lr_shrink: float = flag(0.1, type=float,
                            help="fixed: LR factor per epoch after --force-anneal (default: 0.1)")
    warmup_init_lr: float = flag(0.0, type=float, metavar="LR",
                                 help="inverse_sqrt: LR at the start of warm-up (default: 0)")
    power: float = flag(1.0, type=float,
                        help="exponent of polynomial_decay (default: 1, linear)")


class LRScheduler:
    def __init__(self, cfg, optimizer, max_update=0):
        self.cfg = cfg            # ScheduleConfig (above)
        self.optimizer = optimizer
        self.peak_lr = cfg.lr[0]
        if cfg.warmup_updates is not None and cfg.warmup_updates < 0:
            raise UserError(f"--warmup-updates {cfg.warmup_updates}: expected a number >= 0")
        if cfg.warmup_ratio is not None and not 0 <= cfg.warmup_ratio < 1:
            raise UserError(f"--warmup-ratio {cfg.warmup_ratio}: expected a fraction in [0, 1)")
        self.epoch = 1
        self.set_horizon(cfg.total_num_update or max_update or DEFAULT_TOTAL)

    def set_horizon(self, planned):
        """The number of updates the run plans: the decay's end, when
        --total-num-update is not given, and the base of --warmup-ratio."""
        # An explicit --warmup-updates wins over a ratio (which may be a task's default).
        updates, ratio = self.cfg.warmup_updates, self.cfg.warmup_ratio
        self.warmup = updates if updates is not None else round((ratio or 0.0) * planned)
        # One past the last update: its LR is not yet the end value (as HF's linear decay).
        self.total = self.cfg.total_num_update or planned + 1

    def lr_at(self, update):
        raise NotImplementedError

    def describe(self):
        """The schedule as it will run, for the start-up log."""
        return f"peak {self.peak_lr:g}, warm-up {self.warmup} updates"

    def warmup_lr(self, update, start=0.0):
        return start + (self.peak_lr - start) * update / self.warmup

    def set_epoch(self, epoch):
        self.epoch = epoch

    def step_update(self, update):
        """Set the optimizer's LR for update number ``update``; return it."""
        lr = self.lr_at(update)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def planned_updates(training, steps_per_epoch):
    """Updates the run will make (``training``: its TrainingConfig):
    --max-update, else --max-epoch epochs of ``steps_per_epoch`` global
    batches (with --update-freq), else None."""
    if training.max_update:
        return training.max_update
    if not training.max_epoch:
        return None
    freqs = training.update_freq
    return sum(math.ceil(steps_per_epoch / freqs[min(epoch, len(freqs)) - 1])
               for epoch in range(1, training.max_epoch + 1))


SCHEDULERS: Registry = Registry("LR scheduler", base=LRScheduler)
register_lr_scheduler = SCHEDULERS.register


class _DecayToEnd(LRScheduler):
    """Warm up, then decay from the peak to --end-learning-rate at --total-num-update."""

    def __init__(self, cfg, optimizer, max_update=0):
        self.end_lr = cfg.end_learning_rate
        super().__init__(cfg, optimizer, max_update)

    def set_horizon(self, planned):
        super().set_horizon(planned)
        if self.total <= self.warmup:
            raise UserError(f"--total-num-update {self.total} must exceed the {self.warmup} "
                            "warm-up updates; set it to the planned number of updates")

    def describe(self):
        source = "--total-num-update" if self.cfg.total_num_update else "the planned run"
        return (f"{super().describe()}, then to {self.end_lr:g} at update {self.total} "
                f"({source})")

    def lr_at(self, update):
        if update <= self.warmup:
            return self.warmup_lr(update)
        if update >= self.total:
            return self.end_lr
        remaining = 1.0 - (update - self.warmup) / (self.total - self.warmup)
        return self.end_lr + (self.peak_lr - self.end_lr) * self.decay(remaining)

    def decay(self, remaining):
        raise NotImplementedError


@register_lr_scheduler("polynomial_decay", aliases=("PolynomialDecayScheduler",))
class PolynomialDecay(_DecayToEnd):
    def decay(self, remaining):
        return remaining ** self.cfg.power


@register_lr_scheduler("cosine")
class Cosine(_DecayToEnd):
    def decay(self, remaining):
        return 0.5 * (1.0 + math.cos(math.pi * (1.0 - remaining)))


@register_lr_scheduler("inverse_sqrt")
class InverseSqrt(LRScheduler):
    def lr_at(self, update):
        if update <= self.warmup:
            return self.warmup_lr(update, start=self.cfg.warmup_init_lr)
        return self.peak_lr * math.sqrt(max(self.warmup, 1) / update)


@register_lr_scheduler("fixed")
class Fixed(LRScheduler):
    """--lr for each epoch (a comma list, the last value repeats), optional warm-up
    and annealing by --lr-shrink per epoch after --force-anneal."""

    def lr_at(self, update):
        lrs, anneal = self.cfg.lr, self.cfg.force_anneal
        if anneal is not None and self.epoch > anneal:
            lr = lrs[-1] * self.cfg.lr_shrink ** (self.epoch - anneal)
        else:
            lr = lrs[min(self.epoch, len(lrs)) - 1]
        if update <= self.warmup:
            lr *= update / self.warmup
        return lr
