"""The two configurations of a run, built once from the flags: ``JobConfig``
(what every node must agree on; the job identity is computed from it) and
``NodeConfig`` (what may differ per node). The update path receives
sections of ``JobConfig`` only, so a node's own flags cannot change which
collectives its ranks issue. A flag is declared once, as a field of its
section; sections live beside their components, and this module assembles
them (docs/design.md, "Two configurations")."""

import json
import os

import hetseq
from hetseq.digests import code_digest, file_digest, source_digest
from hetseq.optim import OptimizerConfig, ScheduleConfig
from hetseq.plan.capacity import CapacityConfig, ShareConfig
from hetseq.run.checkpoint import CheckpointConfig
from hetseq.sections import Section, flag, frozen, int_list, not_a_flag, section
from hetseq.update.agreement import AgreementConfig
from hetseq.update.modes import ExchangeConfig
from hetseq.update.precision import PrecisionConfig
from hetseq.update.sharding import ShardingConfig
from hetseq.update.step import UpdateConfig

# Flags of the original HetSeq that change nothing (accepted, see cli.LEGACY),
# and flags that only exist to be refused with a message (cli.check_args).
NO_EFFECT = frozenset({"ddp_backend", "fast_stat_sync", "fix_batches_to_gpus",
                       "required_batch_size_multiple", "max_tokens_valid", "max_tokens",
                       "use_bmuf", "help"})


# ---- the job's sections declared here (the others beside their components) ----

@section
class TrainingConfig(Section):
    """The loop: which data, how long, when to validate (run/loop.py)."""
    seed: int = flag(19940802, type=int, help="random seed (default: %(default)s)")
    train_subset: str = flag("train", metavar="SPLIT", help="split to train on (default: train)")
    valid_subset: str = flag("valid", metavar="SPLITS",
                             help="comma-separated splits to validate on after each epoch "
                                  "(default: valid)")
    validate_interval: int = flag(1, type=int, metavar="N",
                                  help="validate every N epochs (default: 1)")
    validate_interval_updates: int = flag(0, type=int, metavar="N",
                                          help="also validate after every N updates (0: only at "
                                               "epoch ends; --local-steps: a round ends there) "
                                               "(default: 0)")
    disable_validation: bool = flag(False, action="store_true", help="do not validate")
    curriculum: int = flag(0, type=int, metavar="N",
                           help="do not shuffle the data in the first N epochs")
    max_epoch: int = flag(0, type=int, names=("--me",), metavar="N",
                          help="stop after N epochs (0: no limit; default: %(default)s)")
    max_update: int = flag(0, type=int, names=("--mu",), metavar="N",
                           help="stop after N updates (0: no limit; default: %(default)s)")
    update_freq: tuple = flag([1], type=int_list, metavar="N1,N2,...",
                              help="global batches per update (gradient accumulation); a list "
                                   "gives one value per epoch, the last repeats (default: 1)")

    @property
    def valid_subsets(self):
        return tuple(self.valid_subset.split(","))

    def update_freq_at(self, epoch):
        """Global batches per update in ``epoch`` (the list's last value repeats)."""
        return self.update_freq[min(epoch, len(self.update_freq)) - 1]


@section
class ElasticConfig(Section):
    """Nodes that come and go (hetseq/elastic/)."""
    elastic: bool = flag(False, action="store_true",
                         help="nodes may join and leave while the job trains (docs/elastic.md): "
                              "ranks are given out at the meeting point; needs a job secret, "
                              "--global-batch-size and a tcp:// meeting point")
    min_nodes: int = flag(1, type=int, metavar="N",
                          help="--elastic: train only with at least N nodes; below, wait up to "
                               "--distributed-timeout, then save and stop (default: 1)")
    max_nodes: int = flag(0, type=int, metavar="M",
                          help="--elastic: at most M nodes take part (0: no limit)")
    # A member silent this long is lost (elastic/watchdog.py).
    heartbeat_timeout: float = flag(5.0, type=float, metavar="SECONDS",
                                    help="--elastic: a member whose heartbeat stood still this "
                                         "long is lost (its connections are cut, so a collective "
                                         "waiting on it ends at once); --distributed-timeout "
                                         "then bounds a slow step only (default: 5; 0: only "
                                         "--distributed-timeout tells)")


@section
class JobConfig(Section):
    """Everything every node of the job must agree on."""
    task: str = flag(None, required=True, metavar="NAME",
                     help="what to train; see the registered tasks in the error of a wrong name")
    distributed_backend: str | None = flag(None, choices=["gloo", "nccl", "ccl", "mpi"],
                                           help="default: nccl on CUDA, gloo on CPU")
    sharding: ShardingConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    update: UpdateConfig
    exchange: ExchangeConfig
    agreement: AgreementConfig
    training: TrainingConfig
    capacity: CapacityConfig
    checkpoint: CheckpointConfig
    elastic: ElasticConfig
    task_flags: tuple = ()        # (dest, value) of the task's own job-wide flags
    # The --user-dir's code: a task or exchange mode there decides the update.
    user_code: str | None = not_a_flag()

    def identity(self):
        """{flag: value} that a node presents at rendezvous, plus HetSeq's
        version and code. A flag naming a file (a model config, a vocab) is
        compared by the file's content, since each node may keep its copy
        elsewhere; one naming a folder is each node's own location."""
        out = {"hetseq_version": hetseq.__version__, "hetseq_code": code_digest()}
        if self.user_code is not None:
            out["user_code"] = self.user_code
        flags = self.flags()
        for dest in self.exchange.unused():     # at their defaults; maybe not on every node
            del flags[dest]
        for name, value in sorted(flags.items()):
            if isinstance(value, str) and os.path.isfile(value):
                value = file_digest(os.path.abspath(value))
            elif isinstance(value, str) and os.path.isdir(value):
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        return json.loads(json.dumps(out))     # plain JSON types, as compared in the store


# ---- the node's sections ----

@section
class LaunchConfig(Section):
    """Which ranks this node runs, on which devices, and where they meet
    (distributed/topology.py, rendezvous.py). The world size is compared
    when ranks claim their numbers, with a message of its own."""
    distributed_world_size: int | None = flag(
        None, type=int, metavar="N",
        help="processes in the whole job (default: visible GPUs, or 1 on CPU)")
    distributed_rank: int | None = flag(
        None, type=int, metavar="R",
        help="global rank of this node's FIRST process (default: 0, or from the "
             "torchrun/MPI/SLURM environment)")
    distributed_gpus: int | None = flag(
        None, type=int, metavar="G",
        help="processes to start on this node, one per device (CPU: G CPU processes); "
             "default: all ranks on one node, else the visible GPUs or 1")
    distributed_init_method: str | None = flag(
        None, metavar="URL",
        help="where ranks meet: tcp://HOST:PORT, file:///shared/path or env:// "
             "(default on one node: a free local port)")
    distributed_interface: str | None = flag(
        None, metavar="NAME",
        help="network interface this node's collectives bind to (gloo and nccl); default: "
             "the one that routes to the master address, or set GLOO_SOCKET_IFNAME / "
             "NCCL_SOCKET_IFNAME")
    distributed_port: int = flag(
        29500, type=int, help="port used with a SLURM node list when no init method is given")
    distributed_timeout: float = flag(
        600, type=float, metavar="SECONDS",
        help="how long start-up and every collective may wait (default: 600)")
    distributed_no_spawn: bool = flag(
        False, action="store_true",
        help="this process is exactly one rank (--distributed-rank), spawn nothing")
    # The secret itself never enters a config.
    job_secret_file: str | None = flag(
        None, metavar="PATH",
        help="a file, readable only by you, holding the job's secret (or set "
             "HETSEQ_JOB_SECRET): only nodes that know it may join (tcp:// only)")
    device_id: int = flag(0, type=int, names=("--local_rank", "--local-rank"),
                          help="CUDA device of this node's first process (default: 0)")
    cpu: bool = flag(False, action="store_true", help="train on CPU even if CUDA is available")


def save_dir(args):
    """--save-dir, by default checkpoints/<task>."""
    return args.save_dir or os.path.join("checkpoints", args.task)


@section
class SaveConfig(Section):
    """Where this node keeps checkpoints and the balance log."""
    save_dir: str = flag(None, metavar="DIR",
                         help="where checkpoints, balance.jsonl and TensorBoard go (default: "
                              "checkpoints/<task>)")
    restore_file: str = flag("checkpoint_last.pt", metavar="FILE",
                             help="checkpoint to resume from, relative to --save-dir unless "
                                  "absolute (default: checkpoint_last.pt; a missing file starts "
                                  "afresh)")
    no_save: bool = flag(False, action="store_true", help="do not write checkpoints")

    @classmethod
    def from_args(cls, args):
        return super().from_args(args, save_dir=save_dir(args))


@section
class LogConfig(Section):
    """What this node prints and writes for people to read."""
    no_progress_bar: bool = flag(False, action="store_true",
                                 help="plain log lines, no tqdm bar")
    log_interval: int = flag(1, type=int, metavar="N",
                             help="log every N updates when there is no progress bar "
                                  "(default: 1)")
    log_format: str = flag("tqdm", choices=["tqdm", "simple", "json", "none"],
                           help="'tqdm' shows a bar; any other value logs plain lines "
                                "(default: tqdm)")
    log_all_ranks: bool = flag(False, action="store_true",
                               help="log INFO on every rank, not only rank 0")
    tensorboard_logdir: str | None = flag(None, metavar="DIR",
                                          help="write TensorBoard scalars here (rank 0; default: "
                                               "<save-dir>/tensorboard, none with --no-save)")
    no_tensorboard: bool = flag(False, action="store_true",
                                help="write no TensorBoard scalars")

    @classmethod
    def from_args(cls, args):
        # Any --log-format but tqdm means plain log lines. TensorBoard writes
        # into <save-dir>/tensorboard unless told where, or not to (--no-save
        # writes nothing into the save dir).
        logdir = args.tensorboard_logdir
        if logdir is None and not (args.no_tensorboard or args.no_save):
            logdir = os.path.join(save_dir(args), "tensorboard")
        return super().from_args(args, no_progress_bar=args.no_progress_bar
                                 or args.log_format != "tqdm",
                                 tensorboard_logdir=None if args.no_tensorboard else logdir)


@section
class NodeConfig(Section):
    """Everything that may differ from node to node."""
    user_dir: str | None = flag(None, metavar="DIR",
                                help="a directory of your own tasks and exchange modes to import "
                                     "(docs/tasks.md, docs/design.md)")
    # Each node's own folder; datasets must agree in size.
    data: str | None = flag(None, metavar="DIR", help="where the task reads its data")
    num_workers: int = flag(0, type=int, metavar="N",
                            help="data-loader worker processes per rank (default: 0)")
    launch: LaunchConfig
    shares: ShareConfig
    save: SaveConfig
    log: LogConfig
    task_flags: tuple = ()    # (dest, value) of the task's per-node flags


JOB_SECTIONS = {"sharding": ShardingConfig, "precision": PrecisionConfig,
                "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
                "update": UpdateConfig, "exchange": ExchangeConfig,
                "agreement": AgreementConfig,
                "training": TrainingConfig, "capacity": CapacityConfig,
                "checkpoint": CheckpointConfig, "elastic": ElasticConfig}
NODE_SECTIONS = {"launch": LaunchConfig, "shares": ShareConfig, "save": SaveConfig,
                 "log": LogConfig}


def build(args, task_dests=(), task_per_node=frozenset(), exchange=None):
    """(JobConfig, NodeConfig) from parsed flags. ``task_dests``: the flags the
    task added; those in ``task_per_node`` (the task's ``per_node_flags``)
    may differ per node, the rest are the job's. ``exchange``: the
    ExchangeConfig (update/modes' ``configure``: the modes are plugins; a
    caller that reads the node's config only may leave it out)."""
    task_flags = sorted((d, frozen(getattr(args, d))) for d in task_dests)
    job = JobConfig(task=args.task, distributed_backend=args.distributed_backend,
                    **{name: cls.from_args(args) if cls is not ExchangeConfig else exchange
                       for name, cls in JOB_SECTIONS.items()},
                    task_flags=tuple((d, v) for d, v in task_flags if d not in task_per_node),
                    user_code=source_digest(args.user_dir, every_file=True)
                    if args.user_dir and os.path.isdir(args.user_dir) else None)
    node = NodeConfig(data=args.data, num_workers=args.num_workers, user_dir=args.user_dir,
                      **{name: cls.from_args(args) for name, cls in NODE_SECTIONS.items()},
                      task_flags=tuple((d, v) for d, v in task_flags if d in task_per_node))
    return job, node


def per_node_flags(node):
    """The dests of every flag that may differ per node."""
    return frozenset(node.flags())
