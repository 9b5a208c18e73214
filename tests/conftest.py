import os
import subprocess
import sys
import time
from pathlib import Path

# One thread for every BLAS and OpenMP pool of a worker, set before numpy or
# torch loads one: three workers share two cores, and OpenBLAS's idle
# threads spin (Triton's interpreter computes tl.dot in numpy: a kernel
# test took 23% less CPU with one thread, its time the same). Children get
# the same through child_env. (threadpoolctl below, for a pool that a
# plugin loaded before this file.)
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "TORCHINDUCTOR_COMPILE_THREADS"):     # (inductor: no pool of compile processes)
    os.environ.setdefault(_pool, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import threadpoolctl
    threadpoolctl.threadpool_limits(1)
except ImportError:            # (scikit-learn, a [test] extra, brings it)
    pass

# Without a GPU, HetSeq's Triton kernels (hetseq/keyed/kernels/) run in Triton's
# interpreter on CPU tensors. Set before any kernel is defined: triton.jit
# reads it then, in this process and in every command a test starts.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The helpers tests import live in tests/machinery/ (settings, commands,
# in_process): this file holds only pytest's hooks and fixtures.
from machinery import commands, in_process  # noqa: E402
from machinery.commands import namespace_hosts  # noqa: E402
from machinery.settings import ROOT, SUITE_LIMIT_S, require  # noqa: E402

_SESSION = {}


def pytest_sessionstart(session):
    _SESSION["start"] = time.monotonic()
    # One thread for what a worker computes itself (the single-process
    # references, unit tests): the workers share 2 cores, and two threads
    # each spin on cores the other one holds (as the test subprocesses'
    # OMP_NUM_THREADS=1, child_env).
    torch.set_num_threads(1)


# The files that take longest in CI (2 cores, three workers, a file each at
# a time: docs/testing.md), longest first: pytest-xdist hands files out in
# the order collected, so these start first and the suite ends on short
# ones, not on one worker finishing a 3-minute file while a core idles.
LONGEST_FIRST = ("system/test_elastic.py", "system/test_glue.py", "system/test_kernels.py",
                 "system/test_checkpoint.py", "system/test_bert.py", "system/test_startup.py",
                 "system/test_launchers.py", "system/test_parity.py",
                 "system/test_elastic_shares.py", "system/test_sitting.py",
                 "system/test_multihost.py", "system/test_capacity.py", "system/test_sharding.py",
                 "system/test_mnist_example.py", "system/test_launch.py",
                 "system/test_kernel_report.py")


def pytest_collection_modifyitems(session, config, items):
    """LONGEST_FIRST's files first; the others, and the tests in each file,
    keep their order (a stable sort: every worker collects the same)."""
    gone = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    if gone:
        raise pytest.UsageError(f"conftest.LONGEST_FIRST names {gone}, not in tests/")
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    def where(item):
        path = Path(item.path)
        return path.relative_to(ROOT / "tests").as_posix() if path.is_relative_to(ROOT) else ""
    items.sort(key=lambda item: place.get(where(item), len(place)))


def pytest_sessionfinish(session, exitstatus):
    """Under HETSEQ_SUITE_LIMIT_S the suite fails when it ran longer (checked
    once, by the process that runs the session, not by each xdist worker)."""
    commands.close()
    in_process.close()
    if not SUITE_LIMIT_S or hasattr(session.config, "workerinput") or "start" not in _SESSION:
        return
    took = time.monotonic() - _SESSION["start"]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = (f"the suite took {took:.0f} s, {'over' if took > SUITE_LIMIT_S else 'within'} "
            f"HETSEQ_SUITE_LIMIT_S={SUITE_LIMIT_S:.0f}")
    if reporter is not None:
        reporter.write_line(line, red=took > SUITE_LIMIT_S, bold=True)
    if took > SUITE_LIMIT_S:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def mnist_data(tmp_path_factory):
    """IDX files of the MNIST example's demo data (examples/mnist), made once."""
    sys.path.insert(0, str(ROOT / "examples" / "mnist"))
    import make_demo_data
    data = tmp_path_factory.mktemp("mnist")
    make_demo_data.main(["--out", str(data), "--train", "768", "--test", "256"])
    return data


@pytest.fixture
def hosts():
    """Two namespace hosts on a 1 Gbit/s switch, for one test (links may be cut)."""
    with namespace_hosts() as cluster:
        yield cluster


@pytest.fixture
def three_hosts():
    """Three namespace hosts on a 1 Gbit/s switch, for one test."""
    with namespace_hosts(3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_hosts():
    """Two namespace hosts shared by a module's tests that leave them intact."""
    with namespace_hosts() as cluster:
        yield cluster


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB filesystem (root: tmpfs)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    require(done.returncode == 0, f"cannot mount a small tmpfs (needs root): "
                                  f"{done.stderr.strip()}")
    yield mount
    # Lazily: a failing test may leave a file open on it.
    subprocess.run(["umount", "--lazy", str(mount)], check=True)
