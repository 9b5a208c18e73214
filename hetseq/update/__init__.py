"""The update: how a rank's gradients become the job's update. The core
(controller.py: one update, in train_step; exchange.py: the hooks a mode
supplies; step, stats, precision, members, agreement), zero/ (the --zero
modes: how the state is spread over the ranks) and modes/ (the exchange
modes, with local steps' outer exchange and its codecs). It knows nothing
of the run that calls it.
Layer 8: imports base, keyed, checkpoints, distributed, optim, data.
Tests: tests/unit/update/, tests/system/ (parity with one process)."""
