"""The command line: one place builds the parser; tasks add their own flags.

Flags of the original HetSeq keep working. Those that no longer change
anything are accepted and say so in --help (``LEGACY``).
"""

import argparse
import difflib

from hetseq import config
from hetseq.distributed import health
from hetseq.errors import UserError
from hetseq.optim import OPTIMIZERS, SCHEDULERS, add_optimization_args
from hetseq.plan import capacity
from hetseq.run import checkpoint
from hetseq.tasks import TASKS, import_builtin_tasks, import_user_dir
from hetseq.update import exchange, precision, sharding

LEGACY = "accepted for HetSeq compatibility; no effect: "


def _float_list(text):
    try:
        return [float(part) for part in str(text).strip("()[]").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got '{text}'")


def _int_list(text):
    try:
        return [int(part) for part in str(text).strip("()[]").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'")


def add_general_args(parser):
    parser.add_argument("--task", required=True, metavar="NAME",
                        help="what to train; see the registered tasks in the error of a wrong name")
    parser.add_argument("--user-dir", metavar="DIR",
                        help="a directory of user tasks to import (see README: define your own task)")
    parser.add_argument("--seed", type=int, default=19940802, help="random seed (default: %(default)s)")
    parser.add_argument("--no-progress-bar", action="store_true", help="plain log lines, no tqdm bar")
    parser.add_argument("--log-interval", type=int, default=1, metavar="N",
                        help="log every N updates when there is no progress bar (default: 1)")
    parser.add_argument("--log-format", default="tqdm", choices=["tqdm", "simple", "json", "none"],
                        help="'tqdm' shows a bar; any other value logs plain lines (default: tqdm)")
    parser.add_argument("--log-all-ranks", action="store_true",
                        help="log INFO on every rank, not only rank 0")
    parser.add_argument("--tensorboard-logdir", metavar="DIR",
                        help="write TensorBoard scalars here (rank 0; default: "
                             "<save-dir>/tensorboard, none with --no-save)")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="write no TensorBoard scalars")


def add_dataset_args(parser):
    group = parser.add_argument_group("Data")
    group.add_argument("--data", metavar="DIR", help="where the task reads its data")
    group.add_argument("--num-workers", type=int, default=0, metavar="N",
                       help="data-loader worker processes per rank (default: 0)")
    group.add_argument("--max-sentences", "--batch-size", type=int, metavar="N",
                       help="samples per step on each rank of this node; the global batch is "
                            "the sum over all ranks (nodes may pass different values; "
                            "default: the task's)")
    group.add_argument("--max-sentences-valid", type=int, metavar="N",
                       help="validation batch per rank (default: --max-sentences)")
    group.add_argument("--max-tokens", type=int, metavar="N",
                       help="token budget per batch: not supported yet, use --max-sentences")
    group.add_argument("--max-tokens-valid", type=int, metavar="N", help=LEGACY + "see --max-tokens")
    group.add_argument("--required-batch-size-multiple", type=int, default=1, metavar="N",
                       help=LEGACY + "batches are sliced from exact global batches")
    group.add_argument("--train-subset", default="train", metavar="SPLIT",
                       help="split to train on (default: train)")
    group.add_argument("--valid-subset", default="valid", metavar="SPLITS",
                       help="comma-separated splits to validate on after each epoch (default: valid)")
    group.add_argument("--validate-interval", type=int, default=1, metavar="N",
                       help="validate every N epochs (default: 1)")
    group.add_argument("--validate-interval-updates", type=int, default=0, metavar="N",
                       help="also validate after every N updates (0: only at epoch ends; "
                            "--local-steps: a round ends there) (default: 0)")
    group.add_argument("--disable-validation", action="store_true", help="do not validate")
    group.add_argument("--curriculum", type=int, default=0, metavar="N",
                       help="do not shuffle the data in the first N epochs")


def add_distributed_args(parser):
    group = parser.add_argument_group("Distributed training")
    group.add_argument("--distributed-world-size", type=int, metavar="N",
                       help="processes in the whole job (default: visible GPUs, or 1 on CPU)")
    group.add_argument("--distributed-rank", type=int, metavar="R",
                       help="global rank of this node's FIRST process (default: 0, or from the "
                            "torchrun/MPI/SLURM environment)")
    group.add_argument("--distributed-gpus", type=int, metavar="G",
                       help="processes to start on this node, one per device (CPU: G CPU "
                            "processes); default: all ranks on one node, else the visible GPUs or 1")
    group.add_argument("--distributed-init-method", metavar="URL",
                       help="where ranks meet: tcp://HOST:PORT, file:///shared/path or env:// "
                            "(default on one node: a free local port)")
    group.add_argument("--distributed-interface", metavar="NAME",
                       help="network interface this node's collectives bind to (gloo and nccl); "
                            "default: the one that routes to the master address, or set "
                            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME")
    group.add_argument("--distributed-port", type=int, default=29500,
                       help="port used with a SLURM node list when no init method is given")
    group.add_argument("--distributed-backend", choices=["gloo", "nccl", "ccl", "mpi"],
                       help="default: nccl on CUDA, gloo on CPU")
    group.add_argument("--distributed-timeout", type=float, default=600, metavar="SECONDS",
                       help="how long start-up and every collective may wait (default: 600)")
    group.add_argument("--job-secret-file", metavar="PATH",
                       help="a file, readable only by you, holding the job's secret (or set "
                            "HETSEQ_JOB_SECRET): only nodes that know it may join (tcp:// only)")
    group.add_argument("--elastic", action="store_true",
                       help="nodes may join and leave while the job trains (docs/elastic.md): "
                            "ranks are given out at the meeting point; needs a job secret, "
                            "--global-batch-size and a tcp:// meeting point")
    group.add_argument("--min-nodes", type=int, default=1, metavar="N",
                       help="--elastic: train only with at least N nodes; below, wait up to "
                            "--distributed-timeout, then save and stop (default: 1)")
    group.add_argument("--max-nodes", type=int, default=0, metavar="M",
                       help="--elastic: at most M nodes take part (0: no limit)")
    group.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="--elastic: a member whose heartbeat stood still this long is lost "
                            "(its connections are cut, so a collective waiting on it ends at "
                            "once); --distributed-timeout then bounds a slow step only "
                            "(default: 5; 0: only --distributed-timeout tells)")
    group.add_argument("--distributed-no-spawn", action="store_true",
                       help="this process is exactly one rank (--distributed-rank), spawn nothing")
    group.add_argument("--device-id", "--local_rank", "--local-rank", type=int, default=0,
                       help="CUDA device of this node's first process (default: 0)")
    group.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is available")
    group.add_argument("--ddp-backend", default="c10d", choices=["c10d"],
                       help=LEGACY + "PyTorch DDP (c10d) is always used")
    group.add_argument("--bucket-cap-mb", type=int, default=25, metavar="MB",
                       help="DDP gradient bucket size (default: 25)")
    group.add_argument("--find-unused-parameters", action="store_true",
                       help="let DDP handle parameters that get no gradient in a step")
    group.add_argument("--fast-stat-sync", action="store_true",
                       help=LEGACY + "stats always travel in one all-reduce per update")
    group.add_argument("--fix-batches-to-gpus", action="store_true",
                       help=LEGACY + "each rank reads only its own slice of every global batch")


def add_training_args(parser):
    group = parser.add_argument_group("Training")
    group.add_argument("--max-epoch", "--me", type=int, default=0, metavar="N",
                       help="stop after N epochs (0: no limit; default: %(default)s)")
    group.add_argument("--max-update", "--mu", type=int, default=0, metavar="N",
                       help="stop after N updates (0: no limit; default: %(default)s)")
    group.add_argument("--update-freq", type=_int_list, default=[1], metavar="N1,N2,...",
                       help="global batches per update (gradient accumulation); "
                            "a list gives one value per epoch, the last repeats (default: 1)")
    group.add_argument("--lr", "--learning-rate", type=_float_list, default=[0.25],
                       metavar="LR_1,LR_2,...",
                       help="peak learning rate; the fixed schedule reads one per epoch "
                            "(default: %(default)s)")
    group.add_argument("--clip-norm", type=float, default=25.0, metavar="NORM",
                       help="clip the gradient norm to this (0: off; the norm is then "
                            "measured after the update, for updates that are logged or go to "
                            "TensorBoard; default: %(default)s)")
    group.add_argument("--max-nan-updates", type=int, default=10, metavar="N",
                       help="stop after N updates in a row with a non-finite loss or gradient "
                            "(each is skipped; default: 10)")
    group.add_argument("--divergence-check-interval", type=int, default=10, metavar="N",
                       help="every N updates, check that all ranks hold the same parameters "
                            "and optimizer state (an exact checksum; 0: never; default: 10)")
    group.add_argument("--divergence-tolerance", type=float, default=1e-4, metavar="REL",
                       help="ranks that drifted from rank 0 by at most this relative "
                            "distance (rounding on different devices) take rank 0's copy; "
                            "further apart, the run stops with exit 4 (0: any difference "
                            "stops it; default: %(default)s)")
    group.add_argument("--use-bmuf", action="store_true", help="not supported (HetSeq flag)")
    add_optimization_args(parser)


class Parser(argparse.ArgumentParser):
    """argparse, with a misspelt flag answered in one line by the nearest
    flags it knows (Python 3.11's argparse prints the whole usage instead)."""

    def error(self, message):
        unknown = message.split("unrecognized arguments: ", 1)
        if len(unknown) == 2:
            words = unknown[1].split()
            flags = [word for word in words if word.startswith("-")]
            # A misspelt flag leaves its value behind too: name the flag only.
            message = "; ".join(self._suggest(word) for word in flags or words)
        self.exit(2, f"{self.prog}: error: {message} (all flags: --help)\n")

    def _suggest(self, word):
        flag = word.split("=", 1)[0]
        known = [o for action in self._actions for o in action.option_strings]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        if not flag.startswith("-"):
            return f"unexpected argument '{word}' (a value without a flag?)"
        return f"unknown flag {flag}" + (f": did you mean {close[0]}?" if close else "")


def build_parser(task_cls=None):
    parser = Parser(
        prog="hetseq-train", allow_abbrev=False,
        description="Synchronous data-parallel training on heterogeneous devices.")
    add_general_args(parser)
    add_dataset_args(parser)
    add_distributed_args(parser)
    add_training_args(parser)
    group = parser.add_argument_group("Memory and precision (ZeRO stages on FSDP2, autocast)")
    sharding.add_args(group)
    precision.add_args(group)
    capacity.add_args(parser.add_argument_group("Capacity: per-rank batch sizes"))
    exchange.add_args(parser.add_argument_group(
        "Slow links: local steps (DiLoCo) and compressed gradients"))
    checkpoint.add_args(parser.add_argument_group("Checkpoints"))
    if task_cls is not None:
        task_cls.add_args(parser.add_argument_group(f"Task '{task_cls.registered_name}'"))
        set_task_defaults(parser, task_cls)
    return parser


def task_dests(task_cls):
    """The dests of the flags a task adds (its own, next to the general ones)."""
    general = {action.dest for action in build_parser()._actions}
    return sorted({action.dest for action in build_parser(task_cls)._actions} - general)


def set_task_defaults(parser, task_cls):
    """The task's own defaults replace the general ones (and show in --help);
    a flag on the command line still wins."""
    dests = {action.dest for action in parser._actions}
    unknown = sorted(set(task_cls.defaults) - dests)
    if unknown:
        raise ValueError(f"task '{task_cls.registered_name}' sets defaults for unknown "
                         f"options {unknown}; use argparse dest names, e.g. 'max_sentences'")
    parser.set_defaults(**task_cls.defaults)


class Flags(argparse.Namespace):
    """The parsed flags, read-only: every component sees what the user typed
    (what the flags leave open is derived in config.py, not written back)."""

    def __setattr__(self, name, value):
        raise AttributeError(f"flags are read-only after parsing (tried to set '{name}'); "
                             "derive values in hetseq/config.py instead")


def parse_args(argv=None):
    """The flags, checked. Parsed in two passes: --user-dir and --task first,
    so the chosen task's flags are part of the parser (and of --help)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--user-dir")
    pre.add_argument("--task")
    known, _ = pre.parse_known_args(argv)
    import_builtin_tasks()
    import_user_dir(known.user_dir)
    task_cls = TASKS.get(known.task) if known.task else None
    parser = build_parser(task_cls)
    args = parser.parse_args(argv)
    args.__class__ = Flags
    check_args(args, {action.dest: action.default for action in parser._actions})
    return args


def parse(argv=None):
    """(flags, JobConfig, NodeConfig): the flags for tasks (``Task.args``),
    the two configurations for everything else."""
    args = parse_args(argv)
    task_cls = TASKS.get(args.task)
    job, node = config.build(args, task_dests(task_cls), task_cls.per_node_flags)
    return args, job, node


def check_args(args, defaults):
    """Rules between flags that argparse cannot express. Reads, never writes.
    ``defaults``: {dest: default} of the parser (a flag's default is written
    once, where the flag is declared)."""
    if args.max_tokens is not None:
        raise UserError(f"--max-tokens {args.max_tokens}: token-budget batching is not supported "
                        "yet; use --max-sentences (samples per rank)")
    if args.use_bmuf:
        raise UserError("--use-bmuf is not supported: HetSeq updates are always fully synchronous")
    if args.capacity not in ("manual", "equal", "auto"):
        capacity.parse_weights(args.capacity, len(args.capacity.split(",")))
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise UserError(f"--global-batch-size {args.global_batch_size}: expected 1 or more")
    if args.max_sentences is not None and args.max_sentences < 1:
        raise UserError(f"--max-sentences {args.max_sentences}: expected 1 or more samples per rank")
    if any(freq < 1 for freq in args.update_freq):
        raise UserError(f"--update-freq {args.update_freq}: expected positive integers")
    if not args.lr or any(lr < 0 for lr in args.lr):
        raise UserError(f"--lr {args.lr}: expected non-negative learning rates")
    if args.distributed_timeout <= 0:
        raise UserError(f"--distributed-timeout {args.distributed_timeout}: expected seconds > 0")
    if args.divergence_check_interval < 0 or not args.divergence_tolerance >= 0:
        raise UserError(f"--divergence-check-interval {args.divergence_check_interval} / "
                        f"--divergence-tolerance {args.divergence_tolerance}: expected an "
                        "interval >= 0 updates and a relative distance >= 0")
    check_elastic(args, defaults)
    exchange.check_args(args, defaults)
    sharding.check_args(args)
    precision.check_args(args)
    OPTIMIZERS.get(args.optimizer)        # unknown names list the registered ones
    SCHEDULERS.get(args.lr_scheduler)


def check_elastic(args, defaults):
    """--elastic: the meeting point gives out ranks and the split follows the members."""
    if not args.elastic:
        given = config.given_flags(args, defaults, ("min_nodes", "max_nodes",
                                                    "heartbeat_timeout"))
        if given:
            raise UserError(f"{' and '.join(given)} bound an --elastic job; add --elastic")
        return
    given = [flag for flag, value in (("--distributed-rank", args.distributed_rank),
                                      ("--distributed-world-size", args.distributed_world_size))
             if value is not None]
    if given:
        raise UserError(f"--elastic gives out ranks at the meeting point: drop {' and '.join(given)}")
    if args.distributed_no_spawn:
        raise UserError("--elastic starts the node's processes itself (--distributed-gpus "
                        "of them): drop --distributed-no-spawn")
    if not (args.distributed_init_method or "").startswith("tcp://"):
        raise UserError(f"--elastic needs --distributed-init-method tcp://HOST:PORT (a node of "
                        f"the job), got {args.distributed_init_method}")
    if args.distributed_backend in ("ccl", "mpi"):
        raise UserError(f"--elastic restarts the process group when members change: it works "
                        f"with gloo and nccl, not --distributed-backend {args.distributed_backend}")
    if args.global_batch_size is None:
        raise UserError("--elastic needs --global-batch-size: the global batch must not change "
                        "when nodes come and go")
    if args.zero:
        raise UserError(f"--elastic supports --zero 0 only (got --zero {args.zero}): a sharded "
                        "state is lost with the host that held a shard")
    if args.heartbeat_timeout and args.heartbeat_timeout < 2 * health.INTERVAL_S:
        raise UserError(f"--heartbeat-timeout {args.heartbeat_timeout:g}: expected 0 (off) or at "
                        f"least {2 * health.INTERVAL_S:g} s, two heartbeats")
    if args.min_nodes < 1 or (args.max_nodes and args.max_nodes < args.min_nodes):
        raise UserError(f"--min-nodes {args.min_nodes} / --max-nodes {args.max_nodes}: expected "
                        "1 <= min-nodes <= max-nodes (0: no maximum)")
