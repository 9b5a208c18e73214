"""Benchmark-only tasks (loaded with --user-dir bench/tasks)."""

from . import hetero  # noqa: F401
