"""hetseq-launch: a hostfile and one command start every node (over real
SSH servers in namespace hosts), stop them together, and keep the job
secret out of every command line and log; hetseq-status shows the job.

The SSH tests run the launcher on host A, as a user would on the first of
their machines, against an sshd on each host (tests/machinery/sshd.py: key
login only, its keys and config in the test's folder). Host D has no sshd:
the host that cannot be reached.
"""

import json
import os
import re
import socket
import time

import pytest

from machinery.settings import TOY
from hetseq.base.errors import UserError
from hetseq.launch import hostfile, commands as planning
from hetseq.launch.launcher import forwarded_env
from hetseq.reporting import status


def value(argv, flag):
    return argv[argv.index(flag) + 1]


def make_plan(text, *args):
    return planning.make(hostfile.parse(text), "train.py", [*TOY, *args], 29500)


def test_hostfile_lines_become_each_nodes_ranks_and_flags():
    job = make_plan("# lab\nnodeA slots=2 max-sentences=8  # the fast one\n"
                    "me@nodeB slots=1 cpu 'save-dir=/scratch/my ckpt#1'  #  comment\n")
    a, b = job.nodes
    assert job.url == "tcp://nodeA:29500" and job.world_size == 3 and not job.elastic
    assert (a.first_rank, b.first_rank, b.host) == (0, 2, "me@nodeB")
    assert value(a.argv, "--max-sentences") == "8"
    assert value(b.argv, "--save-dir") == "/scratch/my ckpt#1" and "--cpu" in b.argv
    assert "comment" not in b.argv
    for node, rank, gpus in ((a, "0", "2"), (b, "2", "1")):
        assert value(node.argv, "--distributed-rank") == rank
        assert value(node.argv, "--distributed-gpus") == gpus
        assert value(node.argv, "--distributed-world-size") == "3"
        assert value(node.argv, "--distributed-init-method") == "tcp://nodeA:29500"
    elastic = make_plan("nodeA slots=1\nnodeB slots=3\n", "--elastic", "--global-batch-size", 16)
    assert elastic.elastic and all("--distributed-rank" not in n.argv for n in elastic.nodes)
    assert value(elastic.nodes[1].argv, "--distributed-gpus") == "3"
    assert value(elastic.nodes[1].argv, "--log-format") == "simple"
    given = make_plan("nodeA slots=1 log-format=json\n").nodes[0].argv
    assert value(given, "--log-format") == "json" and given.count("--log-format") == 1


@pytest.mark.parametrize("text, args, message", [
    ("a slots=1 max-update=5\n", [], r"line 1 \(a\): max-update is a job flag .* put "
                                     r"--max-update after the script"),
    ("a slots=1 lr=0.1\n", [], r"lr is a job flag"),
    ("a slots=1 max-sentence=4\n", [], r"unknown flag --max-sentence: did you mean "
                                        r"--max-sentences\?"),
    ("a slots=1 distributed-rank=3\n", [], r"distributed-rank: hetseq-launch writes it"),
    ("a\n", [], r"line 1: a has no slots=N"),
    ("a slots=0\n", [], r"slots=0: expected a whole number from 1"),
    ("a slots=1 max-sentences=many\n", [], r"line 1 \(a\): that node's flags are not valid"),
    ("a slots=1\n", ["--distributed-world-size", 4], r"--distributed-world-size on the "
                                                     r"hetseq-launch line: hetseq-launch writes"),
    ("a slots=1\n", ["--job-secret-file", "/x"], r"give it to hetseq-launch"),
    ("# nothing\n", [], r"names no host"),
    ("-V slots=1\n", [], r"'-V' is not a host name"),
])
def test_a_wrong_hostfile_or_flag_is_named(text, args, message):
    with pytest.raises((UserError, SystemExit)) as err:
        make_plan(text, *args)
    assert err.type is UserError and re.search(message, str(err.value)), err.value


def test_pdsh_is_refused_with_the_reason(tmp_path, capsys):
    from hetseq.launch.launcher import main
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=1\n")
    with pytest.raises(SystemExit) as stop:
        main(["--hostfile", str(hosts), "--launcher", "pdsh", "train.py", *map(str, TOY)])
    assert stop.value.code == 2
    assert "does not forward standard input" in capsys.readouterr().err


def test_forwarded_variables(tmp_path):
    env_file = tmp_path / ".hetseq_env"
    env_file.write_text("A=1\n# no\nB=x=y\n")
    env = forwarded_env(["C", "D=4"], env_file=str(env_file),
                        environ={"C": "3", "NCCL_DEBUG": "INFO", "HOME": "/root",
                                 "HETSEQ_JOB_SECRET": "never"})
    assert env == {"A": "1", "B": "x=y", "C": "3", "D": "4", "NCCL_DEBUG": "INFO"}
    with pytest.raises(UserError, match="E is not set here"):
        forwarded_env(["E"], env_file=str(env_file), environ={})
    env_file.write_text("export TOKEN=s3cr3t-value\n")
    with pytest.raises(UserError, match=r"\.hetseq_env line 1: expected NAME=VALUE") as err:
        forwarded_env([], env_file=str(env_file), environ={})
    assert "s3cr3t" not in str(err.value)


def test_an_env_file_others_could_write_is_refused(tmp_path):
    """.hetseq_env chooses what every node runs (a PYTHONPATH line with a
    sitecustomize.py): read only when it is the user's own file, written by
    nobody else, and not a link."""
    env_file = tmp_path / ".hetseq_env"
    env_file.write_text(f"PYTHONPATH={tmp_path}\n")
    env_file.chmod(0o644)
    assert forwarded_env([], env_file=str(env_file), environ={}) == {"PYTHONPATH": str(tmp_path)}
    for mode in (0o664, 0o646):
        env_file.chmod(mode)
        with pytest.raises(UserError, match=f"writable by others \\(mode {mode:o}\\).*"
                                            f"chmod go-w {env_file}"):
            forwarded_env([], env_file=str(env_file), environ={})
    env_file.chmod(0o644)
    os.chown(env_file, 65534, -1)
    with pytest.raises(UserError, match="owned by uid 65534, not by you"):
        forwarded_env([], env_file=str(env_file), environ={})
    os.chown(env_file, os.geteuid(), -1)
    link = tmp_path / "link"
    link.symlink_to(env_file)
    with pytest.raises(UserError, match="a symbolic link; give the file itself"):
        forwarded_env([], env_file=str(link), environ={})
    link.unlink()
    link.symlink_to(tmp_path / "nowhere")      # a dangling link is refused, not skipped
    with pytest.raises(UserError, match="a symbolic link"):
        forwarded_env([], env_file=str(link), environ={})


def test_status_text_names_every_rank():
    view = {"state": "training", "generation": 2, "update": 40, "planned": 60, "left_s": 21,
            "loss": 0.5, "samples_per_s": 80.0, "time": 100.0,
            "ranks": [{"rank": 0, "host": "hostA", "batch": 8, "samples_per_s": 20.0,
                       "wait_s": 0.5},
                      {"rank": 1, "host": "hostB", "batch": 24, "samples_per_s": None,
                       "wait_s": None}],
            "checkpoint": {"path": "/c/checkpoint_last.pt", "update": 30, "time": 90.0}}
    lines = status.render(status.clean(view), "tcp://hostA:29500", now=101.0)
    assert lines[0] == ("tcp://hostA:29500 | update 40/60 | 0:00:21 left | generation 2 | "
                        "2 node(s) on 2 host(s), 2 rank(s) | training as of 1 s ago")
    assert re.search(r"0  hostA\s+8\s+25%\s+20.0\s+0.50 s", lines[3]), lines
    assert re.search(r"1  hostB\s+24\s+75%\s+-\s+-", lines[4]), lines
    assert lines[-1] == "last checkpoint: /c/checkpoint_last.pt (update 30, 11 s ago)"
    assert "not published its status yet" in status.render(None, "tcp://h:1")[0]


def test_status_names_nodes_as_the_launcher_does():
    """Two nodes of one machine, named by hetseq-launch (HETSEQ_NODE): the
    board says them apart, as the launcher's lines do."""
    from hetseq.distributed.topology import node_name
    assert node_name({"HETSEQ_NODE": "localhost#2"}) == "localhost#2"
    assert node_name({"HETSEQ_NODE": "\x1b[2J"}) == "?[2J" and node_name({}) == socket.gethostname()

    class Store:
        def set(self, key, value):
            self.value = value
    board = status.StatusBoard(Store(), ["vm", "vm"], nodes=["localhost", "localhost#2"])
    board.update(update=3, ranks=board.ranks([8, 8], [8, 8], [1.0, 1.0], 1.0))
    lines = status.render(status.clean(json.loads(board.store.value)), "tcp://localhost:1",
                          now=time.time())
    assert "| 2 node(s) on 1 host(s), 2 rank(s) |" in lines[0], lines
    assert re.search(r"0  localhost\s+8", lines[2]) and re.search(r"1  localhost#2\s+8", lines[3])


def test_status_draws_only_what_it_expects():
    """A status written by someone else (a job without a secret is anyone's
    to write): wrong types become blanks, no terminal escape gets through."""
    hostile = {"state": "\x1b[2Jowned", "update": "many", "left_s": float("inf"),
               "loss": "low", "time": "now", "generation": [1],
               "ranks": [{"rank": 0, "host": None, "batch": "8"}, "rank 1", {"host": "b\x07"}],
               "checkpoint": "yesterday"}
    view = status.clean(hostile)
    text = "\n".join(status.render(view, "tcp://h:1", now=5.0))
    assert "\x1b" not in text and "\x07" not in text and "[2Jowned as of ? s ago" in text
    assert [r["host"] for r in view["ranks"]] == ["?", "b"] and view["checkpoint"] is None
    assert status.clean({"ranks": {"0": {}}})["ranks"] == []


def test_forwarded_values_every_node_can_take(tmp_path):
    """What .hetseq_env (or --env) forwards must reach every node's command:
    no NUL byte, no variable over exec's bound, a line the node reads."""
    from hetseq.launch import launcher as launch_main
    env_file = tmp_path / ".hetseq_env"
    env_file.write_text("TOKEN=a\0b\n")
    env_file.chmod(0o600)
    with pytest.raises(UserError, match=r"line 1: TOKEN's value holds a NUL byte"):
        forwarded_env([], env_file=str(env_file), environ={})
    env_file.write_text("BIG=" + "x" * launch_main.MAX_VARIABLE + "\n")
    with pytest.raises(UserError, match=r"line 1: BIG is \d+ bytes, more than one variable"):
        forwarded_env([], env_file=str(env_file), environ={})
    env_file.write_text("".join(f"V{i}=" + '"' * 60000 + "\n" for i in range(10)))
    with pytest.raises(UserError, match=r"the forwarded variables take \d+ bytes"):
        forwarded_env([], env_file=str(env_file), environ={})


def test_a_node_reads_its_line_whole_and_at_once():
    """A line near the bound is read in chunks (byte by byte took half a
    minute over ssh), and nothing after its newline is taken for it."""
    import io
    import threading
    from hetseq.launch import node as launch_node
    env = {"V": '"' * 450000, "W": "w"}        # 900 KB as JSON
    read, write = os.pipe()
    payload = (json.dumps({"env": env}) + "\n").encode()
    writer = threading.Thread(target=lambda: (os.write(write, payload), os.close(write)))
    writer.start()
    started = time.perf_counter()
    with io.FileIO(read, closefd=True) as stream:
        assert launch_node.read_env(stream) == (env, b"")
    writer.join()
    assert time.perf_counter() - started < 5
