"""The MNIST example task, loaded with ``--user-dir examples/mnist``."""

from . import mnist_task  # noqa: F401  (registers the "mnist" task)
