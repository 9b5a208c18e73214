import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--task", "toy", "--user-dir", str(ROOT / "tests" / "tasks")]
# Fast, quiet defaults for every test run of train.py.
QUIET = ["--cpu", "--no-progress-bar", "--distributed-timeout", "60"]


def free_port():
    """A port the OS reports free right now (bound to 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(*args):
    return [sys.executable, str(ROOT / "train.py"), *QUIET, *map(str, args)]


def child_env(extra=None):
    """This environment without a launcher's variables or an interface choice
    (the tests show that HetSeq finds the interface by itself)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_",
                                "SLURM_", "TORCHELASTIC", "GLOO_SOCKET_IFNAME",
                                "NCCL_SOCKET_IFNAME"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def run_train(*args, env=None, timeout=180):
    return subprocess.run(train_cmd(*args), cwd=ROOT, env=child_env(env), capture_output=True,
                          text=True, timeout=timeout)


def run_nodes(commands, envs=None, timeout=180):
    """Start one train.py per entry of ``commands`` at once (each a 'node'); wait for all."""
    envs = envs or [None] * len(commands)
    procs = [subprocess.Popen(train_cmd(*cmd), cwd=ROOT, env=child_env(env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in zip(commands, envs)]
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


def assert_ok(results):
    for code, out in results:
        assert code == 0, out[-3000:]


def final_params(save_dir):
    state = torch.load(Path(save_dir) / "checkpoint_last.pt", weights_only=True)
    return state["controller"]["model"]


def leave_process_group():
    """End a test worker's process group the way a run ends (launch.py):
    collect first, since objects holding the group (DDP, FSDP's mesh) kept
    alive by reference cycles to interpreter exit make gloo abort there."""
    import gc
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture
def tmp(tmp_path):
    return tmp_path
