"""The parts of a checkpoint and their keys, each declared once by the module
that writes it, and which --reset-* flag leaves it out on resume.

Below the update (keys.py declares the Controller's), the run
(run/checkpoint.py, which saves and restores them), the tasks and bert, so
none of them imports another for its keys.
"""

# The kinds (checkpoints/kinds.py) are imported from here too, beside the keys they check.
from hetseq.checkpoints.kinds import (ANYTHING, Choice, Count, Either, Fields, Items,  # noqa: F401
                                      Kind, ListOf, MapOf, ModelState, Number, OfType, Optional,
                                      StateMismatch, Tensor, describe, like)

RESETS = ("optimizer", "lr-scheduler", "dataloader", "meters")   # the --reset-* flags


class Component:
    """A named part of a checkpoint. Each key a checkpoint holds is declared
    once, by the module that writes it: ``CONTROLLER = Component("controller")``,
    then ``OPTIMIZER = CONTROLLER.key("optimizer", reset="optimizer")``; its
    code and every reader use the names these return. ``reset``: the
    --reset-* flag (of RESETS) that leaves the key out on resume. ``kind``:
    what the value must be in every run (a Kind of hetseq/checkpoints/kinds.py; None:
    whatever the component's own ``state_kind()`` says when it loads),
    checked where any file is read (``check_declared``)."""

    declared: dict = {}   # "name" or "name.key" -> its reset flag (None: always loaded)
    kinds: dict = {}      # "name" or "name.key" -> its Kind, where declared with one

    def __init__(self, name, reset=None, kind=None):
        self.name = name
        self._declare(name, reset, kind)

    def key(self, name, reset=None, kind=None):
        """A key of this component's state; returns ``name``."""
        self._declare(f"{self.name}.{name}", reset, kind)
        return name

    @classmethod
    def _declare(cls, path, reset, kind):
        if reset is not None and reset not in RESETS:
            raise ValueError(f"checkpoint key {path}: reset '{reset}' is none of {RESETS}")
        if path in cls.declared:
            raise ValueError(f"checkpoint key {path} is declared twice")
        cls.declared[path] = reset
        if kind is not None:
            cls.kinds[path] = kind

    @classmethod
    def left_out(cls, cfg):
        """The keys a resume leaves out under the CheckpointConfig's --reset-* flags."""
        return {path for path, reset in cls.declared.items()
                if reset is not None and getattr(cfg, "reset_" + reset.replace("-", "_"))}

    @classmethod
    def check_declared(cls, state):
        """The kinds declared so far (by the modules imported), on the parts
        ``state`` holds: what any reader of a file may rely on (an elastic
        node reads the update count, fine-tuning the flags) before a run
        checks the rest. Raises StateMismatch."""
        for path, kind in cls.kinds.items():
            name, _, key = path.partition(".")
            if name not in state:
                continue
            part = state[name]
            if not key:
                kind.check(part, name)
            elif not isinstance(part, dict):
                raise StateMismatch(name, describe(part), "a dict")
            elif key in part:
                kind.check(part[key], path)

