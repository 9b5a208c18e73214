"""Name -> class registries (tasks, optimizers, LR schedulers).

A registry replaces if/elif dispatch on names: components register themselves
with a decorator, the command line looks them up, and a miss lists what exists.
"""

import difflib

from hetseq.base.errors import UserError


class Registry:
    def __init__(self, kind, base=None, hint=""):
        self.kind = kind          # "task", "optimizer", ... used in messages
        self.hint = hint          # appended to the message for an unknown name
        self.base = base          # registered classes must subclass it
        self._entries = {}        # canonical name -> class
        self._aliases = {}        # any accepted name -> canonical name

    def register(self, name, aliases=()):
        """Decorator: ``@REGISTRY.register("name")``. Duplicates are an error."""

        def decorator(cls):
            if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(
                    f"cannot register {cls!r} as {self.kind} '{name}': "
                    f"it must be a subclass of {self.base.__name__}")
            for key in (name, *aliases):
                if key in self._aliases:
                    other = self._entries[self._aliases[key]]
                    raise ValueError(
                        f"{self.kind} name '{key}' is already registered by "
                        f"{other.__module__}.{other.__qualname__}; pick another name "
                        f"(registered {self.kind}s: {', '.join(self.names())})")
            self._entries[name] = cls
            for key in (name, *aliases):
                self._aliases[key] = name
            cls.registered_name = name
            return cls

        return decorator

    def get(self, name):
        if name not in self._aliases:
            near = difflib.get_close_matches(str(name), list(self._aliases), n=1)
            guess = f" (did you mean '{near[0]}'?)" if near else ""
            raise UserError(
                f"unknown {self.kind} '{name}'{guess}; registered {self.kind}s: "
                f"{', '.join(self.names()) or '(none)'}{self.hint}")
        return self._entries[self._aliases[name]]

    def names(self):
        return sorted(self._entries)

    def items(self):
        return sorted(self._entries.items())

    def __contains__(self, name):
        return name in self._aliases
