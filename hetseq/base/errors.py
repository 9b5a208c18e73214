"""Exceptions that end a run with one clear message instead of a traceback.

Entry points catch ``HetSeqError``, log its message and exit with its code:
2 for a mistake the user can fix (flags, data, set-up), 3 when another rank
was lost, 4 when training itself failed (ranks diverged, losses not
finite). Messages name the bad value, what was expected and how to fix it.
"""


class HetSeqError(Exception):
    exit_code = 1


class UserError(HetSeqError):
    """A problem in the user's command line, data or environment."""

    exit_code = 2


class PeerLost(HetSeqError):
    """Another rank died, hung or diverged; this one stops too."""

    exit_code = 3


class TrainingFailed(HetSeqError):
    """Ranks hold different parameters, or updates keep failing."""

    exit_code = 4
