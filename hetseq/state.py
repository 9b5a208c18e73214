"""The parts of a checkpoint and their keys, each declared once by the module
that writes it, and which --reset-* flag leaves it out on resume.

Below both the update (update/state_keys.py declares the Controller's) and
the run (run/checkpoint.py, which saves and restores them), so neither
imports the other for its keys.
"""

RESETS = ("optimizer", "lr-scheduler", "dataloader", "meters")   # the --reset-* flags


class Component:
    """A named part of a checkpoint. Each key a checkpoint holds is declared
    once, by the module that writes it: ``CONTROLLER = Component("controller")``,
    then ``OPTIMIZER = CONTROLLER.key("optimizer", reset="optimizer")``; its
    code and every reader use the names these return. ``reset``: the
    --reset-* flag (of RESETS) that leaves the key out on resume."""

    declared = {}   # "name" or "name.key" -> its reset flag (None: always loaded)

    def __init__(self, name, reset=None):
        self.name = name
        self._declare(name, reset)

    def key(self, name, reset=None):
        """A key of this component's state; returns ``name``."""
        self._declare(f"{self.name}.{name}", reset)
        return name

    @classmethod
    def _declare(cls, path, reset):
        if reset is not None and reset not in RESETS:
            raise ValueError(f"checkpoint key {path}: reset '{reset}' is none of {RESETS}")
        if path in cls.declared:
            raise ValueError(f"checkpoint key {path} is declared twice")
        cls.declared[path] = reset

    @classmethod
    def left_out(cls, cfg):
        """The keys a resume leaves out under the CheckpointConfig's --reset-* flags."""
        return {path for path, reset in cls.declared.items()
                if reset is not None and getattr(cfg, "reset_" + reset.replace("-", "_"))}
