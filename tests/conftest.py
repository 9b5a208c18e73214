import datetime
import importlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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

# Without a GPU, HetSeq's Triton kernels (hetseq/kernels/) run in Triton's
# interpreter on CPU tensors. Set before any kernel is defined: triton.jit
# reads it then, in this process and in every command a test starts.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from machinery.watched import Watched  # noqa: F401,E402  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
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
LONGEST_FIRST = ("test_elastic.py", "test_glue.py", "test_kernels.py", "test_checkpoint.py",
                 "test_bert.py", "test_startup.py", "test_launchers.py", "test_parity.py",
                 "test_elastic_shares.py", "test_sitting.py", "test_multihost.py",
                 "test_capacity.py", "test_sharding.py", "test_mnist_example.py",
                 "test_launch.py", "test_kernel_report.py")


def pytest_collection_modifyitems(session, config, items):
    """LONGEST_FIRST's files first; the others, and the tests in each file,
    keep their order (a stable sort: every worker collects the same)."""
    gone = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    if gone:
        raise pytest.UsageError(f"conftest.LONGEST_FIRST names {gone}, not in tests/")
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


def pytest_sessionfinish(session, exitstatus):
    """Under HETSEQ_SUITE_LIMIT_S the suite fails when it ran longer (checked
    once, by the process that runs the session, not by each xdist worker)."""
    if "zygote" in _SESSION:
        _SESSION.pop("zygote").close()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    if _OWN_REFERENCES:
        shutil.rmtree(REFERENCES, ignore_errors=True)
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


def train_cmd(*args):
    return [sys.executable, str(ROOT / "train.py"), *QUIET, *map(str, args)]


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


# Jobs run in a folder of their own: the default --save-dir (checkpoints/<task>)
# of a demo run in the checkout must not be resumed by a test.
RUN_DIR = Path(tempfile.mkdtemp(prefix="hetseq-tests-"))


def zygote():
    """This worker's zygote (started at its first use), or None when
    HETSEQ_TEST_ZYGOTE=0. A command whose environment it cannot serve
    (Zygote.serves) still starts anew."""
    if not ZYGOTE:
        return None
    if "zygote" not in _SESSION:
        from machinery.zygote import Zygote
        _SESSION["zygote"] = Zygote()
    return _SESSION["zygote"]


def _forks(env):
    return zygote() is not None and zygote().serves(env)


def run_train(*args, env=None, timeout=180):
    """``python train.py`` with ``args`` (and QUIET) on this host, waited for:
    a CompletedProcess with its text output."""
    env = child_env(env)
    if _forks(env):
        from machinery.zygote import run
        return run(zygote(), train_cmd(*args)[1:], RUN_DIR, env, timeout)
    return subprocess.run(train_cmd(*args), cwd=RUN_DIR, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_python(argv, env=None, timeout=None, cwd=None):
    """``python`` with ``argv``, waited for (subprocess.run's capture_output
    and text): forked from this worker's zygote when it serves ``env``
    (None: this environment), else started anew."""
    env = os.environ if env is None else env
    if _forks(env):
        from machinery.zygote import run
        return run(zygote(), list(map(str, argv)), cwd or os.getcwd(), env, timeout)
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_nodes(commands, envs=None, timeout=180):
    """Start one train.py per entry of ``commands`` at once (each a 'node'); wait for all."""
    envs = envs or [None] * len(commands)
    procs = [start_nodes([cmd], env=env)[0] for cmd, env in zip(commands, envs)]
    return finish(procs, timeout)


def assert_ok(results):
    """Every (exit code, output) of ``results`` is a success."""
    for code, out in results:
        assert code == 0, out[-3000:]


def node_commands(common, nodes, url=None):
    """One train.py argument list per node of one job: ``common``, then the
    node's own flags (``nodes``: per node a list of flags, or (processes,
    flags)), then the world size, the node's first rank and its process count,
    and the job's meeting point (``url``: tcp:// or file://; default: a free
    local port)."""
    layout = [node if isinstance(node, tuple) else (1, node) for node in nodes]
    world, first, commands = sum(procs for procs, _ in layout), 0, []
    url = url or f"tcp://127.0.0.1:{free_port()}"
    for procs, flags in layout:
        commands.append([*common, *flags, "--distributed-world-size", world,
                         "--distributed-rank", first, "--distributed-gpus", procs,
                         "--distributed-init-method", url])
        first += procs
    return commands


def run_job(common, nodes, url=None, envs=None, timeout=180):
    """Start every node of a job at once (``node_commands``); wait for all.
    Returns [(exit code, output)] per node."""
    return run_nodes(node_commands(common, nodes, url), envs, timeout)


def start_nodes(commands, cluster=None, on=None, env=None):
    """Start ``commands`` (train.py argument lists) without waiting. With a
    namespace ``cluster`` (tests/machinery/cluster.py), command i runs on its
    host ``on[i]`` (default: host i)."""
    procs = []
    for index, command in enumerate(commands):
        argv, options = train_cmd(*command), dict(cwd=RUN_DIR, env=child_env(env), text=True,
                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if cluster is not None:
            procs.append(cluster.popen(on[index] if on else index, argv, **options))
        elif _forks(options["env"]):
            procs.append(zygote().popen(argv[1:], **options))
        else:
            procs.append(subprocess.Popen(argv, **options))
    return procs


def children_of(pid):
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in found.split()]


def ranks_of(pid):
    """The rank processes a train.py process ``pid`` started: CPU ranks are
    forked from it (they have its command line) or from its fork server
    (launch.start_method)."""
    def command_line(process):
        return Path(f"/proc/{process}/cmdline").read_bytes()
    own, ranks = command_line(pid), []
    for child in children_of(pid):
        line = command_line(child)
        if line == own:
            ranks.append(child)
        elif b"forkserver" in line:
            ranks.extend(children_of(child))
    return ranks


UPDATE_LINE = r"\| epoch \d+ \| update \d+"     # rank 0's plain log line after an update


def finish(procs, timeout=180):
    """[(exit code, output)] of started processes, killing any left."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def final_params(save_dir):
    from hetseq.update.controller import CONTROLLER, MODEL
    state = torch.load(Path(save_dir) / "checkpoint_last.pt", weights_only=True)
    return state[CONTROLLER.name][MODEL]


def start_ranks(worker, nprocs, *args):
    """Run ``worker(rank, *args)`` in ``nprocs`` processes and wait for them,
    started as launch.start_method says (from a fork server that imported
    torch once: a test worker has threads)."""
    from hetseq.distributed.launch import start_ranks as start
    start(worker, args, nprocs, "cpu", "hetseq.run.loop")


def rank_queue():
    """A queue that ranks of ``start_ranks`` can put on."""
    import torch.multiprocessing as mp
    from hetseq.distributed.launch import start_method
    return mp.get_context(start_method("cpu", "hetseq.run.loop")).SimpleQueue()


def leave_process_group():
    """End a test worker's process group the way a run ends (launch.py):
    collect first, since objects holding the group (DDP, FSDP's mesh) kept
    alive by reference cycles to interpreter exit make gloo abort there."""
    import gc
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def build_controller(argv, ctx):
    """(Controller, task) of the flags ``argv``, in this process, for ``ctx``."""
    from hetseq import cli
    from hetseq.update.controller import Controller
    from hetseq.tasks import TASKS
    args, job, _ = cli.parse([str(a) for a in argv])
    task = TASKS.get(args.task)(args)
    return Controller(job, task, task.build_model(), ctx), task


def keyed(toy_data, rows, seed=1, epoch=1):
    """Rows of the toy's dataset as the training iterator gives them: a
    KeyedBatch, whose dropout draws belong to those rows (hetseq/randomness.py)."""
    from hetseq.randomness import KeyedBatch, sample_keys
    return KeyedBatch({"x": toy_data.x[rows], "y": toy_data.y[rows]},
                      sample_keys(seed, epoch, rows))


def portable(obj):
    """``obj`` as bytes a spawned worker can put on a queue and exit: tensors
    sent as they are would live in the worker's shared memory, gone with it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# The exact-parity recipe (docs/testing.md): the float64 toy with plain SGD,
# whose update is linear in the gradient (a wrong scale shows; Adam would
# hide it), at a fixed rate, unclipped, without validation.
EXACT_SGD = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--clip-norm",
             "0", "--disable-validation", "--toy-size", "100"]
EXACT = 1e-10       # float64: only the order of sums differs (docs/testing.md)
_ALONE = {}
# References shared by the session's workers (the folder is made by the
# process that imports this first, the one that runs the session, and
# inherited by its xdist workers): each trained once, not once per worker.
# Removed at the end by the process that made it (a worker inherits it).
_OWN_REFERENCES = "HETSEQ_TEST_REFERENCES" not in os.environ
if _OWN_REFERENCES:
    os.environ["HETSEQ_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="hetseq-references-")
REFERENCES = Path(os.environ["HETSEQ_TEST_REFERENCES"])


def alone(*argv):
    """The Controller state of one process trained with ``argv`` (nothing
    saved), trained once per distinct argv in the session (the first worker
    to ask trains it; the others wait for its file): the single-process
    reference."""
    key = tuple(map(str, argv))
    if key not in _ALONE:
        _ALONE[key] = _shared_reference(key)
    return _ALONE[key]


def _shared_reference(key):
    import fcntl
    import hashlib
    from machinery.jobs import run_alone
    path = REFERENCES / hashlib.sha256("\0".join(key).encode()).hexdigest()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # released when closed
        if path.exists():
            return torch.load(path, weights_only=False)
        state = run_alone([*key, "--no-save"])
        torch.save(state, path.with_suffix(".partial"))
        os.replace(path.with_suffix(".partial"), path)
        return state


MNIST = ["--task", "mnist", "--user-dir", ROOT / "examples" / "mnist"]


@pytest.fixture(scope="session")
def mnist_data(tmp_path_factory):
    """IDX files of the MNIST example's demo data (examples/mnist), made once."""
    sys.path.insert(0, str(ROOT / "examples" / "mnist"))
    import make_demo_data
    data = tmp_path_factory.mktemp("mnist")
    make_demo_data.main(["--out", str(data), "--train", "768", "--test", "256"])
    return data


def _cluster(size=2):
    from machinery import cluster as netns
    available, why = netns.available()
    require(available, f"namespace hosts: {why}")
    netns.remove_stale()
    return netns.VirtualCluster(size, rate="1gbit", zygote=zygote())


@pytest.fixture
def hosts():
    """Two namespace hosts on a 1 Gbit/s switch, for one test (links may be cut)."""
    with _cluster() as cluster:
        yield cluster


@pytest.fixture
def three_hosts():
    """Three namespace hosts on a 1 Gbit/s switch, for one test."""
    with _cluster(3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_hosts():
    """Two namespace hosts shared by a module's tests that leave them intact."""
    with _cluster() as cluster:
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
