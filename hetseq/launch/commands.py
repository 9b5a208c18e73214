"""What each node of a hostfile runs: its ranks, its flags, where the job
meets (``tcp://FIRST:PORT/JOB_ID``). Every node's command line is parsed
here with the nodes' own parser (cli.parse) before anything starts, so a
flag a node would refuse ends the launch at once, naming the host and flag.
"""

# Ranks in hostfile order: node i runs ``slots_i`` ranks from the sum of the
# slots before it; the job meets at the first host. Under ``--elastic`` the
# meeting point hands ranks out, so a node gets only its --distributed-gpus
# and the URL. The job id the launcher mints (``new_job_id``) ends the URL
# every node is given: the secret's salt (store/job_secret.py).

import dataclasses
import secrets

from hetseq.app import cli, config
from hetseq.base.errors import UserError
from hetseq.base.logs import rank_ranges
from hetseq.tasks import TASKS

# The flags the launcher writes itself for every node (a user's value would
# give two nodes the same ranks, or a node a wrong world).
OWNED = {"distributed_rank": "from the hostfile's order and slots",
         "distributed_world_size": "the sum of the hostfile's slots",
         "distributed_gpus": "the host's slots=N",
         "distributed_init_method": "the first host and --master-port",
         "job_secret_file": "hetseq-launch hands the secret to every node itself: "
                            "give it to hetseq-launch (--job-secret-file or HETSEQ_JOB_SECRET)"}


@dataclasses.dataclass(frozen=True)
class NodePlan:
    label: str                # the host as the output names it (host#2 for a repeated host)
    host: str                 # as ssh takes it
    slots: int
    first_rank: int | None    # None under --elastic
    argv: tuple               # the script and its flags, as the node runs them

    def ranks(self):
        if self.first_rank is None:
            return f"{self.slots} rank(s), given at the meeting point"
        return "ranks " + rank_ranges(range(self.first_rank, self.first_rank + self.slots))


@dataclasses.dataclass(frozen=True)
class JobPlan:
    nodes: tuple
    url: str                  # the meeting point: tcp://FIRST:PORT
    elastic: bool
    world_size: int | None
    job_id: str | None = None

    @property
    def node_url(self) -> str:
        """The URL every node is given, and hetseq-status: the meeting point
        and the job id."""
        return self.url if self.job_id is None else f"{self.url}/{self.job_id}"


def new_job_id() -> str:
    """A job id no other job has: 128 random bits, so that no table of
    stretched guesses made for another job's salt serves this one."""
    return secrets.token_hex(16)


def meeting_host(host):
    """The host part of an ssh destination ([user@]host)."""
    return host.rsplit("@", 1)[-1]


def make(lines, script, train_args, port, master=None, job_id=None):
    """The JobPlan of ``lines`` (hostfile.HostLine) running ``script
    train_args``; ``master``: the meeting point's host (default: the first
    line's); ``job_id``: what ends every node's URL (``new_job_id``; None:
    nothing, and the port stands for it)."""
    train_args = [str(a) for a in train_args]
    host = master or meeting_host(lines[0].host)
    meeting = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    url = meeting if job_id is None else f"{meeting}/{job_id}"
    parser, elastic, node_dests = _nodes_parser([*train_args, "--distributed-init-method", url])
    _refuse_owned(parser, train_args, "on the hetseq-launch line")
    world = None if elastic else sum(line.slots for line in lines)
    nodes, first, seen = [], 0, {}
    for line in lines:
        own = _node_flags(parser, node_dests, line)
        written = ["--distributed-gpus", str(line.slots), "--distributed-init-method", url]
        if not elastic:
            written += ["--distributed-world-size", str(world), "--distributed-rank", str(first)]
        if world == 1:
            written = []           # one process in all: a plain run, nowhere to meet
        if not _given(parser, [*train_args, *own], "log_format"):
            written += ["--log-format", "simple"]     # lines, not a tqdm bar, through a pipe
        argv = (script, *train_args, *own, *written)
        _check(argv[1:], line)
        seen[line.host] = seen.get(line.host, 0) + 1
        label = line.host if seen[line.host] == 1 else f"{line.host}#{seen[line.host]}"
        nodes.append(NodePlan(label, line.host, line.slots, None if elastic else first, argv))
        first += line.slots
    return JobPlan(tuple(nodes), meeting, elastic, world, job_id)


def _nodes_parser(train_args):
    """The nodes' parser (with the task's flags), whether the job is
    elastic, and the dests of the flags that may differ per node."""
    args, job, node = _parse(train_args, "the training flags after the script")
    task_cls = TASKS.get(args.task)
    return cli.build_parser(task_cls), job.elastic.elastic, config.per_node_flags(node)


def _parse(argv, what):
    try:
        return cli.parse(list(argv))
    except SystemExit as stop:
        if stop.code:
            raise UserError(f"{what} are not valid: the parser's message is above") from None
        raise                     # --help
    except UserError as err:
        raise UserError(f"{what}: {err}") from None


def _dests(parser):
    """{option string: dest} of every flag the parser knows."""
    return {option: action.dest for action in parser._actions for option in action.option_strings}


def _given(parser, argv, dest):
    known = _dests(parser)
    return any(known.get(word.split("=", 1)[0]) == dest for word in argv if word.startswith("--"))


def _refuse_owned(parser, argv, where):
    known = _dests(parser)
    for word in argv:
        dest = known.get(word.split("=", 1)[0]) if word.startswith("--") else None
        if dest in OWNED:
            raise UserError(f"{word.split('=', 1)[0]} {where}: hetseq-launch writes it for "
                            f"every node ({OWNED[dest]}); leave it out")


def _node_flags(parser, node_dests, line):
    """The hostfile line's flags as words, each checked to be a node's flag."""
    known = _dests(parser)
    where = f"hostfile line {line.line} ({line.host})"
    for name, _ in line.flags:
        dest = known.get(f"--{name}")
        if dest is None:
            raise UserError(f"{where}: {parser._suggest('--' + name)}")
        if dest in OWNED:
            raise UserError(f"{where}: {name}: hetseq-launch writes it for every node "
                            f"({OWNED[dest]}); leave it out")
        if dest not in node_dests:
            raise UserError(f"{where}: {name} is a job flag (every node must pass the same "
                            f"value, docs/flags.md): put --{name} after the script on the "
                            "hetseq-launch line")
    return line.argv()


def _check(argv, line):
    """Parse a node's whole command line as the node will."""
    _parse(argv, f"hostfile line {line.line} ({line.host}): that node's flags")
