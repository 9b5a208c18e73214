"""Tasks used only by the tests, loaded with ``--user-dir tests/tasks``."""

from . import toy  # noqa: F401
