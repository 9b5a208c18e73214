"""The launch recipes of examples/launch, run as a user would run them:
torchrun across two namespace hosts, mpirun on one host and from a hostfile
across two (an ssh stand-in enters the other host), the SLURM scripts under a
stand-in srun that starts each node's tasks on a namespace host."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from machinery.commands import assert_ok, final_params, finish, run_train
from machinery.in_process import alone, max_diff
from machinery.settings import ROOT, child_env, free_port, require

from machinery.parity import COMMON, reference
from machinery.settings import EXACT
LAUNCH = ROOT / "examples" / "launch"
STAND_INS = ROOT / "tests" / "stand_ins"     # srun, scontrol, an ssh for namespace hosts
MPI_AS_ROOT = dict(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)  # CI is root


@pytest.fixture
def mpirun():
    require(shutil.which("mpirun") is not None,
            "needs Open MPI's mpirun (apt-get install openmpi-bin)")
QUIET = "--cpu --no-progress-bar --distributed-timeout 60"


def hetseq_args(out, *extra):
    return " ".join(map(str, [QUIET, *COMMON, "--save-dir", out, *extra]))


def recipe_env(**values):
    return child_env({"PYTHON": sys.executable, **{k: str(v) for k, v in values.items()}})


def run_on_hosts(cluster, commands, timeout=180):
    """(host, argv, env) each; returns [(output, exit code)] once all succeeded."""
    procs = [cluster.popen(host, argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for host, argv, env in commands]
    results = finish(procs, timeout)
    assert_ok(results)
    return [(out, code) for code, out in results]


def test_torchrun_recipe_two_hosts_different_process_counts(hosts, tmp_path):
    out, script = tmp_path / "torchrun", ["bash", LAUNCH / "torchrun.sh"]
    common = dict(RDZV="hostA:29400", NNODES=2, HETSEQ_ARGS=hetseq_args(out))
    results = run_on_hosts(hosts, [(0, script, recipe_env(NPROC=2, BATCH=8, **common)),
                                   (1, script, recipe_env(NPROC=1, BATCH=16, **common))])
    text = "\n".join(out for out, _ in results)
    assert "ranks from torchrun" in text and "global batch 32" in text, text[-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT


def test_torchrun_restart_resumes_from_the_checkpoint_exactly(tmp_path):
    """torchrun --max-restarts: its store outlives the workers, so the
    restarted ones must not see the previous round's rank claims. Both
    workers fail at their 6th step; the restart resumes from the checkpoint
    of update 4 and ends at the weights of one uninterrupted process."""
    out = tmp_path / "restarted"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(ROOT / "train.py"),
            *hetseq_args(out, "--max-sentences", 16, "--max-update", 8,
                         "--save-interval-updates", 2, "--toy-fail-after", 5).split()]
    result = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    assert "toy: this node's data ends at call 6" in text and "4 updates done" in text, text[-3000:]
    expected = alone(*COMMON, "--max-update", 8, "--max-sentences", 32)
    assert max_diff(expected["model"], final_params(out)) < EXACT


def test_mpirun_recipe_one_host_two_ranks(mpirun, tmp_path):
    out = tmp_path / "mpi"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = recipe_env(HOSTFILE=hostfile, PPN=2, MASTER_PORT=free_port(), OMP_NUM_THREADS=1,
                     HETSEQ_ARGS=hetseq_args(out, "--max-sentences", 16), **MPI_AS_ROOT)
    result = subprocess.run(["bash", LAUNCH / "mpirun_hostfile.sh"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "ranks from mpirun (Open MPI)" in result.stderr, result.stderr[-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT


def test_mpirun_hostfile_recipe_across_two_hosts(hosts, mpirun, tmp_path):
    # mpirun runs on hostA and starts hostB's rank through an ssh stand-in
    # that enters hostB's namespace (Open MPI's plm_rsh_agent).
    out, hostfile = tmp_path / "mpi", tmp_path / "hostfile"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    env = recipe_env(HOSTFILE=hostfile, PPN=1, HETSEQ_ARGS=hetseq_args(out, "--max-sentences", 16),
                     OMPI_MCA_plm_rsh_agent=STAND_INS / "netns-rsh", NETNS_HOSTS=",".join(
                         f"{name}={ns}" for name, ns in zip(hosts.names, hosts.namespaces)),
                     **MPI_AS_ROOT)
    (log, _), = run_on_hosts(hosts, [(0, ["bash", LAUNCH / "mpirun_hostfile.sh"], env)])
    assert "hostA 10.213.0.1 (eth0): rank 0; hostB 10.213.0.2 (eth0): rank 1" in log, log[-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT


def sbatch(cluster, script, groups, **values):
    """Run an sbatch script as SLURM would on the allocation's first node: with
    the job's variables, and srun/scontrol stand-ins that start tasks on the
    namespace hosts named in ``groups``."""
    prefix = {name: cluster.command(index, []) for index, name in enumerate(cluster.names)}
    nodes = [node for group in groups for node in group["nodes"]]
    env = recipe_env(
        FAKE_SLURM=json.dumps({"groups": groups, "prefix": prefix}),
        PATH=f"{STAND_INS}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NODELIST_HET_GROUP_0=",".join(
            groups[0]["nodes"]), SLURM_SUBMIT_DIR=ROOT, SLURM_CPUS_PER_TASK=1, **values)
    result = subprocess.run(["bash", LAUNCH / script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stderr


def test_slurm_recipe_one_task_per_device(hosts, tmp_path):
    out = tmp_path / "slurm"
    log = sbatch(hosts, "slurm.sbatch", [{"nodes": ["hostA", "hostB"], "tasks_per_node": 1}],
                 BATCH=16, HETSEQ_ARGS=hetseq_args(out))
    assert "ranks from SLURM" in log, log[-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT


def test_slurm_heterogeneous_job_recipe(hosts, tmp_path):
    # Component 0: hostA, 1 process of 16; component 1: hostB, 2 processes of 8.
    out = tmp_path / "hetjob"
    log = sbatch(hosts, "slurm_hetjob.sbatch",
                 [{"nodes": ["hostA"], "tasks_per_node": 1}, {"nodes": ["hostB"], "tasks_per_node": 1}],
                 NODES0=1, GPUS0=1, BATCH0=16, NODES1=1, GPUS1=2, BATCH1=8,
                 HETSEQ_ARGS=hetseq_args(out))
    assert "hostB 10.213.0.2 (eth0): ranks 1-2" in log, log[-3000:]
    assert max_diff(reference(), final_params(out)) < EXACT


RUN = [*COMMON, "--no-save", "--max-sentences", 8, "--distributed-world-size", 2]


def test_ccl_backend_is_used_when_its_bindings_import():
    result = run_train(*RUN, "--distributed-backend", "ccl",
                       env={"PYTHONPATH": str(ROOT / "tests" / "fake_ccl")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joined the job at" in result.stderr and "(ccl," in result.stderr
    assert result.stderr.count("fake ccl: process group for rank") == 2, result.stderr[-3000:]


@pytest.mark.parametrize("backend, words", [
    ("ccl", ["oneccl_bind_pt", "not on PyPI", "github.com/intel/torch-ccl", "gloo"]),
    ("mpi", ["built from source", "mpirun can still start the ranks"]),
])
def test_missing_backend_says_what_to_install(backend, words):
    result = run_train(*RUN, "--distributed-backend", backend)
    assert result.returncode == 2, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
