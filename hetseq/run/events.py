"""The run's events: what follows an update (a validation, a save, the
run's end). One answer
for both moments that ask: before the update (--local-steps ends its round
there, so that every rank holds one model when it is used) and after it
(the loop then validates, saves or stops). From the job's flags and the
update count only, so every rank answers alike."""

import dataclasses

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
    """``training``: the TrainingConfig; ``saving``: the CheckpointConfig."""

    def __init__(self, training, saving):
        self.training, self.saving = training, saving

    def after(self, updates):
        """What follows the update that brings the count to ``updates``."""
        training = self.training
        return After(
            validates=not training.disable_validation and
            due(training.validate_interval_updates, updates),
            saves=due(self.saving.save_interval_updates, updates),
            ends=bool(training.max_update and updates >= training.max_update))

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

        def count(every_updates, every_epochs):
            extra = {u for u, e in ends if every_epochs and e % every_epochs == 0} | {planned}
            multiples = (planned // every_updates - (max(updates, 1) - 1) // every_updates
                         if every_updates else 0)
            return multiples + sum(1 for u in extra if not due(every_updates, u))
        return {"validation": 0 if training.disable_validation else
                count(training.validate_interval_updates, training.validate_interval),
                "saving": count(saving.save_interval_updates, saving.save_interval) if saves
                else 0}


def due(every, updates):
    """Whether an every-N-updates action (N = 0: never) falls on ``updates``
    (never on 0: a skipped first update leaves the count there)."""
    return bool(every and updates and updates % every == 0)
