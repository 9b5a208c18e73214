"""The test zygote (tests/machinery/zygote.py) runs a command as a fresh
``python`` would: its arguments, folder, environment, streams and exit code.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/project/test_zygote.py."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from machinery.zygote import Zygote, run


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


SCRIPT = textwrap.dedent("""
    import os, sys
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "name", __name__)
    print("env", os.environ.get("ZYGOTE_TEST"), file=sys.stderr)
    import helper_module
    print("path", helper_module.WHERE)
    sys.exit(int(sys.argv[1]))
""")


def test_a_child_runs_as_python_would(zygote, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_module.py").write_text("WHERE = 'lib'\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZYGOTE_TEST": "seen",
           "PYTHONPATH": str(tmp_path / "lib")}
    done = run(zygote, [tmp_path / "script.py", 7, "x"], tmp_path / "lib", env, timeout=60)
    assert done.returncode == 7, done.stderr
    assert f"argv ['7', 'x'] cwd {tmp_path / 'lib'} name __main__" in done.stdout
    assert "path lib" in done.stdout and done.stderr == "env seen\n"


@pytest.mark.parametrize("body, code", [("raise ValueError('boom')", 1), ("pass", 0),
                                        ("raise SystemExit('bad input')", 1),
                                        ("import os; os.kill(os.getpid(), 9)", -9),
                                        ("raise KeyboardInterrupt", -signal.SIGINT)])
def test_exit_codes_are_those_of_a_fresh_interpreter(zygote, tmp_path, body, code):
    (tmp_path / "script.py").write_text(body + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mine = run(zygote, [tmp_path / "script.py"], tmp_path, env, timeout=60)
    fresh = subprocess.run([sys.executable, tmp_path / "script.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert mine.returncode == fresh.returncode == code
    assert mine.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_a_killed_child_and_a_timeout_are_seen(zygote, tmp_path):
    (tmp_path / "script.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = zygote.popen([tmp_path / "script.py"], tmp_path, env)
    assert child.stdout.readline() == "up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.poll() is None
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run(zygote, [tmp_path / "script.py"], tmp_path, env, timeout=0.5)


def test_an_environment_read_at_start_needs_a_process_of_its_own(zygote):
    same = {**os.environ, "OMP_NUM_THREADS": "1", "HETSEQ_ANYTHING": "1"}
    assert zygote.serves(same)
    assert not zygote.serves({**same, "OMP_NUM_THREADS": "2"})
    assert not zygote.serves({**same, "PYTHONHASHSEED": "12345"})


HOST_VIEW = textwrap.dedent("""
    import os, socket
    print(socket.gethostname(), sorted(os.listdir("/sys/class/net")),
          socket.gethostbyname("hostB"), os.readlink("/proc/self/ns/net"))
    print(open("/etc/hosts").read())
""")


def test_a_child_on_a_namespace_host_sees_what_ip_netns_exec_shows(zygote, tmp_path):
    """Its hostname, its network's interfaces in /sys, its /etc/hosts and its
    network namespace: those of a command started through the host's own
    wrapper (``ip netns exec ... unshare --uts``)."""
    from machinery.commands import namespace_hosts
    (tmp_path / "view.py").write_text(HOST_VIEW)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with namespace_hosts(2) as cluster:
        forked = run(zygote, [tmp_path / "view.py"], tmp_path, env, 60, cluster.host(0))
        fresh = subprocess.run(cluster.command(0, [sys.executable, tmp_path / "view.py"]),
                               env=env, capture_output=True, text=True, timeout=60)
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    assert forked.stdout == fresh.stdout
    assert forked.stdout.startswith(f"hostA ['eth0', 'lo'] {cluster.addresses[1]} ")
    assert os.readlink("/proc/self/ns/net") not in forked.stdout


def test_what_the_imports_did_every_child_does_too(zygote, tmp_path):
    """hetseq's import sets TORCH_CPP_LOG_LEVEL where it is unset, before
    torch loads: a child sees it as a fresh ``python train.py`` does, and a
    command that sets its own starts anew. ``-m`` runs a preloaded module
    as __main__ with no more output than a fresh interpreter's."""
    (tmp_path / "level.py").write_text(
        "import os, hetseq\nprint(os.environ.get('TORCH_CPP_LOG_LEVEL'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    env["OMP_NUM_THREADS"] = "1"
    for argv in ([tmp_path / "level.py"], ["-m", "hetseq.reporting.status", "--help"]):
        mine = run(zygote, argv, tmp_path, env, timeout=60)
        fresh = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
        assert (mine.returncode, mine.stdout, mine.stderr) == \
            (fresh.returncode, fresh.stdout, fresh.stderr)
    assert mine.stdout.startswith("usage: hetseq-status") and mine.stderr == ""
    assert not zygote.serves({**env, "TORCH_CPP_LOG_LEVEL": "INFO"})


def test_a_bad_request_costs_that_request_not_the_zygote(zygote, tmp_path):
    import json
    import socket
    for payload in (b"not json", json.dumps({"argv": ["x.py"]}).encode()):    # no streams
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(zygote.path)
            conn.send(payload)
            assert "error" in json.loads(conn.recv(1 << 16))
    (tmp_path / "ok.py").write_text("print('still here')\n")
    done = run(zygote, [tmp_path / "ok.py"], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"},
               timeout=60)
    assert (done.returncode, done.stdout) == (0, "still here\n")
