"""The run's schedule: what follows an update (a validation, a save, the
run's end) and when the run stops. One answer for every moment that asks:
before an update (--local-steps ends its round there), after it and at an
epoch's end (the loop validates, saves or stops), and the time left. From
the job's flags and the run's counts only, so every rank answers alike."""

import dataclasses

from hetseq.base.sections import Section, flag, int_list, section

MAX_EPOCH_ENDS = 10_000    # epoch ends counted ahead, at most


@dataclasses.dataclass(frozen=True)
class After:
    """The events that follow one update."""
    validates: bool = False
    saves: bool = False
    ends: bool = False          # --max-update reached

    def __bool__(self):
        return self.validates or self.saves or self.ends


class Events:
    """``training``: the TrainingConfig; ``saving``: the CheckpointConfig;
    ``schedule``: the ScheduleConfig (--min-lr)."""

    def __init__(self, training, saving, schedule=None):
        self.training, self.saving, self.schedule = training, saving, schedule

    def after(self, updates):
        """What follows the update that brings the count to ``updates``."""
        training = self.training
        return After(
            validates=not training.disable_validation and
            due(training.validate_interval_updates, updates),
            saves=due(self.saving.save_interval_updates, updates),
            ends=bool(training.max_update and updates >= training.max_update))

    def at_epoch_end(self, epoch, stopping=False):
        """What follows the end of ``epoch`` (--validate-interval and
        --save-interval count epochs), or the last update when ``stopping``:
        the run validates and saves once more before it ends."""
        training = self.training
        return After(validates=not training.disable_validation and
                     (stopping or due(training.validate_interval, epoch)),
                     saves=stopping or due(self.saving.save_interval, epoch), ends=stopping)

    def stop_reason(self, epoch, updates, lr):
        """Why the run stops before ``epoch`` (the epoch it would train next)
        after ``updates`` at learning rate ``lr``; None: it goes on."""
        training = self.training
        if training.max_epoch and epoch > training.max_epoch:
            return f"reached --max-epoch {training.max_epoch}"
        if training.max_update and updates >= training.max_update:
            return f"reached --max-update {training.max_update}"
        if self.schedule is not None and lr <= self.schedule.min_lr:
            return f"learning rate {lr:.3g} reached --min-lr {self.schedule.min_lr:.3g}"
        return None

    def still_due(self, updates, planned, epoch, epoch_end, epoch_updates, saves=True):
        """{"validation": n, "saving": n}: those still to come at or after
        update ``updates`` (the loop makes an update's events after its
        progress line) up to the ``planned`` end, where the run validates and
        saves once more; ``epoch`` ends at update ``epoch_end``, the next
        ones every ``epoch_updates`` (the end-of-epoch events of
        --validate-interval and --save-interval). ``saves``: False under
        --no-save. For the time left only."""
        training, saving = self.training, self.saving
        ends, end = [], epoch_end          # (update, epoch) of the epoch ends still due
        while end <= planned and len(ends) < MAX_EPOCH_ENDS:
            if end >= updates:
                ends.append((end, epoch))
            if epoch_updates <= 0:
                break
            end, epoch = end + epoch_updates, epoch + 1

        def count(every_updates, kind):
            extra = {u for u, e in ends if getattr(self.at_epoch_end(e), kind)} | {planned}
            multiples = (planned // every_updates - (max(updates, 1) - 1) // every_updates
                         if every_updates else 0)
            return multiples + sum(1 for u in extra if not due(every_updates, u))
        return {"validation": 0 if training.disable_validation else
                count(training.validate_interval_updates, "validates"),
                "saving": count(saving.save_interval_updates, "saves") if saves else 0}


def due(every, updates):
    """Whether an every-N-updates action (N = 0: never) falls on ``updates``
    (never on 0: a skipped first update leaves the count there)."""
    return bool(every and updates and updates % every == 0)


@section
class TrainingConfig(Section):
    """The loop: which data, how long, when to validate (run/loop.py)."""
    seed: int = flag(19940802, type=int, help="random seed (default: %(default)s)")
    train_subset: str = flag("train", metavar="SPLIT", help="split to train on (default: train)")
    valid_subset: str = flag("valid", metavar="SPLITS",
                             help="comma-separated splits to validate on after each epoch "
                                  "(default: valid)")
    validate_interval: int = flag(1, type=int, metavar="N",
                                  help="validate every N epochs (default: 1)")
    validate_interval_updates: int = flag(0, type=int, metavar="N",
                                          help="also validate after every N updates (0: only at "
                                               "epoch ends; --local-steps: a round ends there) "
                                               "(default: 0)")
    disable_validation: bool = flag(False, action="store_true", help="do not validate")
    curriculum: int = flag(0, type=int, metavar="N",
                           help="do not shuffle the data in the first N epochs")
    max_epoch: int = flag(0, type=int, names=("--me",), metavar="N",
                          help="stop after N epochs (0: no limit; default: %(default)s)")
    max_update: int = flag(0, type=int, names=("--mu",), metavar="N",
                           help="stop after N updates (0: no limit; default: %(default)s)")
    update_freq: tuple = flag([1], type=int_list, metavar="N1,N2,...",
                              help="global batches per update (gradient accumulation); a list "
                                   "gives one value per epoch, the last repeats (default: 1)")

    @property
    def valid_subsets(self):
        return tuple(self.valid_subset.split(","))

    def update_freq_at(self, epoch):
        """Global batches per update in ``epoch`` (the list's last value repeats)."""
        return self.update_freq[min(epoch, len(self.update_freq)) - 1]
