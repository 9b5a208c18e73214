"""Several nodes tried on one machine and checked before a launch: the README's
one-machine line runs (hetseq-launch --launcher local), an SSH failure on
this machine names the local way, ``hetseq-launch --check`` prints one table
and exits 2 with the fix for a host that cannot run its part, and a...

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/launch/test_launch_check.py."""

import re
import shlex
import socket
import subprocess
import sys
import time

from machinery.settings import ROOT, TOY, child_env, free_port
from hetseq.launch import check, hostfile, commands as planning


LAUNCH = [sys.executable, "-m", "hetseq.launch"]


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}      # this machine without GPUs, even where it has some


def launch(tmp_path, hosts_text, *args, env=None, timeout=180):
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_text)
    return subprocess.run([*LAUNCH, "--hostfile", hosts, *map(str, args)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout,
                          env=child_env({**NO_GPU, **(env or {})}))


def closed_port():
    """A local port where nothing listens (ssh to it: Connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_runs_two_nodes_with_uneven_batches_on_this_machine(tmp_path):
    """The README's own line (several-nodes section), briefly: 2 updates,
    this test's port and folder; no SSH anywhere."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Several nodes", 1)[1].split("\n## ", 1)[0]
    line, = [l for l in section.splitlines() if "--launcher local" in l and l.startswith("printf")]
    assert "--hostfile hosts-here" in line and "localhost slots=1 cpu" in line
    line = (line.replace("hetseq-launch ", f"{shlex.join(LAUNCH)} --master-port {free_port()} ")
            .replace(" train.py ", f" {shlex.quote(str(ROOT / 'train.py'))} ")
            .replace("--max-update 20", "--max-update 2")
            .replace("--log-interval 5", "--log-interval 1")
            .replace("--warmup-updates 5", "--warmup-updates 1")
            .replace("--save-dir checkpoints/two-nodes", f"--save-dir {tmp_path / 'run'}"))
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=child_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"localhost: .*\| update 2/2 \|", out), out[-4000:]
    assert re.search(r"ranks: 0 \S+ 12 \(75%\) \| 1 \S+ 4 \(25%\)", out), out[-4000:]
    assert re.search(r"localhost#2 \(ranks 1\): exit 0", out), out[-4000:]
    assert (tmp_path / "run" / "checkpoint_last.pt").exists()


def test_an_ssh_failure_on_this_machine_names_the_local_way(tmp_path):
    """The launch over ssh to 127.0.0.1 where no sshd listens: exit 255 and
    the way without SSH."""
    port = closed_port()
    done = launch(tmp_path, "127.0.0.1 slots=1 cpu\n", "--ssh-opts", f"-p {port}",
                  ROOT / "train.py", *TOY)
    out = done.stdout + done.stderr
    assert done.returncode == 255, out[-3000:]
    assert re.search(rf"hetseq-launch: 127\.0\.0\.1: could not be reached over ssh: .*port {port}"
                     r": Connection refused; 127\.0\.0\.1 is this machine: without an SSH server "
                     r"there, run every line here with --launcher local", out), out[-3000:]


def test_this_machine_is_known_by_every_name():
    for host in ("localhost", "me@localhost", "127.0.0.1", "127.0.1.1", "::1",
                 socket.gethostname(), f"me@{socket.gethostname()}"):
        assert check.is_this_machine(host), host
        assert "--launcher local" in check.local_hint(host)
    for host in ("nodeB", "me@cpu-box", "192.0.2.7"):
        assert not check.is_this_machine(host) and check.local_hint(host) == "", host


def test_check_on_two_local_nodes_prints_one_table_and_exits_0(tmp_path):
    done = launch(tmp_path, "localhost slots=1 cpu max-sentences=12\n"
                            "localhost slots=2 cpu max-sentences=4\n",
                  "--launcher", "local", "--check", ROOT / "train.py", *TOY)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "hetseq-launch --check: 2 node(s), meeting at tcp://localhost:29500"
    assert re.match(r"host\s+asks\s+has\s+free memory\s+interface\s+HetSeq \(code\)\s+torch$",
                    lines[1]), lines
    import torch
    import hetseq
    from hetseq.app.digests import code_digest
    for row, label, asks in ((lines[2], "localhost", "1 CPU"), (lines[3], "localhost#2", "2 CPU")):
        assert re.match(rf"{label}\s+{asks}\s+CPU only\s+[\d.]+ GB\s+lo 127\.0\.0\.1\s+"
                        rf"{re.escape(hetseq.__version__)} \({code_digest()[:8]}\)\s+"
                        rf"{re.escape(torch.__version__)}\s+ok$", row), row
    assert lines[-1] == "hetseq-launch: --check: every node can run its part"
    assert "summary" not in done.stdout         # nothing was launched


def test_a_gpu_line_on_a_host_without_gpus_is_refused_with_the_fix(tmp_path):
    """No 'cpu' on line 2 of a machine without GPUs: --check says so (exit 2,
    the fix), and so does the launch, before anything starts."""
    hosts = "localhost slots=1 cpu max-sentences=12\nlocalhost slots=2 max-sentences=4\n"
    checked = launch(tmp_path, hosts, "--launcher", "local", "--check", ROOT / "train.py", *TOY)
    assert checked.returncode == 2 and "Traceback" not in checked.stderr, checked.stdout
    assert re.search(r"localhost#2\s+2 GPU\s+CPU only .* PROBLEM$", checked.stdout, re.M)
    assert "hetseq-launch: localhost#2 (hostfile line 2): its line asks for 2 GPU(s) (slots=2, " \
        "no 'cpu') and torch there sees 0; fix: add 'cpu' to hostfile line 2 to run its 2 " \
        "rank(s) on CPU" in checked.stdout, checked.stdout
    assert checked.stdout.splitlines()[-1] == \
        "hetseq-launch: --check: 1 of 2 node(s) cannot run their part"
    started = launch(tmp_path, hosts, "--launcher", "local", "--master-port", free_port(),
                     ROOT / "train.py", *TOY, "--max-update", 2)
    assert started.returncode == 2 and "Traceback" not in started.stderr, started.stderr
    assert started.stderr.strip().splitlines()[-1] == (
        "hetseq-launch: error: hostfile line 2 (localhost#2): its line asks for 2 GPU(s) "
        "(slots=2, no 'cpu') and torch there sees 0; fix: add 'cpu' to hostfile line 2 to run "
        "its 2 rank(s) on CPU (hetseq-launch --check shows every host)")
    assert "summary" not in started.stdout and "update" not in started.stdout


def test_check_names_a_host_that_refuses_ssh_at_once(tmp_path):
    port = closed_port()
    began = time.monotonic()
    done = launch(tmp_path, "localhost slots=1 cpu\nnodeB slots=1 cpu\n", "--check",
                  "--ssh-opts", f"-p {port} -o ConnectTimeout=3", ROOT / "train.py", *TOY)
    assert done.returncode == 2 and time.monotonic() - began < check.DEADLINE_S, done.stdout
    assert re.search(rf"hetseq-launch: localhost \(hostfile line 1\): could not be reached over "
                     rf"ssh: .*port {port}: Connection refused; fix: .*localhost is this machine: "
                     r".*--launcher local", done.stdout), done.stdout
    assert re.search(r"hetseq-launch: nodeB \(hostfile line 2\): could not be reached over ssh",
                     done.stdout), done.stdout
    assert done.stdout.splitlines()[-1] == \
        "hetseq-launch: --check: 2 of 2 node(s) cannot run their part"


def test_a_host_that_never_answers_is_given_up_at_the_deadline(tmp_path):
    """A host that takes the connection and then says nothing (a hung
    mount, a stuck ssh): named once the deadline passes, its process gone."""
    marker = f"never-answers-{tmp_path.name}"

    class Silent:
        wraps = False

        def command(self, host, remote_dir, python, argv):
            return [sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"], None

        @staticmethod
        def unreachable(code):
            return False
    lines = hostfile.parse("nodeA slots=1 cpu\n")
    job = planning.make(lines, "train.py", TOY, 29500)
    began = time.monotonic()
    answer, = check.ask(job, lines, Silent(), "", sys.executable, {}, deadline=2)
    assert time.monotonic() - began < 20
    assert answer.facts is None and answer.problems[0][0] == "no answer within 2 s"
    gone = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert gone.stdout.strip() == "", gone.stdout
