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
from hetseq.app.digests import code_digest, file_digest, source_digest
from hetseq.distributed.topology import LaunchConfig
from hetseq.elastic.hooks import ElasticConfig
from hetseq.optim import OptimizerConfig, ScheduleConfig
from hetseq.plan.capacity import CapacityConfig, ShareConfig
from hetseq.reporting.report import LogConfig
from hetseq.run.checkpoint import CheckpointConfig, SaveConfig
from hetseq.run.events import TrainingConfig
from hetseq.base.sections import Section, flag, frozen, not_a_flag, section
from hetseq.update.agreement import AgreementConfig
from hetseq.update.modes import ExchangeConfig
from hetseq.update.precision import PrecisionConfig
from hetseq.update.zero.sharding import ShardingConfig
from hetseq.update.controller import UpdateConfig

# Flags of the original HetSeq that change nothing (accepted, see cli.LEGACY),
# and flags that only exist to be refused with a message (cli.check_args).
NO_EFFECT = frozenset({"ddp_backend", "fast_stat_sync", "fix_batches_to_gpus",
                       "required_batch_size_multiple", "max_tokens_valid", "max_tokens",
                       "use_bmuf", "help"})


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
    sections = {name: cls.from_args(args) for name, cls in NODE_SECTIONS.items()
                if cls is not LogConfig}
    sections["log"] = LogConfig.from_args(args, sections["save"].save_dir)
    node = NodeConfig(data=args.data, num_workers=args.num_workers, user_dir=args.user_dir,
                      **sections,
                      task_flags=tuple((d, v) for d, v in task_flags if d in task_per_node))
    return job, node


def per_node_flags(node):
    """The dests of every flag that may differ per node."""
    return frozenset(node.flags())
