"""Benchmark-only tasks (loaded with --user-dir bench/tasks)."""

from . import hetero  # noqa: F401
from . import slowed_bert  # noqa: F401
