"""A checkpoint's parts, keys and kinds, and its files: below the update,
the run, the tasks and bert, so that each of them declares or reads its
keys without importing the others.
Layer 3: imports base. Tests: tests/unit/checkpoints/, tests/system/."""
