"""Who runs which rank: flags and launcher environments, and the errors for bad ones."""

import pytest

from hetseq.app import cli
from hetseq.distributed.topology import resolve_topology
from hetseq.base.errors import UserError

from machinery.settings import TOY


def topo(*flags, env=None, cuda=0):
    _, job, node = cli.parse([*TOY, *map(str, flags)])
    return resolve_topology(node.launch, env or {}, cuda, job.distributed_backend)


def test_single_process_by_default():
    t = topo()
    assert (t.world_size, t.nprocs, t.init_method, t.device_type) == (1, 1, None, "cpu")


def test_one_node_spawns_every_rank_without_init_method():
    t = topo("--distributed-world-size", 3)
    assert (t.world_size, t.first_rank, t.nprocs, t.init_method, t.backend) == (3, 0, 3, None, "gloo")


def test_hetseq_style_node_flags():
    t = topo("--distributed-world-size", 8, "--distributed-rank", 4, "--distributed-gpus", 4,
             "--distributed-init-method", "tcp://10.0.0.1:11111", cuda=4)
    assert (t.first_rank, t.nprocs, t.device_type, t.backend) == (4, 4, "cuda", "nccl")


def test_cpu_flag_overrides_cuda():
    t = topo("--distributed-world-size", 2, "--cpu", cuda=4)
    assert (t.device_type, t.backend) == ("cpu", "gloo")


@pytest.mark.parametrize("env, name", [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "torchrun"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "Open MPI"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "Intel MPI"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "SLURM"),
])
def test_launcher_environments(env, name):
    t = topo(env=env)
    assert (t.world_size, t.first_rank, t.nprocs, t.init_method) == (2, 1, 1, "env://")
    assert name.split()[0] in t.launcher


def test_launcher_device_follows_local_rank():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert topo(env=env, cuda=2).first_device == 1


def test_explicit_rank_wins_over_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    t = topo("--distributed-world-size", 2, "--distributed-rank", 0, "--distributed-gpus", 1,
             "--distributed-init-method", "tcp://h:1", env=env)
    assert (t.first_rank, t.launcher) == (0, "command line")


@pytest.mark.parametrize("flags, env, cuda, words", [
    (["--distributed-world-size", 4, "--distributed-rank", 4, "--distributed-gpus", 1,
      "--distributed-init-method", "tcp://h:1"], None, 0, ["--distributed-rank 4", "0..3"]),
    (["--distributed-world-size", 4, "--distributed-rank", 2, "--distributed-gpus", 3,
      "--distributed-init-method", "tcp://h:1"], None, 0, ["ranks 2..4", "beyond"]),
    (["--distributed-init-method", "tcp://h:1"], None, 0, ["world size of 1"]),
    (["--distributed-world-size", 4, "--distributed-gpus", 2], None, 0,
     ["without --distributed-init-method", "--distributed-gpus 2"]),
    (["--distributed-world-size", 2, "--distributed-no-spawn"], None, 0, ["--distributed-no-spawn"]),
    (["--distributed-world-size", 2, "--distributed-backend", "nccl"], None, 0, ["nccl", "CPU"]),
    (["--distributed-world-size", 4], None, 2, ["CUDA devices 0..3", "only 2"]),
    (["--distributed-world-size", 3], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                                       "MASTER_PORT": "1"}, 0, ["disagrees", "world size 2"]),
    ([], {"PMI_RANK": "0", "PMI_SIZE": "2"}, 0, ["MASTER_ADDR", "--distributed-init-method"]),
])
def test_inconsistent_flags_name_the_problem(flags, env, cuda, words):
    with pytest.raises(UserError) as err:
        topo(*flags, env=env, cuda=cuda)
    for word in words:
        assert word in str(err.value)
