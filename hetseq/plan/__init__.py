"""The plan of shares: each rank's part of the global batch and of the
sharded state, measured and re-planned.
Layer 9: imports base, keyed, checkpoints, distributed, update.
Tests: tests/unit/plan/, tests/system/."""
