"""The Controller's part of a checkpoint and its keys (hetseq/checkpoints/state.py).

Here, below both the Controller and the exchange modes, so that a mode
declares its own entries (``mode_key``) without importing the Controller.
"""

from hetseq.checkpoints.state import Component, Count

CONTROLLER = Component("controller")
MODEL = CONTROLLER.key("model")
OPTIMIZER = CONTROLLER.key("optimizer", reset="optimizer")
LR_SCHEDULER = CONTROLLER.key("lr_scheduler", reset="lr-scheduler")
UPDATES = CONTROLLER.key("num_updates", kind=Count())   # an elastic node reads it from any file
LOSS_SCALER = CONTROLLER.key("loss_scaler", reset="optimizer")


def mode_key(name, reset=None):
    """An entry of an exchange mode's own in the Controller's state (its
    ``state_dict``); ``reset``: the --reset-* flag that leaves it out."""
    return CONTROLLER.key(name, reset)
