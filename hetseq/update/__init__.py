"""The update: how a rank's gradients become the job's update (the Controller,
the exchange modes, the --zero modes, precision, the per-update stats, agreement)."""
