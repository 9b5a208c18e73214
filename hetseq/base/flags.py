"""Every command's flags held to one standard: a misspelt flag is answered
in one line that names it and the nearest flag the command knows, exit 2,
no traceback::

    hetseq-launch: error: unknown flag --hostfiel: did you mean --hostfile? (all flags: --help)

``Parser`` is argparse's parser with that answer (hetseq-train's parser,
hetseq-launch's, hetseq-status's, hetseq-plot's and hetseq-secret's);
``nearest`` is the one rule of what is near, for names that are not
command-line flags (a hostfile's keys).
"""

import argparse
import math
import difflib

CUTOFF = 0.7
REQUIRED = "the following arguments are required"


def nearest(word, known):
    """The name of ``known`` nearest to ``word``, or None when none is near."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=CUTOFF)
    return close[0] if close else None


class _Probe(Exception):
    """An error while the parser looks again for unknown flags."""


def finite_float(text):
    """A number flag's value: a float that is finite (``nan``, ``inf`` refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with a misspelt flag answered in one line by the nearest
    flag it knows (Python 3.11's argparse prints the whole usage instead,
    and a misspelt required flag only gets "the following arguments are
    required"). Abbreviations are off: a flag added later must not change
    what a shortened one means. Words that an ``argparse.REMAINDER``
    positional takes (a script's own flags) are never checked."""

    def __init__(self, *args, allow_abbrev=False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self._probing = False
        # Every type=float flag, in this parser and its groups: nan or inf
        # would pass every range check below it (nan compares false).
        self.register("type", float, finite_float)

    def parse_known_args(self, args=None, namespace=None):
        self._words = args
        return super().parse_known_args(args, namespace)

    def error(self, message):
        if self._probing:
            raise _Probe(message)
        unknown = message.split("unrecognized arguments: ", 1)
        if len(unknown) == 2:
            message = self._name_unknown(unknown[1].split())
        elif message.startswith(REQUIRED):
            # A misspelt flag first: it may be the required one (--hostfiel).
            stray = self._unknown_words()
            if any(word.startswith("-") for word in stray):
                message = self._name_unknown(stray)
        self.exit(2, f"{self.prog}: error: {message} (all flags: --help)\n")

    def _name_unknown(self, words):
        flags = [word for word in words if word.startswith("-")]
        # A misspelt flag leaves its value behind too: name the flag only.
        return "; ".join(self._suggest(word) for word in flags or words)

    def _unknown_words(self):
        """The words the parser does not know, the same words parsed again
        with nothing required ([] when that parse fails too)."""
        required = [(action, action.required) for action in self._actions]
        self._probing = True
        try:
            for action, _ in required:
                action.required = False
            return super().parse_known_args(self._words, None)[1]
        except _Probe:
            return []
        finally:
            self._probing = False
            for action, was in required:
                action.required = was

    def _suggest(self, word):
        flag = word.split("=", 1)[0]
        if not flag.startswith("-"):
            return f"unexpected argument '{word}' (a value without a flag?)"
        close = nearest(flag, [o for action in self._actions for o in action.option_strings])
        return f"unknown flag {flag}" + (f": did you mean {close}?" if close else "")
