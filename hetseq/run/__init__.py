"""One rank's run: the training loop, validation, checkpoints, elastic generations."""
