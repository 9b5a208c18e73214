"""Config sections whose fields are their flags: a flag is declared once.

A section is a small frozen dataclass that a component receives instead of
the whole flag namespace; each field declared with ``flag(...)`` is also the
flag ``--field-name``. This module imports nothing of HetSeq, so every
component may import it (docs/design.md, 'Two configurations: the job's and
the node's').
"""

import argparse
import math
import dataclasses

_FLAG = "hetseq.flag"
_NOT_A_FLAG = "hetseq.not_a_flag"


def frozen(value):
    """A list from argparse as the tuple a frozen section holds."""
    return tuple(value) if isinstance(value, list) else value


def flag(default=None, *, help, names=(), **argparse_kwargs):
    """A section field that is also the flag ``--field-name`` (``names``: its
    other spellings). ``default`` is the parser's; a list becomes a tuple in
    the section. ``help`` may be a function, called when the parser is built
    (a help that lists a registry's names, a --user-dir's included)."""
    spec = {"default": default, "help": help, "names": tuple(names), **argparse_kwargs}
    return dataclasses.field(default=frozen(default), metadata={_FLAG: spec})


def not_a_flag(default=None):
    """A section field that no flag sets (a digest the build computes): not in
    ``flags()``."""
    return dataclasses.field(default=default, metadata={_NOT_A_FLAG: True})


def section(cls):
    # Keyword-only: fields with a flag's default and nested sections without
    # one may come in any order.
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def flag_fields(cls):
    """The fields of section ``cls`` declared with ``flag`` (nested sections
    not followed): what ``add_args`` adds."""
    return [field for field in dataclasses.fields(cls) if _FLAG in field.metadata]


class Section:
    """A frozen dataclass read from the flags of the same names."""

    # Flags derived from others at build time: ``from_args`` computes them.
    @classmethod
    def from_args(cls, args, **derived):
        values = {f.name: frozen(getattr(args, f.name)) for f in dataclasses.fields(cls)
                  if f.name not in derived}
        return cls(**values, **derived)

    @classmethod
    def add_args(cls, group):
        """Adds every field declared with ``flag`` to ``group`` (an argparse
        parser or argument group), in the order they are declared."""
        for field in flag_fields(cls):
            spec = dict(field.metadata[_FLAG])
            names = ("--" + field.name.replace("_", "-"), *spec.pop("names"))
            if callable(spec["help"]):
                spec["help"] = spec["help"]()
            group.add_argument(*names, dest=field.name, **spec)

    def flags(self):
        """{flag dest: value} of this section (nested sections flattened)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Section):
                out.update(value.flags())
            elif field.name != "task_flags" and _NOT_A_FLAG not in field.metadata:
                out[field.name] = value
        out.update(dict(getattr(self, "task_flags", ())))
        return out


def given_flags(args, defaults, dests):
    """The flags among ``dests`` set to other than their default (``defaults``:
    the parser's, so a default is written once, where its flag is declared)."""
    return ["--" + dest.replace("_", "-") for dest in dests
            if getattr(args, dest) != defaults[dest]]


# ---- types of list flags (argparse reports the message, naming the flag) ----

def float_list(text):
    """'0.1,0.05' (or '[0.1, 0.05]') -> [0.1, 0.05]."""
    try:
        values = [float(part) for part in str(text).strip("()[]").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got '{text}'")
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got '{text}'")
    return values


def int_list(text):
    """'4,2,1' -> [4, 2, 1]."""
    try:
        return [int(part) for part in str(text).strip("()[]").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'")
