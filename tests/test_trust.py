"""Code that another user can plant never runs (issue 58, item 1), and the
launcher's own faults end in one line (item 7): a shared launch folder,
--remote-dir, hostfile or --user-dir is refused with its owner and mode;
no wrapper or probe imports from its working folder; --compile keeps its
pickled code in a private folder; a probe's answer of any shape is a
problem line; a paused launcher never stops its nodes; a peer's words
reach the terminal without escapes; a number flag is finite.

Everything runs as root here and in CI, so "another user" is uid 65534
(nobody), given the files, and the modes under test are set by hand."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from machinery.settings import ROOT, child_env
from hetseq.distributed import identity
from hetseq.base.errors import UserError
from hetseq.launch import check, hostfile, commands as planning, transport as transports
from hetseq.base.owned_file import compile_cache, others_can_change, refuse_unless_owned
from hetseq.tasks import import_user_dir

# As a user runs it: the console script, whose own folder (not the working
# one) is on its sys.path. (``python -m hetseq.launch`` in a shared folder
# would import from it before HetSeq's first line: Python's doing.)
LAUNCH = [sys.executable, "-P", "-m", "hetseq.launch"]
NOBODY = 65534
PLANTED = "import pathlib; pathlib.Path({marker!r}).write_text('ran')\n"


def folder(path, mode=0o700, owner=None):
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def plant(where, marker, name="json.py", owner=NOBODY):
    """A module another user drops into ``where``: it leaves ``marker`` if it runs."""
    planted = where / name
    planted.write_text(PLANTED.format(marker=str(marker)))
    os.chown(planted, owner, owner)
    return planted


def run_launch(cwd, hosts, *args, timeout=60):
    return subprocess.run([*LAUNCH, "--hostfile", str(hosts), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=child_env())


# ---- which paths another user could change ----

def test_a_path_is_refused_when_it_or_a_folder_above_it_is_not_yours(tmp_path):
    mine = folder(tmp_path / "mine")
    assert others_can_change(mine) is None
    # Under a sticky folder that others may write (as /tmp): only the owner
    # of a name may rename it there, so a folder of yours inside is yours.
    sticky = folder(tmp_path / "sticky", 0o1777)
    assert others_can_change(folder(sticky / "job")) is None
    assert "others may write it" in others_can_change(sticky)
    # Without the sticky bit anyone may replace what is inside.
    loose = folder(tmp_path / "loose", 0o777)
    inner = folder(loose / "job")
    assert f"others may write in it and replace {inner}" in others_can_change(inner)
    assert "mode 777" in others_can_change(inner)
    theirs = folder(tmp_path / "theirs", 0o755, owner=NOBODY)
    why = others_can_change(theirs)
    assert "owner nobody (uid 65534): its owner could change it" in why
    group = folder(tmp_path / "group", 0o775)
    assert "mode 775" in others_can_change(group)
    # A link is judged by what it points to.
    (mine / "link").symlink_to(loose)
    assert "mode 777" in others_can_change(mine / "link")
    with pytest.raises(UserError, match=r"--hostfile .*mode 777.* mkdir -m 700 ") as err:
        refuse_unless_owned(loose, "--hostfile")
    assert "chmod" not in str(err.value)       # never advised on a folder not the user's


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


def test_a_hostfile_another_user_can_change_is_refused(tmp_path):
    # A link kept in a folder others may write can be pointed elsewhere
    # after the check: the folders on the way as written are judged too.
    mine = folder(tmp_path / "mine")
    (mine / "hosts").write_text("localhost slots=1 cpu\n")
    loose = folder(tmp_path / "loose", 0o777)
    (loose / "hosts").symlink_to(mine / "hosts")
    with pytest.raises(UserError, match=r"mode 777.*others may write in it"):
        hostfile.read(str(loose / "hosts"))
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1 cpu user-dir=/their/folder\n")
    os.chmod(hosts, 0o666)
    with pytest.raises(UserError, match=rf"--hostfile {hosts}: .*mode 666.*others may write it"):
        hostfile.read(str(hosts))
    os.chmod(hosts, 0o644)
    os.chown(hosts, NOBODY, NOBODY)
    with pytest.raises(UserError, match=r"owner nobody \(uid 65534\): its owner could change"):
        hostfile.read(str(hosts))
    os.chown(hosts, 0, 0)
    assert hostfile.read(str(hosts))[0].slots == 1


def test_a_user_dir_another_user_can_change_is_refused_before_it_is_imported(tmp_path):
    marker = tmp_path / "planted-ran"
    mine = folder(tmp_path / "mine")
    tasks = folder(mine / "trusttasks_a")
    plant(tasks, marker, name="__init__.py", owner=0)
    os.chmod(tasks, 0o777)
    with pytest.raises(UserError, match=r"--user-dir .*mode 777"):
        import_user_dir(str(tasks))
    os.chmod(tasks, 0o755)
    os.chown(tasks / "__init__.py", NOBODY, NOBODY)
    with pytest.raises(UserError, match=r"--user-dir's module .*__init__\.py.*uid 65534"):
        import_user_dir(str(tasks))
    # A folder behind a link is walked: Python imports through it.
    os.chmod(tasks / "__init__.py", 0o644)
    os.chown(tasks / "__init__.py", 0, 0)
    loose = folder(tmp_path / "loose", 0o777)
    (tasks / "sub").symlink_to(loose)
    with pytest.raises(UserError, match=r"--user-dir's folder .*mode 777"):
        import_user_dir(str(tasks))
    # Its parent goes first on sys.path: a shared parent is refused too.
    shared = folder(tmp_path / "shared", 0o1777)
    other = folder(shared / "trusttasks_b")
    (other / "__init__.py").write_text("")
    with pytest.raises(UserError, match=r"its parent folder \(on the module path\)"):
        import_user_dir(str(other))
    assert not marker.exists()
    assert "trusttasks_a" not in sys.modules and "trusttasks_b" not in sys.modules


def test_compile_keeps_its_code_in_a_private_folder(tmp_path, monkeypatch):
    """torch's default /tmp/torchinductor_USER can be made first by another
    user; --compile uses a persistent folder of the user's own instead."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder(tmp_path / "cache")))
    path = compile_cache()
    assert path == str(tmp_path / "cache" / "hetseq" / "inductor")
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    assert compile_cache() == path               # the same folder next time: no recompiling
    squatted = folder(tmp_path / "squatted", 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(squatted))
    with pytest.raises(UserError, match=r"TORCHINDUCTOR_CACHE_DIR .*mode 777"):
        compile_cache()


# ---- the launcher's own faults ----

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


def test_a_peers_words_reach_the_terminal_printable_and_of_any_shape():
    """The identity and its founder are written into the store by a peer
    (any peer, in a job without a secret): a refusal shows them without
    escape sequences, and an identity that is no object is named."""
    class Store(dict):
        def compare_set(self, key, expected, value):
            return self.setdefault(key, value.encode() if isinstance(value, str) else value)

        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key]

    for held, differ in ((json.dumps({"seed": "\x1b[31m1"}).encode(), r"--seed 2 here, '\\x1b\[31m1'"),
                         (b"[1, 2]", "of another form"), (b"\xff\xfe{", "of another form"),
                         (b"[" * 100_000, "of another form")):
        store = Store({"hetseq/job": held, "hetseq/job-by": b"host\x1b]0;x\x07 pid 1"})
        with pytest.raises(UserError, match=differ) as err:
            identity.present(store, {"seed": 2}, 1, "tcp://a:1", "me", time.monotonic() + 5)
        assert "\x1b" not in str(err.value) and "(started by host?]0;x? pid 1)" in str(err.value)


def test_adam_betas_must_be_numbers_below_one():
    from types import SimpleNamespace
    from hetseq.optim import AdamW
    params = [torch.zeros(2, requires_grad=True)]
    for betas in ("(nan, 0.999)", "(1.5, 0.999)", "(0.9, inf)"):
        cfg = SimpleNamespace(adam_betas=betas, adam_eps=1e-8, weight_decay=0.0)
        with pytest.raises(UserError, match=r"--adam-betas .*from 0 up to \(not including\) 1"):
            AdamW.build(cfg, params, 0.1)


@pytest.mark.parametrize("flag", ["--max-memory-gb", "--lr", "--clip-norm"])
def test_a_number_flag_that_is_not_finite_is_refused(flag):
    from hetseq.app import cli
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as err:
            cli.parse(["--task", "bert", flag, value])
        assert err.value.code == 2
