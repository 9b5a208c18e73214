"""The command line: the parser, assembled from the config sections.

A flag is declared once, as a field of the section it configures
(sections.py; the sections live beside their components and config.py
gathers them): this module only arranges the sections into --help's
groups, and declares the flags of the original HetSeq that are in no
section (they change nothing, or are refused: ``LEGACY``). Tasks and
exchange modes add their own flags.
"""

import argparse
import contextlib

from hetseq.app import config
from hetseq.distributed import health
from hetseq.base.errors import UserError
from hetseq.base.flags import Parser
from hetseq.optim import OPTIMIZERS, SCHEDULERS
from hetseq.plan import capacity
from hetseq.base.sections import given_flags
from hetseq.tasks import TASKS, import_builtin_tasks, import_user_dir
from hetseq.update import modes, precision
from hetseq.update.zero import sharding

LEGACY = "accepted for HetSeq compatibility; no effect: "

# --help's groups: a title (None: argparse's own, the general flags) and the
# sections whose flags it shows; the exchange modes' and the legacy flags follow.
GROUPS = (
    (None, (config.JobConfig, config.NodeConfig)),
    ("Training", (config.TrainingConfig,)),
    ("Logging", (config.LogConfig,)),
    ("Distributed training", (config.LaunchConfig,)),
    ("Elastic: nodes that come and go", (config.ElasticConfig,)),
    ("Capacity: per-rank batch sizes", (config.CapacityConfig, config.ShareConfig)),
    ("Memory and precision (ZeRO stages on FSDP2, autocast)",
     (config.ShardingConfig, config.PrecisionConfig)),
    ("The update: clipping, skipped updates, ranks kept equal",
     (config.UpdateConfig, config.AgreementConfig)),
    ("Optimizer", (config.OptimizerConfig,)),
    ("Learning-rate schedule", (config.ScheduleConfig,)),
    ("Checkpoints", (config.SaveConfig, config.CheckpointConfig)),
)


def add_legacy_args(group):
    """Flags of the original HetSeq in no section: accepted with no effect
    (config.NO_EFFECT), or refused with a message by ``check_args``."""
    group.add_argument("--max-tokens", type=int, metavar="N",
                       help="token budget per batch: not supported yet, use --max-sentences")
    group.add_argument("--max-tokens-valid", type=int, metavar="N",
                       help=LEGACY + "see --max-tokens")
    group.add_argument("--required-batch-size-multiple", type=int, default=1, metavar="N",
                       help=LEGACY + "batches are sliced from exact global batches")
    group.add_argument("--ddp-backend", default="c10d", choices=["c10d"],
                       help=LEGACY + "PyTorch DDP (c10d) is always used")
    group.add_argument("--fast-stat-sync", action="store_true",
                       help=LEGACY + "stats always travel in one all-reduce per update")
    group.add_argument("--fix-batches-to-gpus", action="store_true",
                       help=LEGACY + "each rank reads only its own slice of every global batch")
    group.add_argument("--use-bmuf", action="store_true", help="not supported (HetSeq flag)")


def build_parser(task_cls=None, add_help=True, prog="hetseq-train"):
    """The parser of the train command (``prog``: its name in errors and --help)."""
    parser = Parser(
        prog=prog, allow_abbrev=False, add_help=add_help,
        description="Synchronous data-parallel training on heterogeneous devices.")
    for title, sections in GROUPS:
        group = parser if title is None else parser.add_argument_group(title)
        for section in sections:
            section.add_args(group)
    with _declared_by("an exchange mode (update/modes/ or a --user-dir's)"):
        modes.add_args(parser)
    add_legacy_args(parser.add_argument_group("Flags of the original HetSeq"))
    if task_cls is not None:
        with _declared_by(f"task '{task_cls.registered_name}'"):
            task_cls.add_args(parser.add_argument_group(f"Task '{task_cls.registered_name}'"))
        set_task_defaults(parser, task_cls)
    return parser


@contextlib.contextmanager
def _declared_by(who):
    """A plugin's flag that HetSeq (or another plugin) already declares: one
    line naming it, not argparse's traceback."""
    try:
        yield
    except argparse.ArgumentError as err:
        raise UserError(f"{who} declares a flag that is already taken ({err}); "
                        "give it a name of its own, e.g. with the plugin's prefix") from None


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
                             "derive values in hetseq/app/config.py instead")


def parse_args(argv=None, prog="hetseq-train"):
    """The flags, checked. Parsed in two passes: --user-dir and --task first,
    so the chosen task's flags are part of the parser (and of --help)."""
    pre = build_parser(add_help=False, prog=prog)   # the flags as declared, none required
    for action in pre._actions:             # yet: --help may come without --task
        action.required = False
    known, _ = pre.parse_known_args(argv)
    import_builtin_tasks()
    import_user_dir(known.user_dir)
    task_cls = TASKS.get(known.task) if known.task else None
    parser = build_parser(task_cls, prog=prog)
    args = parser.parse_args(argv)
    args.__class__ = Flags
    check_args(args, {action.dest: action.default for action in parser._actions})
    return args


def parse(argv=None, prog="hetseq-train"):
    """(flags, JobConfig, NodeConfig): the flags for tasks (``Task.args``),
    the two configurations for everything else; ``prog``: the command's name."""
    args = parse_args(argv, prog)
    task_cls = TASKS.get(args.task)
    job, node = config.build(args, task_dests(task_cls), task_cls.per_node_flags,
                             modes.configure(args))
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
        raise UserError(f"--max-sentences {args.max_sentences}: expected 1 or more samples "
                        "per rank")
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
    modes.check_args(args, defaults)
    sharding.check_args(args)
    precision.check_args(args)
    OPTIMIZERS.get(args.optimizer)        # unknown names list the registered ones
    SCHEDULERS.get(args.lr_scheduler)


def check_elastic(args, defaults):
    """--elastic: the meeting point gives out ranks and the split follows the members."""
    if not args.elastic:
        given = given_flags(args, defaults, ("min_nodes", "max_nodes",
                                                    "heartbeat_timeout"))
        if given:
            raise UserError(f"{' and '.join(given)} bound an --elastic job; add --elastic")
        return
    given = [flag for flag, value in (("--distributed-rank", args.distributed_rank),
                                      ("--distributed-world-size", args.distributed_world_size))
             if value is not None]
    if given:
        raise UserError("--elastic gives out ranks at the meeting point: drop "
                        + " and ".join(given))
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
    if args.heartbeat_timeout and args.heartbeat_timeout < 2 * health.INTERVAL_S:
        raise UserError(f"--heartbeat-timeout {args.heartbeat_timeout:g}: expected 0 (off) or at "
                        f"least {2 * health.INTERVAL_S:g} s, two heartbeats")
    if args.min_nodes < 1 or (args.max_nodes and args.max_nodes < args.min_nodes):
        raise UserError(f"--min-nodes {args.min_nodes} / --max-nodes {args.max_nodes}: expected "
                        "1 <= min-nodes <= max-nodes (0: no maximum)")
