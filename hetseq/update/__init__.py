"""The update: how a rank's gradients become the job's update (the Controller,
the exchange modes, the --zero modes, precision, the per-update stats,
agreement). It knows nothing of the run that calls it.
Layer 8: imports base, keyed, checkpoints, distributed, optim, data.
Tests: tests/unit/update/, tests/system/ (parity with one process)."""
