"""The exact-parity recipe's toy job and its single-process reference
(docs/testing.md): every parity test compares a split job against these."""

from machinery.in_process import alone
from machinery.settings import EXACT_SGD

COMMON = [*EXACT_SGD, "--max-update", "7"]


def params(state):
    return state["model"] if "model" in state else state["controller"]["model"]


def reference(*extra):
    """One process with the whole global batch of 32."""
    return alone(*COMMON, *extra, "--max-sentences", 32)["model"]
