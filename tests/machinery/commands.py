"""Commands a test starts: ``python train.py`` on this host (forked from
this worker's zygote where it can be), every node of a job at once, the
rank processes a command started, and what a job saved."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from machinery.settings import QUIET, ROOT, ZYGOTE, child_env, free_port, require

_SESSION: dict = {}


# Jobs run in a folder of their own: the default --save-dir (checkpoints/<task>)
# of a demo run in the checkout must not be resumed by a test.
RUN_DIR = Path(tempfile.mkdtemp(prefix="hetseq-tests-"))


def train_cmd(*args):
    return [sys.executable, str(ROOT / "train.py"), *QUIET, *map(str, args)]


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
    (spawn.start_method)."""
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
    from hetseq.checkpoints.keys import CONTROLLER, MODEL
    state = torch.load(Path(save_dir) / "checkpoint_last.pt", weights_only=True)
    return state[CONTROLLER.name][MODEL]


def namespace_hosts(size=2):
    """``size`` namespace hosts on a 1 Gbit/s switch (a context manager),
    commands on them forked from this worker's zygote."""
    from machinery import cluster as netns
    available, why = netns.available()
    require(available, f"namespace hosts: {why}")
    netns.remove_stale()
    return netns.VirtualCluster(size, rate="1gbit", zygote=zygote())


def close():
    """At the session's end: this worker's zygote stopped, the run folder removed."""
    import shutil
    if "zygote" in _SESSION:
        _SESSION.pop("zygote").close()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
