"""Which ranks this command runs, worked out from flags or a launcher's environment.

Two ways to start a job:
  * HetSeq style: on every node ``train.py --distributed-world-size W
    --distributed-rank R --distributed-gpus G --distributed-init-method URL``;
    this node runs G processes with global ranks R .. R+G-1.
  * Under a launcher (torchrun, mpirun, srun) that starts one process per
    rank and describes it in environment variables.
``resolve_topology`` is a pure function of the flags and the environment, so
every rule here is unit-tested without starting processes.
"""

import dataclasses
import importlib
import os
import socket
import subprocess

import torch
import torch.distributed as dist

from hetseq.base.errors import UserError
from hetseq.base.logs import printable
from hetseq.base.sections import Section, flag, section


NODE_VARIABLE = "HETSEQ_NODE"     # the node's name, as hetseq-launch calls it
NODE_NAME_LIMIT = 64


def node_name(environ=os.environ):
    """This node's name: the one hetseq-launch gave it (``localhost#2``:
    the same in its lines and in hetseq-status), else this host's name."""
    given = printable(environ.get(NODE_VARIABLE, "")).strip()[:NODE_NAME_LIMIT]
    return given or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    first_rank: int          # global rank of the first process this command runs
    nprocs: int              # processes this command runs (spawned when > 1)
    init_method: str | None  # tcp://, file:// or env://; None when world_size == 1
    backend: str | None
    device_type: str         # "cuda" or "cpu"
    first_device: int        # local device index of the first process
    local_world_size: int    # processes on this node (threads per CPU process)
    launcher: str            # where the ranks came from, for messages
    store_hosted: bool = False  # this command's parent process hosts the TCP store


@dataclasses.dataclass(frozen=True)
class LauncherEnv:
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _ints(env, *names):
    """The named variables as ints, or None when any is missing."""
    if not all(name in env for name in names):
        return None
    try:
        return [int(env[name]) for name in names]
    except ValueError:
        raise UserError(f"environment variables {', '.join(names)} must be integers, got "
                        + ", ".join(f"{n}={env[n]!r}" for n in names))


def _lenient_int(env, name, default):
    """Optional per-node variables; SLURM writes some as '2(x3)', which we skip."""
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return default


def _launcher(name, rank, size, local_rank, local_size):
    def detect(env):
        values = _ints(env, rank, size)
        if values is None:
            return None
        return LauncherEnv(name, values[0], values[1], _lenient_int(env, local_rank, 0),
                           _lenient_int(env, local_size, 1))
    return detect


# Checked in order: torchrun may run under SLURM, MPI under SLURM sets both.
LAUNCHERS = (
    _launcher("torchrun/env://", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    _launcher("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _launcher("mpirun (Intel MPI/MPICH)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
              "MPI_LOCALNRANKS"),
    _launcher("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def detect_launcher(env):
    for detect in LAUNCHERS:
        found = detect(env)
        if found is not None:
            return found
    return None


BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}
CCL_MODULES = ("oneccl_bindings_for_pytorch", "torch_ccl")   # today's name, then the old one


def _ready_ccl():
    """Importing Intel's bindings registers the 'ccl' backend with torch."""
    for name in CCL_MODULES:
        try:
            importlib.import_module(name)
            return
        except ImportError:
            continue
    raise UserError(
        "--distributed-backend ccl needs Intel's oneCCL bindings for PyTorch (import name "
        "oneccl_bindings_for_pytorch), which are not on PyPI: install the wheel 'oneccl_bind_pt' "
        f"built for your torch ({torch.__version__.split('+')[0]}) from Intel's own wheel index, "
        "or build it from source; both are described at https://github.com/intel/torch-ccl. "
        "Or use --distributed-backend gloo, which every PyTorch build has")


def _ready_mpi():
    if not dist.is_mpi_available():
        raise UserError(
            "--distributed-backend mpi needs a PyTorch built from source against your MPI "
            "library (the wheels on PyPI have no MPI backend). mpirun can still start the ranks "
            "with the default gloo backend: HetSeq reads OMPI_COMM_WORLD_* / PMI_* itself "
            "(examples/launch/mpirun_hostfile.sh)")


BACKEND_READY = {"nccl": lambda: None, "gloo": lambda: None, "ccl": _ready_ccl, "mpi": _ready_mpi}


def ready_backend(backend):
    """Check (and for ccl, register) a backend; run in every rank's process, since
    a spawned rank starts without the parent's imports."""
    if backend not in BACKEND_READY:
        raise UserError(f"--distributed-backend {backend}: expected one of "
                        f"{', '.join(sorted(BACKEND_READY))}")
    BACKEND_READY[backend]()


def choose_backend(requested, device_type):
    backend = requested or BACKEND_FOR_DEVICE[device_type]
    if backend == "nccl" and device_type != "cuda":
        raise UserError("--distributed-backend nccl needs CUDA devices, but this process runs on "
                        "CPU; use gloo (the default on CPU) or drop --cpu")
    ready_backend(backend)
    return backend


def resolve_topology(launch, env, cuda_count, backend=None):
    """``launch``: the node's LaunchConfig (below); ``backend``: the job's
    --distributed-backend (None: from the device)."""
    device_type = "cpu" if launch.cpu or cuda_count == 0 else "cuda"
    launched = detect_launcher(env) if launch.distributed_rank is None else None
    if launched is not None and launched.world_size > 1:
        return _from_launcher(launch, backend, env, launched, device_type, cuda_count)
    return _from_flags(launch, backend, device_type, cuda_count)


def resolve_elastic(launch, cuda_count, backend=None):
    """An --elastic node's processes, whose ranks the meeting point gives
    out: --distributed-gpus of them (default: every visible GPU, or one CPU
    process). A Topology whose world and first rank are this node's own
    until a generation places it."""
    device_type = "cpu" if launch.cpu or cuda_count == 0 else "cuda"
    nprocs = launch.distributed_gpus or (cuda_count if device_type == "cuda" else 1)
    if nprocs < 1:
        raise UserError(f"--distributed-gpus {nprocs}: expected 1 or more processes on this node")
    _check_devices(device_type, launch.device_id, nprocs, cuda_count)
    return Topology(nprocs, 0, nprocs, launch.distributed_init_method,
                    choose_backend(backend, device_type), device_type, launch.device_id, nprocs,
                    "--elastic")


def _from_launcher(launch, backend, env, launched, device_type, cuda_count):
    flag_world = launch.distributed_world_size
    if flag_world is not None and flag_world != launched.world_size:
        raise UserError(f"--distributed-world-size {flag_world} disagrees with the "
                        f"{launched.name} environment (world size {launched.world_size}); "
                        "drop the flag when a launcher starts the job")
    if not 0 <= launched.rank < launched.world_size:
        raise UserError(f"{launched.name} gave rank {launched.rank} outside "
                        f"0..{launched.world_size - 1}")
    init = launch.distributed_init_method or _launcher_init_method(launch, env, launched)
    device = launched.local_rank if device_type == "cuda" else 0
    _check_devices(device_type, device, 1, cuda_count)
    return Topology(launched.world_size, launched.rank, 1, init,
                    choose_backend(backend, device_type), device_type, device,
                    launched.local_world_size, launched.name)


def _launcher_init_method(launch, env, launched):
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return "env://"
    if launched.name == "SLURM":
        host = _first_slurm_host(env)
        if host:
            return f"tcp://{host}:{launch.distributed_port}"
    raise UserError(f"started by {launched.name} with {launched.world_size} ranks but no address "
                    "to meet at: set MASTER_ADDR and MASTER_PORT, or pass "
                    "--distributed-init-method tcp://HOST:PORT (or file:///shared/path)")


def _first_slurm_host(env):
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[0] if out.split() else None


def _from_flags(launch, backend, device_type, cuda_count):
    world = launch.distributed_world_size or (cuda_count if device_type == "cuda" else 1)
    init = launch.distributed_init_method
    if world < 1:
        raise UserError(f"--distributed-world-size {world}: expected 1 or more processes in total")
    if world == 1:
        if init:
            raise UserError(f"--distributed-init-method {init} was given with a world size of 1; "
                            "set --distributed-world-size to the total number of processes, "
                            "or drop the init method for a single-process run")
        if launch.distributed_rank not in (None, 0):
            raise UserError(f"--distributed-rank {launch.distributed_rank} needs "
                            "--distributed-world-size larger than it")
        _check_devices(device_type, launch.device_id, 1, cuda_count)
        return Topology(1, 0, 1, None, None, device_type, launch.device_id, 1, "command line")
    first, nprocs = _ranks_of_this_node(launch, world, init, device_type, cuda_count)
    _check_devices(device_type, launch.device_id, nprocs, cuda_count)
    return Topology(world, first, nprocs, init,
                    choose_backend(backend, device_type), device_type,
                    launch.device_id, nprocs, "command line")


def _ranks_of_this_node(launch, world, init, device_type, cuda_count):
    first = launch.distributed_rank or 0
    if launch.distributed_no_spawn:
        nprocs = 1
        if init is None:
            raise UserError("--distributed-no-spawn with a world size of "
                            f"{world} needs --distributed-init-method so the processes can meet")
    elif init is None:
        # No address to meet at: every rank must run here, as child processes.
        nprocs = launch.distributed_gpus or world
        if first != 0 or nprocs != world:
            raise UserError(
                f"without --distributed-init-method all {world} processes run on this node, "
                f"but --distributed-rank {first} / --distributed-gpus {nprocs} say otherwise; "
                "for several nodes pass --distributed-init-method tcp://HOST:PORT on each")
    else:
        nprocs = launch.distributed_gpus or (cuda_count if device_type == "cuda" else 1)
    if nprocs < 1:
        raise UserError(f"--distributed-gpus {nprocs}: expected 1 or more processes on this node")
    if not 0 <= first < world:
        raise UserError(f"--distributed-rank {first} is outside 0..{world - 1} for "
                        f"--distributed-world-size {world}; it is the global rank of this "
                        "node's first process")
    if first + nprocs > world:
        raise UserError(
            f"--distributed-rank {first} with --distributed-gpus {nprocs} claims ranks "
            f"{first}..{first + nprocs - 1}, beyond --distributed-world-size {world}; each node's "
            "--distributed-rank is the sum of --distributed-gpus of the nodes before it")
    return first, nprocs


def _check_devices(device_type, first_device, nprocs, cuda_count):
    if device_type == "cuda" and first_device + nprocs > cuda_count:
        last = first_device + nprocs - 1
        raise UserError(f"this node would use CUDA devices {first_device}..{last}"
                        f" but only {cuda_count} are visible; lower --distributed-gpus or "
                        "--device-id, or pass --cpu")


@section
class LaunchConfig(Section):
    """Which ranks this node runs, on which devices, and where they meet
    (distributed/topology.py, rendezvous.py). The world size is compared
    when ranks claim their numbers, with a message of its own."""
    distributed_world_size: int | None = flag(
        None, type=int, metavar="N",
        help="processes in the whole job (default: visible GPUs, or 1 on CPU)")
    distributed_rank: int | None = flag(
        None, type=int, metavar="R",
        help="global rank of this node's FIRST process (default: 0, or from the "
             "torchrun/MPI/SLURM environment)")
    distributed_gpus: int | None = flag(
        None, type=int, metavar="G",
        help="processes to start on this node, one per device (CPU: G CPU processes); "
             "default: all ranks on one node, else the visible GPUs or 1")
    distributed_init_method: str | None = flag(
        None, metavar="URL",
        help="where ranks meet: tcp://HOST:PORT, file:///shared/path or env:// "
             "(default on one node: a free local port)")
    distributed_interface: str | None = flag(
        None, metavar="NAME",
        help="network interface this node's collectives bind to (gloo and nccl); default: "
             "the one that routes to the master address, or set GLOO_SOCKET_IFNAME / "
             "NCCL_SOCKET_IFNAME")
    distributed_port: int = flag(
        29500, type=int, help="port used with a SLURM node list when no init method is given")
    distributed_timeout: float = flag(
        600, type=float, metavar="SECONDS",
        help="how long start-up and every collective may wait (default: 600)")
    distributed_no_spawn: bool = flag(
        False, action="store_true",
        help="this process is exactly one rank (--distributed-rank), spawn nothing")
    # The secret itself never enters a config.
    job_secret_file: str | None = flag(
        None, metavar="PATH",
        help="a file, readable only by you, holding the job's secret (or set "
             "HETSEQ_JOB_SECRET): only nodes that know it may join (tcp:// only)")
    device_id: int = flag(0, type=int, names=("--local_rank", "--local-rank"),
                          help="CUDA device of this node's first process (default: 0)")
    cpu: bool = flag(False, action="store_true",
                     help="train on CPU even if CUDA is available (without it, a node that "
                          "finds no GPU says so in a warning)")
