"""A stop asked by a signal (Ctrl-C, SIGTERM) keeps the run: every rank
finishes the update where they agree on it, rank 0 saves, each node exits
128 + the signal and names the command that resumes; a second signal stops
at once (hetseq/base/stopping.py)."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from hetseq.base import stopping
from machinery.commands import (final_params, node_commands, run_train, start_nodes, train_cmd,
                                zygote)
from machinery.settings import EXACT, EXACT_SGD, ROOT, TOY, child_env, free_port
from machinery.watched import Watched

STOP_LINE = r"^hetseq: stopping within \d+ s: "


def started(*args, fresh=False):
    """``train.py args`` in a session of its own (a terminal's Ctrl-C reaches
    its whole process group: ``os.killpg``), watched; ``fresh``: a new
    interpreter, not the zygote's fork (whose ranks fork in turn: a fresh
    one starts them from a fork server, in the same process group)."""
    argv, options = train_cmd(*args), dict(cwd=ROOT, env=child_env(), text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            start_new_session=True)
    if not fresh and zygote() is not None and zygote().serves(options["env"]):
        return Watched(zygote().popen(argv[1:], **options))
    return Watched(subprocess.Popen(argv, **options))


def updates_in(save_dir):
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), weights_only=True)
    return state["controller"]["num_updates"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_saves_the_update_the_ranks_agree_on_and_the_same_command_resumes(tmp_path, sig):
    """Two ranks on one node, held inside update 4; Ctrl-C (to the process
    group, as a terminal sends it; or SIGTERM to it, as the launcher's node
    wrapper does, which reaches the ranks' fork server too): update 4 ends,
    the ranks agree on the stop in update 5's statistics, rank 0 saves
    update 5 (mid-epoch), the node exits 128 + the signal with the command
    that resumes. That command, run to update 8, gives the weights of a run
    never stopped (SGD, float64)."""
    common = [*EXACT_SGD, "--distributed-world-size", 2, "--distributed-gpus", 2,
              "--max-sentences", 2,
              "--log-interval", 1, "--max-update", 8]
    held, go = tmp_path / "stopped", tmp_path / "go"
    job = started(*common, "--save-dir", held, "--toy-hold-until", go, "--toy-hold-from", 4,
                  fresh=sig == signal.SIGTERM)
    job.wait_for(r"toy: rank [01] holds at call 4", count=2, timeout=120)
    os.killpg(job.proc.pid, sig)
    job.wait_for(STOP_LINE)
    go.touch()
    code, out = job.finish(120)
    assert code == 128 + sig, out[-3000:]
    assert len(re.findall(STOP_LINE, out, re.M)) == 1, out[-3000:]     # said once, by the node
    assert f"stopped by {sig.name} after update 5: saved {held}/checkpoint_last.pt; resume with " \
           "the same command: python " in out, out[-3000:]
    assert updates_in(held) == 5
    # The resume command is the one the node printed.
    again = re.search(r"resume with the same command: python (.*)$", out, re.M).group(1)
    resumed = run_train(*shlex.split(again)[1:])
    assert resumed.returncode == 0 and "5 updates done" in resumed.stdout + resumed.stderr, \
        (resumed.stdout + resumed.stderr)[-3000:]
    straight = run_train(*common, "--save-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert updates_in(held) == updates_in(tmp_path / "straight") == 8
    for name, value in final_params(tmp_path / "straight").items():
        assert torch.allclose(final_params(held)[name], value, rtol=0, atol=EXACT), name


def test_a_stop_asked_of_one_node_stops_every_node_after_the_same_update(tmp_path):
    """Two nodes of one rank each, held in update 3; SIGINT to rank 1's node
    only: the ranks agree in update 4's statistics, so rank 0's node stops
    there too, saves update 4, and both exit 130."""
    go = tmp_path / "go"
    common = [*TOY, "--max-update", 1000, "--max-sentences", 4, "--log-interval", 1,
              "--toy-hold-until", go, "--toy-hold-from", 3]
    nodes = [Watched(proc) for proc in start_nodes(node_commands(
        common, [["--save-dir", tmp_path / "a"], ["--save-dir", tmp_path / "b"]]))]
    for node in nodes:
        node.wait_for(r"toy: rank [01] holds at call 3", timeout=120)
    nodes[1].proc.send_signal(signal.SIGINT)
    nodes[1].wait_for(STOP_LINE)
    go.touch()
    (code_a, out_a), (code_b, out_b) = (node.finish(120) for node in nodes)
    assert code_a == code_b == 130, (out_a[-2000:], out_b[-2000:])
    assert f"stopped by SIGINT after update 4: saved {tmp_path / 'a'}/checkpoint_last.pt" in out_a
    assert "done: stopped by SIGINT (rank 1's node)" in out_a, out_a[-2000:]
    assert "stopped by SIGINT after update 4: rank 0's node saved its checkpoint; resume with " \
           "the same command on every node" in out_b, out_b[-2000:]
    assert updates_in(tmp_path / "a") == 4 and not os.path.exists(tmp_path / "b" / "checkpoint_last.pt")


def test_sigterm_with_no_save_stops_after_the_update_and_saves_nothing(tmp_path):
    """One rank (its signals answered by a thread while its main thread is
    busy), --no-save: SIGTERM ends it after the next update with 143 and
    no checkpoint written."""
    go = tmp_path / "go"
    job = started(*TOY, "--max-update", 1000, "--max-sentences", 4, "--log-interval", 1,
                  "--no-save", "--save-dir", tmp_path / "ck", "--toy-hold-until", go,
                  "--toy-hold-from", 3)
    job.wait_for(r"toy: rank 0 holds at call 3", timeout=120)
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for(STOP_LINE + r"SIGTERM received; the job finishes this update, \(--no-save: "
                 r"nothing saved\) then exits 143")
    go.touch()
    code, out = job.finish(120)
    assert code == 143, out[-3000:]
    assert "stopped by SIGTERM after update 4: nothing saved (--no-save)" in out, out[-3000:]
    assert not os.path.exists(tmp_path / "ck" / "checkpoint_last.pt")


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """The first Ctrl-C waits for an update held for ever; the second ends
    the command at once, 130, saying that nothing more was saved."""
    job = started(*TOY, "--max-update", 1000, "--max-sentences", 4, "--log-interval", 1,
                  "--save-dir", tmp_path / "ck", "--toy-hold-until", tmp_path / "never",
                  "--toy-hold-from", 3)
    job.wait_for(r"toy: rank 0 holds at call 3", timeout=120)
    os.killpg(job.proc.pid, signal.SIGINT)
    job.wait_for(STOP_LINE)
    # A second signal sooner would be the first delivered twice (stopping.AGAIN_S).
    time.sleep(stopping.AGAIN_S)
    os.killpg(job.proc.pid, signal.SIGINT)
    code, out = job.finish(30)
    assert code == 130, out[-3000:]
    assert "hetseq: SIGINT: stopping at once (a second signal); nothing is saved beyond the last " \
           "checkpoint" in out, out[-3000:]
    assert not os.path.exists(tmp_path / "ck" / "checkpoint_last.pt")


def test_a_stop_before_the_first_update_is_at_once(tmp_path):
    """Nothing trained, nothing to save: a signal while the job waits for
    its other node ends it at once."""
    job = started(*TOY, "--max-update", 10, "--max-sentences", 4, "--save-dir", tmp_path / "ck",
                  "--distributed-world-size", 2, "--distributed-rank", 0,
                  "--distributed-init-method", f"tcp://127.0.0.1:{free_port()}")
    job.wait_for(r"waiting at tcp://\S+ for ranks 1 of 2", timeout=120)
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish(30)
    assert code == 143 and "stopping at once (before the first update, nothing to save)" in out, \
        out[-3000:]


def test_one_signal_delivered_twice_is_one_stop():
    """A supervisor that signals the group and its child (``timeout``)
    delivers one SIGTERM twice: that is not the second signal that stops
    at once; one a second later is."""
    script = ("import os, signal, time\n"
              "from hetseq.base import stopping\n"
              "node = stopping.install()\n"
              "stopping.expect(1.0, 1.0)\n"
              "node.answer(signal.SIGTERM)\n"
              "node.answer(signal.SIGTERM)\n"
              "print('one stop', flush=True)\n"
              "time.sleep(stopping.AGAIN_S)\n"
              "node.answer(signal.SIGTERM)\n"
              "print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 143 and done.stdout == "one stop\n", (done.stdout, done.stderr)
    assert done.stderr.count("stopping within 14 s") == 1 and \
        "stopping at once (a second signal)" in done.stderr, done.stderr


def test_the_node_wrapper_waits_the_time_its_command_announced(monkeypatch):
    """After SIGTERM the wrapper gives the command the time it announced for
    its save (here 30 s) before SIGKILL, not STOP_S."""
    from hetseq.launch import node as wrapper
    monkeypatch.setattr(wrapper, "STOP_S", 0.3)
    script = ("import signal, sys, time\n"
              "def term(*_):\n"
              "    print('hetseq: stopping within 30 s: SIGTERM received; ...', flush=True)\n"
              "    time.sleep(1.5)\n"
              "    sys.exit(7)\n"
              "signal.signal(signal.SIGTERM, term)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    read, write = os.pipe()
    try:
        relay = wrapper.Relay(proc.stdout.fileno(), out_fd=write)
        with os.fdopen(read, "rb", closefd=False) as seen:
            assert seen.readline() == b"ready\n"
        import threading
        wrapper.stop(proc, relay, threading.Event())
        assert proc.wait(5) == 7 and relay.bound == 30.0
    finally:
        proc.kill()
        os.close(write)


@pytest.mark.parametrize("second", [False, True])
def test_ctrl_c_on_the_launcher_saves_on_every_node_and_exits_130(tmp_path, second):
    """hetseq-launch, two local nodes: Ctrl-C makes every node finish the
    update they agree on; rank 0's node saves it; each node exits 143 (its
    wrapper's SIGTERM), the launcher 130, with the command that resumes.
    A second Ctrl-C stops every node at once. hetseq-status calls the nodes
    what the launcher calls them (localhost, localhost#2)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost slots=1 max-sentences=4 save-dir={tmp_path / 'a'}\n"
                     f"localhost slots=1 max-sentences=4 save-dir={tmp_path / 'b'}\n")
    go = tmp_path / ("never" if second else "go")
    launcher = [sys.executable, "-m", "hetseq.launch", "--hostfile", str(hosts), "--launcher",
                "local", "--master-port", str(free_port()), str(ROOT / "train.py"), "--cpu",
                "--no-progress-bar", *TOY, "--max-update", "1000", "--log-interval", "1",
                "--toy-hold-until", str(go), "--toy-hold-from", "3"]
    job = Watched(subprocess.Popen(launcher, cwd=ROOT, env=child_env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    job.wait_for(r"localhost(#2)?: toy: rank [01] holds at call 3", count=2, timeout=120)
    if not second:
        # While it is held: hetseq-status names the nodes as the launcher's lines do.
        url, path = re.search(r"hetseq-status (tcp://\S+) --job-secret-file (\S+)",
                              job.output()).groups()
        seen = subprocess.run([sys.executable, "-m", "hetseq.reporting.status", url,
                               "--job-secret-file", path], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert seen.returncode == 0, seen.stderr
        assert "| 2 node(s) on 1 host(s), 2 rank(s) |" in seen.stdout, seen.stdout
        assert re.search(r"0  localhost\s+4", seen.stdout) and \
            re.search(r"1  localhost#2\s+4", seen.stdout), seen.stdout
    job.proc.send_signal(signal.SIGINT)
    job.wait_for(r"localhost(#2)?: hetseq: stopping within \d+ s: SIGTERM received", count=2)
    if second:
        job.proc.send_signal(signal.SIGINT)
    else:
        go.touch()
    code, out = job.finish(60)
    assert code == 130, out[-3000:]
    if second:
        assert "stopping every node at once: a second signal" in out, out[-3000:]
        assert not os.path.exists(tmp_path / "a" / "checkpoint_last.pt")
        return
    assert updates_in(tmp_path / "a") == 4, out[-3000:]
    assert re.search(r"localhost: .*stopped by SIGTERM after update 4: saved "
                     rf"{tmp_path / 'a'}/checkpoint_last.pt", out), out[-3000:]
    assert re.search(r"localhost#2: .*stopped by SIGTERM after update 4: rank 0's node saved its "
                     r"checkpoint; resume with the same command on every node", out), out[-3000:]
    assert "hetseq-launch: resume with the same command: hetseq-launch --hostfile" in out
    assert re.search(r"localhost \(ranks 0\): exit 143 \(stopped by hetseq-launch\)", out)


def test_an_elastic_job_stops_on_ctrl_c_after_saving_through_its_own_path(tmp_path):
    """--elastic, two nodes held in update 2 (two micro-batches an update):
    SIGINT to one; the generation's ranks agree on the stop in update 3's
    statistics, rank 0 saves it, both nodes exit 130, and the same commands
    resume the job from there."""
    from machinery import elastic_jobs
    url, go = f"tcp://127.0.0.1:{free_port()}", tmp_path / "go"
    hold = ["--toy-hold-until", go, "--toy-hold-from", 3]
    nodes = [elastic_jobs.node(None, None, url, tmp_path / name, *hold) for name in "ab"]
    for node in nodes:
        node.wait_for(r"toy: rank [01] holds at call 3", timeout=120)
    os.kill(nodes[1].proc.pid, signal.SIGINT)
    nodes[1].wait_for(STOP_LINE)
    go.touch()
    ends = [node.finish(120) for node in nodes]
    assert [code for code, _ in ends] == [130, 130], [out[-2000:] for _, out in ends]
    saved = [i for i, (_, out) in enumerate(ends) if re.search(
        r"stopped by SIGINT after update 3: saved \S+/checkpoint_last.pt; resume", out)]
    assert len(saved) == 1, [out[-2000:] for _, out in ends]
    assert updates_in(tmp_path / "ab"[saved[0]]) == 3
    again = [elastic_jobs.node(None, None, url, tmp_path / name, "--max-update", 6)
             for name in "ab"]
    outputs = elastic_jobs.finish_ok(*again)
    assert any("3 updates done" in out for out in outputs), \
        [out[-2000:] for out in outputs]
