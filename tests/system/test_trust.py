"""Code that another user can plant never runs (issue 58, item 1), and the
launcher's own faults end in one line (item 7): a shared launch folder,
--remote-dir, hostfile or --user-dir is refused with its owner and mode; no
wrapper or probe imports from its working folder; --compile keeps its

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/base/test_trust.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from machinery.settings import ROOT, child_env
from hetseq.launch import check, hostfile, commands as planning, transport as transports
from unit.base.test_trust import NOBODY, folder, plant


# As a user runs it: the console script, whose own folder (not the working
# one) is on its sys.path. (``python -m hetseq.launch`` in a shared folder
# would import from it before HetSeq's first line: Python's doing.)
LAUNCH = [sys.executable, "-P", "-m", "hetseq.launch"]


def run_launch(cwd, hosts, *args, timeout=60):
    return subprocess.run([*LAUNCH, "--hostfile", str(hosts), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=child_env())


def test_a_shared_launch_folder_is_refused_and_a_planted_module_never_runs(tmp_path):
    """A json.py dropped by nobody into a launch folder of mode 1777 ran as
    root in the node wrapper and the probe (issue 58): now the launcher
    refuses the folder in one line, and so does a wrapper started there."""
    marker = tmp_path / "planted-ran"
    shared = folder(tmp_path / "shared", 0o1777)
    plant(shared, marker)
    (shared / "hosts").write_text("localhost slots=1 cpu\n")
    for args in (["--check"], []):
        done = run_launch(shared, shared / "hosts", "--launcher", "local", *args,
                          ROOT / "train.py", "--task", "bert")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"the launch folder {shared}: {shared}: mode 1777, owner root (uid 0): others " \
               "may write it" in done.stderr
        assert "mkdir -m 700" in done.stderr and "chmod" not in done.stderr
    # --remote-dir: the nodes' folder, the launcher's own being fine.
    mine = folder(tmp_path / "mine")
    (mine / "hosts").write_text("localhost slots=1 cpu\n")
    done = run_launch(mine, mine / "hosts", "--launcher", "local", "--remote-dir", shared,
                      ROOT / "train.py", "--task", "bert")
    assert done.returncode == 2 and f"--remote-dir {shared}: " in done.stderr, done.stderr
    # A wrapper started there by hand (or over ssh) refuses before it reads a byte.
    wrapper = subprocess.run(transports.node_command(sys.executable, ["-c", "pass"]),
                             cwd=shared, input='{"env": {}}\n', capture_output=True, text=True,
                             timeout=60, env=child_env())
    assert wrapper.returncode == 2 and "the launch folder" in wrapper.stderr, wrapper.stderr
    # An empty PYTHONPATH entry is the working folder too (export
    # PYTHONPATH=$PYTHONPATH:/x with none set): judged before any import.
    wrapper = subprocess.run(transports.node_command(sys.executable, ["-c", "pass"]),
                             cwd=shared, input='{"env": {}}\n', capture_output=True, text=True,
                             timeout=60, env=child_env({"PYTHONPATH": ":/nowhere"}))
    assert wrapper.returncode == 2 and "mode 1777" in wrapper.stderr, wrapper.stderr
    assert not marker.exists()
    # A folder of another user's, however closed, is theirs.
    theirs = folder(tmp_path / "theirs", 0o755, owner=NOBODY)
    (mine / "hosts").write_text("localhost slots=1 cpu\n")
    done = run_launch(theirs, mine / "hosts", "--launcher", "local", "--check",
                      ROOT / "train.py", "--task", "bert")
    assert done.returncode == 2 and "its owner could change it" in done.stderr, done.stderr
    assert not marker.exists()


def test_wrappers_and_probes_never_import_from_their_folder(tmp_path):
    """In a folder that passes the check, a json.py still never runs: the
    wrapper and the probe start without the working folder on sys.path. The
    control: ``python -m`` there runs it."""
    marker = tmp_path / "planted-ran"
    mine = folder(tmp_path / "mine")
    plant(mine, marker, owner=0)
    # (Its input stays open while it runs: its end would stop the command.)
    wrapper = subprocess.Popen(
        transports.node_command(sys.executable, transports.module_argv("hetseq.launch.probe")),
        cwd=mine, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=child_env())
    wrapper.stdin.write(b'{"env": {}}\n')
    wrapper.stdin.flush()
    said = wrapper.stdout.read().decode()
    assert wrapper.wait(60) == 0, said
    wrapper.stdin.close()
    assert "hetseq-probe {" in said
    assert not marker.exists()
    control = subprocess.run([sys.executable, "-m", "hetseq.launch.probe"], cwd=mine,
                             capture_output=True, text=True, timeout=60, env=child_env())
    assert marker.exists(), control.stderr


@pytest.mark.parametrize("answer, unread", [
    ("[]", "expected an object of facts, got list"),
    ('{"hetseq": "0.1.0"}', "no 'code'"),
    ('{"hetseq": "9", "code": 7, "memory": 1, "torch": null, "cuda": [], "cuda_error": null, '
     '"interface": null, "interface_error": null}', "'code' is int"),
    ('{"hetseq": "9", "code": "c", "memory": 1, "torch": null, "cuda": [{"name": 1}], '
     '"cuda_error": null, "interface": null, "interface_error": null}',
     "a CUDA device of another form"),
    ("not json", "expected an object of facts, got NoneType"),
])
def test_a_probe_answer_of_any_shape_is_a_problem_line(tmp_path, answer, unread):
    """A host with another HetSeq answers facts of another shape: --check
    reports it (it exists to report skew) instead of a KeyError. The host's
    Python here prints what such a host would."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'hetseq-launch node started'\n"
                    f"printf '%s\\n' 'hetseq-probe {answer}'\n")
    fake.chmod(0o755)
    lines = hostfile.parse("localhost slots=1 cpu\n")
    job = planning.make(lines, "train.py", ["--task", "bert"], 29500)
    answers = check.ask(job, lines, transports.Local(), str(tmp_path), str(fake), {},
                        deadline=30)
    check.judge(answers)
    (what, fix), = answers[0].problems
    assert what == (f"its probe answered in a form this HetSeq does not read ({unread}): "
                    "another HetSeq version there?")
    assert fix == "install the same HetSeq on every host"
    assert check.table(answers)[1].endswith("PROBLEM")


def test_a_paused_launcher_never_stops_its_nodes_and_their_escapes_never_reach_it(tmp_path):
    """Ctrl-Z stops the launcher's process group; its nodes write on: the
    wrapper holds their output up to a bound, drops and counts the rest, and
    says how many once the launcher reads again. A node's escape sequences
    reach the terminal as '?'."""
    job = folder(tmp_path / "job")
    go, done = job / "go", job / "done"
    script = job / "chatty.py"
    script.write_text(
        "import pathlib, sys, time\n"
        f"go, done = pathlib.Path({str(go)!r}), pathlib.Path({str(done)!r})\n"
        "print('\\x1b]0;owned\\x07title \\x1b[2Jclear', flush=True)\n"
        "(go.parent / 'started').write_text('')\n"
        "while not go.exists():\n    time.sleep(0.01)\n"
        "for i in range(120_000):\n    print(f'line {i:06d} ' + 'x' * 60)\n"
        "sys.stdout.flush()\n"
        "done.write_text('')\n")
    (job / "hosts").write_text("localhost slots=1 cpu\n")
    proc = subprocess.Popen([*LAUNCH, "--hostfile", "hosts", "--launcher", "local",
                             str(script), "--task", "bert"], cwd=job, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (job / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTSTP)           # Ctrl-Z
        go.write_text("")
        # 8.6 MB of output while nobody reads the launcher's pipes: without
        # the wrapper's buffer the node blocks after 128 KiB of pipes.
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "the node stopped with its launcher"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "\x1b" not in text and "\x07" not in text
    assert "localhost: ?]0;owned?title ?[2Jclear" in text
    assert "line(s) of output dropped: nobody read them (the launcher was paused or slow)" in text
    assert "line 119999" in text                     # the end arrives once it reads again


def test_the_wrapper_ends_with_its_command_whatever_holds_its_output(tmp_path):
    """A process that left the command's session (a daemon) may hold the
    output pipe for ever: the wrapper ends with the command's code anyway."""
    mine = folder(tmp_path / "mine")
    start = time.monotonic()
    wrapper = subprocess.Popen(
        transports.node_command(sys.executable,
                                ["-c", "import subprocess, sys; subprocess.Popen(['sleep', "
                                 "'47'], start_new_session=True); print('left', flush=True); "
                                 "sys.exit(3)"]),
        cwd=mine, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=child_env())
    try:
        wrapper.stdin.write(b'{"env": {}}\n')
        wrapper.stdin.flush()
        assert wrapper.wait(30) == 3
        assert time.monotonic() - start < 30
    finally:
        subprocess.run(["pkill", "-f", "^sleep 47$"])
        wrapper.kill()
