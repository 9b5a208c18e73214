"""One rank's run: the training loop, validation, checkpoints, and the door
elastic jobs go through (seam.py), declared here so that elastic/ sits above.
Layer 13: imports every layer below (data, update, plan, reporting, tasks...).
Tests: tests/unit/run/, tests/system/."""
