"""What every test shares: the checkout's paths, the toy task's flags, the
exact-parity recipe, the suite's settings from the environment (CI's
HETSEQ_TEST_STRICT), a test's needs (``require``) and free ports."""

import datetime
import importlib
import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TOY = ["--task", "toy", "--user-dir", str(ROOT / "tests" / "tasks")]


# Fast, quiet defaults for every test run of train.py.
QUIET = ["--cpu", "--no-progress-bar", "--distributed-timeout", "60"]


# Every process group a test starts gives up after this (gloo's default is
# 30 minutes: a hung test would hold CI that long).
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


# Set by .ci/run: a test whose needs (root, namespaces, Open MPI, a tmpfs, the
# [test] packages) are missing fails instead of skipping, so that a CI machine
# without them cannot pass with those promises untested.
STRICT = os.environ.get("HETSEQ_TEST_STRICT") == "1"


# Set by .ci/run: the whole suite must finish within this many seconds, or
# the run fails saying by how much (docs/testing.md). 0: no limit.
SUITE_LIMIT_S = float(os.environ.get("HETSEQ_SUITE_LIMIT_S") or 0)


# train.py commands on this host fork from a process that imported torch once
# (tests/machinery/zygote.py: 6 s of CPU less per command on 2 cores);
# HETSEQ_TEST_ZYGOTE=0 starts each one from nothing instead.
ZYGOTE = os.environ.get("HETSEQ_TEST_ZYGOTE", "1") == "1"


def require(ok, why):
    """Skip, saying ``why``, when what a test needs is missing here; fail
    instead under HETSEQ_TEST_STRICT=1 (CI). CUDA tests skip on their own."""
    if not ok:
        if STRICT:
            pytest.fail(f"{why} (HETSEQ_TEST_STRICT=1: this machine must have it)",
                        pytrace=False)
        pytest.skip(why)


def require_module(name):
    """The module ``name`` (a [test] extra), or ``require``'s skip/failure."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        require(False, f"needs the Python package {name} ({err}); pip install -e '.[test]'")


# Ports for tests come from a range of their own per xdist worker, below the
# kernel's ephemeral range (32768-60999): a port the OS handed out as free and
# then released could otherwise be taken by another worker's test, or by an
# outgoing connection, before the test binds it.
_PORTS = {"next": None}


def free_port():
    """A port nothing is bound to right now, from this worker's own range."""
    if _PORTS["next"] is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        _PORTS["next"] = 20000 + 2000 * (int(worker[2:] or 0) % 6)
    while True:
        port, _PORTS["next"] = _PORTS["next"], _PORTS["next"] + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def child_env(extra=None):
    """This environment without a launcher's variables or an interface choice
    (the tests show that HetSeq finds the interface by itself)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_",
                                "SLURM_", "TORCHELASTIC", "GLOO_SOCKET_IFNAME",
                                "NCCL_SOCKET_IFNAME", "HETSEQ_JOB_SECRET"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


UPDATE_LINE = r"\| epoch \d+ \| update \d+"     # rank 0's plain log line after an update


# The exact-parity recipe (docs/testing.md): the float64 toy with plain SGD,
# whose update is linear in the gradient (a wrong scale shows; Adam would
# hide it), at a fixed rate, unclipped, without validation.
EXACT_SGD = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--clip-norm",
             "0", "--disable-validation", "--toy-size", "100"]


EXACT = 1e-10       # float64: only the order of sums differs (docs/testing.md)


MNIST = ["--task", "mnist", "--user-dir", ROOT / "examples" / "mnist"]
