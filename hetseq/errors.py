"""The one exception type for mistakes a user can fix (flags, data, set-up).

Entry points catch it, print its message without a traceback and exit with
code 2. Messages name the bad value, what was expected and how to fix it.
"""


class UserError(Exception):
    """A problem in the user's command line, data or environment."""

    exit_code = 2
