"""Start-up through every supported path, as separate commands acting as nodes."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machinery.commands import (assert_ok, children_of, node_commands, ranks_of, run_nodes,
                                run_train, start_nodes, train_cmd)
from machinery.settings import ROOT, TOY, UPDATE_LINE, child_env, free_port
from machinery.watched import Watched

# A short run of the toy task; each command is one "node" with one process.
RUN = [*TOY, "--max-update", 3, "--max-sentences", 8, "--disable-validation", "--no-save"]


def two_nodes(url):
    return node_commands(RUN, [[], []], url)


def test_tcp_init_two_commands():
    assert_ok(run_nodes(two_nodes(f"tcp://127.0.0.1:{free_port()}")))


def test_file_init_two_commands_and_cleanup(tmp_path):
    init = tmp_path / "rendezvous"
    assert_ok(run_nodes(two_nodes(f"file://{init}")))
    assert not init.exists()   # a leftover file would break the next job on this path


def test_single_node_spawn_picks_its_own_port():
    result = run_train(*RUN, "--distributed-world-size", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joined the job at tcp://127.0.0.1:" in result.stderr


def test_cpu_ranks_fork_from_the_command_or_a_preloaded_server_and_cuda_ranks_are_spawned():
    """CPU ranks fork from the command while it has one thread, after it
    imported what each rank would; with a second thread (one that could
    hold a lock the copy inherits) from a server that imported torch once.
    CUDA ranks are spawned, since a fork after an import touched the driver
    could not use the GPU (spawn.start_method)."""
    probe = ("import sys, threading\n"
             "from multiprocessing import forkserver\n"
             "from hetseq.distributed.spawn import start_method\n"
             "print(start_method('cpu', 'hetseq.run.loop'), 'hetseq.run.loop' in sys.modules)\n"
             "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
             "print(start_method('cpu', 'hetseq.run.loop'))\n"
             "print(*forkserver._forkserver._preload_modules)\n"
             "print(start_method('cuda', 'hetseq.run.loop'))\n")
    done = subprocess.run([sys.executable, "-c", probe], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == ["fork True", "forkserver"], done.stdout
    assert {"torch", "torch._dynamo", "hetseq.run.loop"} <= set(lines[2].split()), lines[2]
    assert lines[3] == "spawn", done.stdout


def test_forked_ranks_never_walk_what_their_parent_imported(tmp_path):
    """Before CPU ranks fork, the command's objects (torch's modules) go to
    the collector's permanent generation, and the fork server's after its
    imports: a rank's collections skip them, so the kernel need not copy
    every page they sit on into it (bench/rank_start.py)."""
    (tmp_path / "frozen_probe.py").write_text(
        "import gc, os\n"
        "def rank(index, folder):\n"
        "    with open(os.path.join(folder, str(index)), 'w') as f:\n"
        "        f.write(str(gc.get_freeze_count()))\n")
    probe = ("import gc, sys, threading\n"
             "from hetseq.distributed import spawn\n"
             "import frozen_probe\n"
             "folder = sys.argv[1]\n"
             "print(gc.get_freeze_count(), spawn.start_method('cpu'))\n"
             "spawn.start_ranks(frozen_probe.rank, (folder + '/a',), 2)\n"
             "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
             "print(spawn.start_method('cpu'))\n"
             "spawn.start_ranks(frozen_probe.rank, (folder + '/b',), 2)\n")
    for way in "ab":
        (tmp_path / way).mkdir()
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], cwd=tmp_path,
                          env=child_env({"PYTHONPATH": os.pathsep.join(
                              [str(tmp_path), os.environ.get("PYTHONPATH", "")])}),
                          capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "fork", "forkserver"], done.stdout
    for way in "ab":
        counts = [int((tmp_path / way / str(i)).read_text()) for i in range(2)]
        assert min(counts) > 10_000, (way, counts)      # torch alone: about 100,000


def listening_inodes(port):
    """The socket inodes listening on 127.0.0.1:``port`` (/proc/net/tcp)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return {row[9] for row in rows if row[1] == f"0100007F:{port:04X}" and row[3] == "0A"}


def sockets_of(pid):
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    return {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}


@pytest.mark.parametrize("meeting", ["file", "its own store"])
def test_a_nodes_cpu_ranks_are_its_own_children(tmp_path, meeting):
    """Forked from the command (one thread under OMP_NUM_THREADS=1; the store
    a single node serves starts serving after they started): no fork server
    imports torch again. A forked rank does not keep the store's listener."""
    url = f"file://{tmp_path / 'meet'}" if meeting == "file" else None
    command = (node_commands([*RUN, "--max-update", 10**6], [(2, [])], url)[0] if url else
               [*RUN, "--max-update", 10**6, "--distributed-world-size", 2])
    proc = start_nodes([command])[0]
    watched = Watched(proc)
    try:
        watched.wait_for(UPDATE_LINE)
        children = [Path(f"/proc/{child}/cmdline").read_bytes()
                    for child in children_of(proc.pid)]
        ranks = ranks_of(proc.pid)
        if url is None:
            port = int(re.search(r"joined the job at tcp://127\.0\.0\.1:(\d+)",
                                 "\n".join(watched.lines)).group(1))
            listener = listening_inodes(port)
            assert listener and listener <= sockets_of(proc.pid), (port, listener)
            assert not any(listener & sockets_of(rank) for rank in ranks)
    finally:
        proc.kill()
        watched.finish(30)
    assert len(ranks) == 2 and not any(b"forkserver" in line for line in children), children


def test_a_node_with_threads_starts_its_ranks_from_a_fork_server():
    """A node with two threads (OpenMP's, started at torch's import) that
    serves its own store trains too: its ranks come from a fork server
    (start_method's test above), and the store serves after they started."""
    result = run_train(*RUN, "--distributed-world-size", 2, env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished its part: ranks 0-1" in result.stderr, result.stderr[-3000:]


def test_rank_from_intel_mpis_environment():
    """Two processes given Intel MPI's variables train as ranks 0 and 1. The
    other launchers' variables are read the same way (test_topology.py) and
    are run for real: torchrun (test_real_torchrun), Open MPI's mpirun and
    SLURM's srun (test_launchers.py); Intel MPI is not installed here."""
    port = str(free_port())
    envs = [{"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in (0, 1)]
    results = run_nodes([RUN, RUN], envs)
    assert_ok(results)
    assert "joined the job at env://" in results[0][1] and "ranks 0 of 2" in results[0][1]


def test_real_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(ROOT / "train.py"), "--cpu",
           "--no-progress-bar", *map(str, RUN)]
    result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joined the job at env://: ranks 0 of 2" in result.stderr


# ---- start-up mistakes: one clear message, exit code 2, no hang ----

def assert_fails(results, *words):
    for code, out in results:
        assert code == 2, out[-3000:]
    text = "\n".join(out for _, out in results)
    for word in words:
        assert word in text, text[-3000:]


def test_missing_rank_times_out_naming_it():
    # The timeout bounds the start-up of the ranks that do come too: 10 s
    # leaves room for a slow start on a loaded machine.
    url = f"tcp://127.0.0.1:{free_port()}"
    cmds = [[*RUN, "--distributed-world-size", 3, "--distributed-rank", r, "--distributed-gpus",
             1, "--distributed-init-method", url, "--distributed-timeout", 10] for r in (0, 1)]
    assert_fails(run_nodes(cmds), "waiting at", "for ranks [2] of 3")


def test_two_nodes_claiming_the_same_rank(tmp_path):
    url = f"file://{tmp_path / 'init'}"
    cmds = [[*RUN, "--distributed-world-size", 2, "--distributed-rank", 0, "--distributed-gpus",
             1, "--distributed-init-method", url, "--distributed-timeout", 10]] * 2
    assert_fails(run_nodes(cmds), "rank 0 was claimed by two processes")


def test_nodes_disagreeing_on_world_size():
    url = f"tcp://127.0.0.1:{free_port()}"
    cmds = [[*RUN, "--distributed-world-size", world, "--distributed-rank", rank,
             "--distributed-gpus", 1, "--distributed-init-method", url, "--distributed-timeout", 10]
            for world, rank in ((2, 0), (3, 1))]
    assert_fails(run_nodes(cmds), "pass the same world size on every node")


def test_busy_master_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        url = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        result = run_train(*RUN, "--distributed-world-size", 2, "--distributed-rank", 0,
                           "--distributed-gpus", 1, "--distributed-init-method", url,
                           "--distributed-timeout", 3)
    assert result.returncode == 2 and "rank 0 could not serve" in result.stderr, result.stderr


def test_unreachable_master():
    url = f"tcp://127.0.0.1:{free_port()}"
    result = run_train(*RUN, "--distributed-world-size", 2, "--distributed-rank", 1,
                       "--distributed-gpus", 1, "--distributed-init-method", url,
                       "--distributed-timeout", 2)
    assert result.returncode == 2 and "could not reach" in result.stderr, result.stderr


@pytest.mark.parametrize("flags, words", [
    (["--task", "nope"], ["unknown task 'nope'", "toy"]),
    (["--distributed-world-size", 2, "--distributed-rank", 2, "--distributed-gpus", 1,
      "--distributed-init-method", "tcp://127.0.0.1:1"], ["--distributed-rank 2", "0..1"]),
    (["--distributed-world-size", 2, "--distributed-rank", 1], ["without --distributed-init-method"]),
    (["--distributed-world-size", 2, "--distributed-init-method", "file:///no/such/dir/init",
      "--distributed-gpus", 1], ["folder /no/such/dir does not exist"]),
    (["--distributed-world-size", 2, "--distributed-init-method", "udp://x:1",
      "--distributed-gpus", 1], ["expected tcp://HOST:PORT"]),
    (["--optimizer", "lion"], ["unknown optimizer 'lion'"]),
])
def test_bad_flags_exit_2_with_message(flags, words):
    result = run_train(*RUN, *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr
    assert "Traceback" not in result.stderr


# ---- a file:// meeting point that outlived its job ----

def one_node(url, rank, timeout):
    return [*RUN, "--distributed-world-size", 2, "--distributed-rank", rank, "--distributed-gpus",
            1, "--distributed-init-method", url, "--distributed-timeout", timeout]


def test_rank_zero_that_gives_up_removes_its_file(tmp_path):
    path = tmp_path / "init"
    result = run_train(*one_node(f"file://{path}", 0, 3))
    assert result.returncode == 2 and "for ranks [1]" in result.stderr, result.stderr[-3000:]
    assert not path.exists()
    assert_ok(run_nodes(two_nodes(f"file://{path}")))         # the next job is not trapped


def test_file_left_by_a_killed_job_is_named(tmp_path):
    path = tmp_path / "init"
    timeout = 60
    dead = subprocess.Popen(train_cmd(*one_node(f"file://{path}", 0, timeout)), cwd=ROOT,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    # Rank 0 has claimed its rank (and so beats) once its record is in the file.
    while not (path.exists() and b"hetseq/who/0" in path.read_bytes()):
        assert time.time() < deadline and dead.poll() is None
        time.sleep(0.05)
    dead.kill()
    dead.wait()
    start = time.time()
    result = run_train(*one_node(f"file://{path}", 1, timeout))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "was left by an earlier job that stopped: its rank 0 (" in result.stderr
    assert f"Delete {path}" in result.stderr, result.stderr[-3000:]
    # Told by the stopped heartbeats within seconds, not by the timeout.
    assert time.time() - start < timeout / 3
