"""hetseq-launch: a hostfile and one command start every node (over real
SSH servers in namespace hosts), stop them together, and keep the job
secret out of every command line and log; hetseq-status shows the job.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/launch/test_launch.py."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from types import SimpleNamespace

from machinery.commands import namespace_hosts, final_params
from machinery.in_process import alone, max_diff
from machinery.settings import EXACT, EXACT_SGD, ROOT, TOY, child_env, free_port, require
from machinery.watched import Watched
from hetseq.launch import commands as planning
from hetseq.launch.node import STOP_S
from unit.launch.test_launch import make_plan


LAUNCH = [sys.executable, "-m", "hetseq.launch"]


PARITY = [*EXACT_SGD, "--max-update", 7]


def test_cli_refuses_a_job_flag_in_the_hostfile_in_one_line(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1 max-update=3\n")
    done = subprocess.run([*LAUNCH, "--hostfile", hosts, "--launcher", "local", "train.py", *TOY],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("hetseq-launch: error: hostfile line 1 "
                                                           "(localhost): max-update is a job flag")


def test_dry_run_prints_every_nodes_command_and_no_secret(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("nodeA slots=2 max-sentences=8\nnodeB slots=1 max-sentences=4\n")
    (tmp_path / ".hetseq_env").write_text("# forwarded\nWANDB_MODE=offline\n")
    secret = "3f" * 32
    done = subprocess.run([*LAUNCH, "--hostfile", hosts, "--dry-run", "--ssh-opts", "-p 2222",
                           "--env", "EXTRA=1", str(ROOT / "train.py"), *TOY],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=child_env({"HETSEQ_JOB_SECRET": secret}))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "hetseq-launch: 2 node(s), meeting at tcp://nodeA:29500, world size 3"
    assert lines[1].startswith("nodeA (ranks 0-1): ssh -p 2222 -T -o BatchMode=yes")
    assert "nodeA 'cd " in lines[1] and "--distributed-rank 0" in lines[1]
    assert lines[2].startswith("nodeB (ranks 2): ssh") and "--distributed-rank 2" in lines[2]
    assert "HETSEQ_JOB_SECRET=<elided>" in lines[3] and "WANDB_MODE" in lines[3]
    assert "EXTRA" in lines[3] and secret not in done.stdout + done.stderr


def sleeper(marker):
    return [sys.executable, "-m", "hetseq.launch.node", "--", sys.executable, "-c",
            f"import time; time.sleep(60)  # {marker}"]


def test_a_stop_while_nodes_start_stops_the_started_and_starts_no_more(tmp_path):
    """Ctrl-C between two nodes' starts: the first is stopped, the second
    never started, and the summary says so."""
    from hetseq.launch.launcher import Launch
    marker = str(tmp_path)
    job = make_plan("a slots=1\nb slots=1\n")

    class Transport:
        wraps = False

        def command(self, host, remote_dir, python, argv):
            if host == "b":
                launch.request_stop(signal.SIGINT, None)
            return sleeper(marker), str(ROOT)

        @staticmethod
        def unreachable(code):
            return False
    launch = Launch(job, Transport(), SimpleNamespace(remote_dir="", remote_python=""), {})
    launch.start()
    code = launch.run()
    assert code == 130 and [n.plan.label for n in launch.nodes] == ["a"]
    assert processes_with(marker) == []


def test_a_node_whose_lines_cannot_be_printed_still_ends_with_its_code(tmp_path):
    """A terminal that cannot show a character (or is gone) costs the line,
    never the node's end or its exit code."""
    import io
    import queue
    from hetseq.launch.nodes import RunningNode
    events, out = queue.Queue(), io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    command = [sys.executable, "-m", "hetseq.launch.node", "--", sys.executable, "-c",
               "print('caf\u00e9 \u2192'); raise SystemExit(3)"]
    plan = planning.NodePlan("a", "a", 1, 0, ())
    node = RunningNode(plan, command, str(ROOT), {}, events, out=out)
    assert events.get(timeout=60) is node and node.outcome.code == 3
    out.seek(0)
    assert out.buffer.getvalue().decode() == "a: caf? ?\n"


def test_a_killed_launcher_leaves_no_node_behind(tmp_path):
    """SIGKILL gives the launcher no chance to stop anything: its nodes see
    their input end (it held the only write end) and stop themselves."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost slots=1 max-sentences=8 save-dir={tmp_path / 'a'}\n"
                     f"localhost slots=1 max-sentences=8 save-dir={tmp_path / 'b'}\n")
    job = Watched(subprocess.Popen(
        [*LAUNCH, "--hostfile", hosts, "--launcher", "local", "--master-port", str(free_port()),
         str(ROOT / "train.py"), "--cpu", *TOY, "--max-update", "1000000", "--toy-sample-ms", "5"],
        cwd=ROOT, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    job.wait_for(r"localhost: .*\| update \d+", count=2, timeout=120)
    assert len(processes_with(str(tmp_path / "b"))) >= 2     # the wrapper and train.py
    job.proc.kill()
    job.finish(30)
    shutil.rmtree(os.path.dirname(secret_path(job)))   # what a SIGKILLed launcher leaves
    deadline = time.monotonic() + STOP_S + 10
    while processes_with(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(str(tmp_path)) == []


def nohup_from_a_terminal():
    """The launcher's signals as `nohup hetseq-launch` typed at a terminal
    leaves them: SIGHUP ignored, SIGQUIT at its default (a background job
    of a script, this test's own case perhaps, inherits SIGQUIT ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def test_nohup_keeps_the_job_and_ctrl_backslash_stops_it_and_removes_the_secret(tmp_path):
    """Started with SIGHUP ignored (nohup), the launcher keeps it ignored: its
    terminal closing costs no training. SIGQUIT (Ctrl-\\) stops every node and
    removes the secret it made, as Ctrl-C does."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost slots=1 max-sentences=8 save-dir={tmp_path / 'a'}\n")
    job = Watched(subprocess.Popen(
        [*LAUNCH, "--hostfile", hosts, "--launcher", "local", "--master-port", str(free_port()),
         str(ROOT / "train.py"), "--cpu", *TOY, "--max-update", "1000000", "--toy-sample-ms", "20"],
        cwd=ROOT, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=nohup_from_a_terminal))
    made = secret_path(job)
    job.wait_for(r"localhost: .*\| update \d+", timeout=120)
    os.kill(job.proc.pid, signal.SIGHUP)
    seen = len(re.findall(r"\| update \d+", job.output()))
    # Updates of 8 samples x 20 ms: 5 more span the launcher's POLL_S
    # (0.2 s) several times, so a stop it took would show by then.
    job.wait_for(r"localhost: .*\| update \d+", count=seen + 5, timeout=120)
    assert "SIGHUP" not in job.output() and job.proc.poll() is None
    os.kill(job.proc.pid, signal.SIGQUIT)
    try:
        code, out = job.finish(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still ran 60 s after SIGQUIT:\n{job.output()[-2000:]}")
    assert "stopping every node: SIGQUIT received" in out and code == 131, out[-3000:]
    assert not os.path.exists(made) and not os.path.exists(os.path.dirname(made))
    assert processes_with(str(tmp_path)) == []


def test_a_killed_node_wrapper_takes_its_command_along_and_its_end_stops_the_job(tmp_path):
    """SIGKILL to one node's wrapper: its train.py dies with it (it cannot be
    told, so the kernel tells it), the launcher stops the other node, and the
    exit code is the killed node's 137, not the 143 of the node it stopped."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost slots=1 max-sentences=8 save-dir={tmp_path / 'a'}\n"
                     f"localhost slots=1 max-sentences=8 save-dir={tmp_path / 'b'}\n")
    job = Watched(subprocess.Popen(
        [*LAUNCH, "--hostfile", hosts, "--launcher", "local", "--master-port", str(free_port()),
         str(ROOT / "train.py"), "--cpu", *TOY, "--max-update", "1000000",
         "--toy-hold-until", str(tmp_path / "never")],
        cwd=ROOT, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    job.wait_for(r"localhost#2: .*joined the job", timeout=120)
    wrapper, = [pid for pid, line in processes_with(str(tmp_path / "b"))
                if "hetseq.launch.node" in line]
    os.kill(wrapper, signal.SIGKILL)
    code, out = job.finish(60)
    assert code == 137, out[-3000:]
    assert "stopping every node: localhost#2 exited with 137" in out, out[-3000:]
    assert re.search(r"localhost \(ranks 0\): exit 143 \(stopped by hetseq-launch\)", out), \
        out[-3000:]
    assert processes_with(str(tmp_path)) == []


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    """Hosts A-D; an sshd on A, B and C (D has none: it cannot be reached)."""
    from machinery import sshd
    ok, why = sshd.available()
    require(ok, f"SSH servers: {why}")
    with namespace_hosts(4) as cluster, \
            sshd.SshServers(cluster, tmp_path_factory.mktemp("ssh"), [0, 1, 2]) as servers:
        yield cluster, servers


def launch(ssh_hosts, tmp_path, hostfile_text, *args):
    """hetseq-launch on host A, as a Watched process."""
    cluster, servers = ssh_hosts
    hosts = tmp_path / "hosts"
    hosts.write_text(hostfile_text)
    return Watched(cluster.popen(0, [*LAUNCH, "--hostfile", hosts, "--ssh-opts", servers.opts,
                                     str(ROOT / "train.py"), "--cpu", *map(str, args)],
                                 cwd=ROOT, env=child_env(), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT))


def processes_with(text):
    """[(pid, command line)] of live processes whose command line holds ``text``."""
    found, needle = [], text.encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            state = open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != b"Z" and int(pid) != os.getpid():
            found.append((int(pid), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def secret_path(watched):
    watched.wait_for(r"--job-secret-file \S+", timeout=60)
    return re.search(r"--job-secret-file (\S+)", watched.output()).group(1)


def test_a_heterogeneous_job_over_ssh_equals_one_process_and_never_shows_its_secret(
        ssh_hosts, tmp_path):
    """Three hosts, 1 + 2 + 1 ranks with 8, 6 and 12 sequences each (the
    hostfile's): one process on the summed 32. While it trains, hetseq-status
    (run on host B) shows every rank on its host, and the launcher's new
    secret is in no process's command line; afterwards in no output or file."""
    cluster, _ = ssh_hosts
    saves = [tmp_path / name for name in "abc"]
    # The job is held at its third step until hetseq-status has seen it: it
    # cannot end (and take its secret file along) first, however slow a
    # start on a loaded machine (once it had, under a 1-s-per-step slowdown).
    seen_it = tmp_path / "seen"
    job = launch(ssh_hosts, tmp_path,
                 f"hostA slots=1 max-sentences=8 save-dir={saves[0]}\n"
                 f"hostB slots=2 max-sentences=6 save-dir={saves[1]}\n"
                 f"hostC slots=1 max-sentences=12 save-dir={saves[2]}\n",
                 *PARITY, "--toy-hold-until", seen_it, "--toy-hold-from", 3)
    path = secret_path(job)
    secret = open(path).read().strip()
    job.wait_for(r"hostA: .*\| update 2/7", timeout=120)
    # (With the job id the launcher minted: the secret's salt.)
    job_id = re.search(r"hetseq-status tcp://\S+:29500/(\S+)", job.output()).group(1)
    seen = cluster.run(1, [sys.executable, "-m", "hetseq.reporting.status",
                           f"tcp://hostA:29500/{job_id}", "--json", "--job-secret-file", path],
                       timeout=60)
    in_command_lines = processes_with(secret)
    seen_it.touch()
    code, out = job.finish(180)
    assert code == 0, out[-4000:]
    assert seen.returncode == 0, seen.stderr
    view = json.loads(seen.stdout)
    assert [(r["rank"], r["host"], r["batch"]) for r in view["ranks"]] == \
        [(0, "hostA", 8), (1, "hostB", 6), (2, "hostB", 6), (3, "hostC", 12)]
    assert [r["node"] for r in view["ranks"]] == ["hostA", "hostB", "hostB", "hostC"]
    assert view["planned"] == 7 and view["update"] in (1, 2), view     # held at the third
    assert in_command_lines == [], in_command_lines
    assert max_diff(alone(*PARITY, "--max-sentences", 32)["model"], final_params(saves[0])) \
        < EXACT
    # One line per node at the end, each node's lines under its host's name.
    assert re.search(r"hostB \(ranks 1-2\): exit 0, \d+ s", out), out[-3000:]
    assert "hostC: " in out and "hostB: " in out
    assert secret not in out and not os.path.exists(path)
    for save in saves:
        for file in save.rglob("*"):
            assert file.is_dir() or secret.encode() not in file.read_bytes(), file


def test_ctrl_c_stops_every_node_and_an_elastic_job_goes_on_without_a_host_that_is_down(
        ssh_hosts, tmp_path):
    """--elastic over A, B and D (no sshd): D is named, A and B train as
    generation 1; Ctrl-C on the launcher then leaves no process on any host."""
    job = launch(ssh_hosts, tmp_path,
                 f"hostA slots=1 max-sentences=8 save-dir={tmp_path / 'a'}\n"
                 f"hostB slots=1 max-sentences=8 save-dir={tmp_path / 'b'}\n"
                 f"hostD slots=1 max-sentences=8 save-dir={tmp_path / 'd'}\n",
                 *TOY, "--elastic", "--min-nodes", 2, "--global-batch-size", 16,
                 "--max-update", 10**6, "--toy-sample-ms", 5, "--distributed-timeout", 30)
    # (ssh writes host names in lower case)
    job.wait_for(r"hetseq-launch: hostD: could not be reached over ssh: .*hostd", timeout=60)
    job.wait_for(r"hostA: .*\| update \d+", count=3, timeout=120)
    assert processes_with(str(tmp_path / "b")), "host B's node is not running"
    # Any member's address shows the job: host B's store points to the leader's.
    cluster, _ = ssh_hosts
    # (The installed command: it must import without the package's cycle.)
    # (With the job id the launcher minted: the secret's salt.)
    job_id = re.search(r"hetseq-status tcp://\S+:29500/(\S+)", job.output()).group(1)
    seen = cluster.run(2, [os.path.join(os.path.dirname(sys.executable), "hetseq-status"),
                           f"tcp://hostB:29500/{job_id}", "--job-secret-file", secret_path(job)],
                       timeout=60)
    assert seen.returncode == 0, seen.stderr
    # The time left: 'measuring' before a rate (the board may still show
    # update 1), then a rate's plus the validation and saves still due (the
    # last save at --max-update, not yet timed: reporting/progress.py).
    assert re.match(r"tcp://10\.213\.0\.1:29500 \| update \d+/1000000 \| (?:measuring time "
                    r"left|[\d:]+ left(?: \+ [a-z ]+ \(not yet timed\))?) \| generation 1 \| "
                    r"2 node\(s\) on 2 host\(s\), "
                    r"2 rank\(s\) \| training as of \d+ s ago", seen.stdout), seen.stdout
    assert re.search(r"0  hostA\s+8\s+50%", seen.stdout) and \
        re.search(r"1  hostB\s+8\s+50%", seen.stdout), seen.stdout
    os.kill(job.proc.pid, signal.SIGINT)
    code, out = job.finish(60)
    assert code != 0 and "stopping every node: SIGINT received" in out, out[-3000:]
    assert re.search(r"hostD \(1 rank\(s\), given at the meeting point\): unreachable \(the job "
                     r"went on without it: --elastic\)", out), out[-3000:]
    assert processes_with(str(tmp_path)) == []


def test_an_unreachable_host_is_named_and_the_others_are_stopped(ssh_hosts, tmp_path):
    job = launch(ssh_hosts, tmp_path,
                 f"hostA slots=1 max-sentences=8 save-dir={tmp_path / 'a'}\n"
                 f"hostD slots=1 max-sentences=8 save-dir={tmp_path / 'd'}\n",
                 *TOY, "--max-update", 10**6)
    job.wait_for(r"stopping every node: hostD could not be reached", timeout=60)
    code, out = job.finish(60)
    assert code == 255, out[-3000:]
    assert len(re.findall(r"hetseq-launch: hostD: could not be reached over ssh: ssh: connect "
                          r"to host hostd port 22: Connection refused", out)) == 1, out[-3000:]
    assert "stopping every node: hostD could not be reached" in out
    assert processes_with(str(tmp_path)) == []


def test_a_signal_before_the_first_node_starts_stops_with_its_reason():
    """Ctrl-\\ while the launcher prepares: no node starts, the summary says
    why, and the exit code is the signal's (128 + N), as after a start."""
    from types import SimpleNamespace
    from hetseq.launch.launcher import Launch
    plan = SimpleNamespace(label="nodeA", host="nodeA", argv=["train.py"],
                           ranks=lambda: "rank 0")
    transport = SimpleNamespace(command=lambda *args: (["true"], None))
    job = SimpleNamespace(nodes=[plan], elastic=False)
    launch = Launch(job, transport, SimpleNamespace(remote_dir=".", remote_python="python"), {})
    said = []
    launch.say = said.append
    launch.request_stop(signal.SIGQUIT, None)
    launch.start()
    assert launch.nodes == []
    assert launch.run() == 128 + signal.SIGQUIT
    assert "stopping every node: SIGQUIT received" in said, said
    assert "  nodeA (rank 0): not started (SIGQUIT received)" in said, said
