"""The run's events: what follows an update (a validation, a save, the
run's end). One answer
for both moments that ask: before the update (--local-steps ends its round
there, so that every rank holds one model when it is used) and after it
(the loop then validates, saves or stops). From the job's flags and the
update count only, so every rank answers alike."""

import dataclasses


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


def due(every, updates):
    """Whether an every-N-updates action (N = 0: never) falls on ``updates``
    (never on 0: a skipped first update leaves the count there)."""
    return bool(every and updates and updates % every == 0)
