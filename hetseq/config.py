"""The two configurations of a run, built once from the flags.

``JobConfig`` holds what every node must agree on: the job identity that
nodes present at rendezvous (distributed/identity.py) is computed from it, so
the two cannot drift apart. ``NodeConfig`` holds what may differ per node: its
devices, its share of the work, where it keeps files and what it prints.

The update path (controller.py, sharding.py, precision.py, stats.py,
agreement.py) receives sections of ``JobConfig`` only. A node's own choices
therefore cannot change which collectives its ranks issue: ranks that paired
different collectives would hang or compute wrong numbers.

Every field is named after its flag (``--clip-norm`` is ``clip_norm``), so a
message can name the flag and the flags' help is the fields' documentation.
``tests/test_config.py`` checks that every flag lands in exactly one of the two.
"""

import dataclasses
import json
import os

import hetseq
from hetseq.digests import code_digest, file_digest

# Flags of the original HetSeq that change nothing (accepted, see cli.LEGACY),
# and flags that only exist to be refused with a message (cli.check_args).
NO_EFFECT = frozenset({"ddp_backend", "fast_stat_sync", "fix_batches_to_gpus",
                       "required_batch_size_multiple", "max_tokens_valid", "max_tokens",
                       "use_bmuf", "help"})


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


class _Section:
    """A frozen dataclass read from the flags of the same names."""

    @classmethod
    def from_args(cls, args, **derived):
        values = {f.name: _frozen(getattr(args, f.name)) for f in dataclasses.fields(cls)
                  if f.name not in derived}
        return cls(**values, **derived)

    def flags(self):
        """{flag dest: value} of this section (nested sections flattened)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, _Section):
                out.update(value.flags())
            elif field.name != "task_flags":
                out[field.name] = value
        out.update(dict(getattr(self, "task_flags", ())))
        return out


def section(cls):
    return dataclasses.dataclass(frozen=True)(cls)


# ---- the job's sections ----

@section
class ShardingConfig(_Section):
    """How the model state is held across ranks (sharding.py)."""
    zero: int
    cpu_offload: bool
    bucket_cap_mb: int            # DDP's buckets are collectives: every rank the same
    find_unused_parameters: bool
    compile: bool                 # the job's: compiled kernels round differently


@section
class PrecisionConfig(_Section):
    """Autocast, loss scaling and the dtype gradients are summed in (precision.py)."""
    bf16: bool
    fp16: bool
    fp16_init_scale: float
    fp16_scale_window: int | None
    min_loss_scale: float
    reduce_dtype: str


@section
class OptimizerConfig(_Section):
    """The optimizer and its settings (optim/__init__.py)."""
    optimizer: str
    weight_decay: float
    adam_betas: str
    adam_eps: float
    adadelta_rho: float
    adadelta_eps: float
    momentum: float
    nesterov: bool


@section
class ScheduleConfig(_Section):
    """The learning-rate schedule (optim/lr_scheduler.py)."""
    lr_scheduler: str
    lr: tuple
    warmup_updates: int | None
    warmup_ratio: float | None
    total_num_update: int
    end_learning_rate: float
    min_lr: float
    power: float
    warmup_init_lr: float
    force_anneal: int | None
    lr_shrink: float


@section
class UpdateConfig(_Section):
    """What the Controller does with a summed gradient."""
    clip_norm: float
    max_nan_updates: int


@section
class ExchangeConfig(_Section):
    """How ranks exchange what they learned (local_steps.py, distributed/compress.py):
    every update or every H inner steps, and in how many bytes."""
    local_steps: int
    outer_lr: float
    outer_momentum: float
    outer_overlap: bool
    outer_dtype: str
    grad_compression: str
    powersgd_rank: int
    powersgd_start: int
    powersgd_min_compression: float


@section
class AgreementConfig(_Section):
    """How ranks are kept equal to rank 0 (agreement.py)."""
    divergence_check_interval: int
    divergence_tolerance: float


@section
class TrainingConfig(_Section):
    """The loop: which data, how long, when to validate (train.py)."""
    seed: int
    train_subset: str
    valid_subset: str
    validate_interval: int
    validate_interval_updates: int
    disable_validation: bool
    curriculum: int
    max_epoch: int
    max_update: int
    update_freq: tuple

    @property
    def valid_subsets(self):
        return tuple(self.valid_subset.split(","))

    def update_freq_at(self, epoch):
        """Global batches per update in ``epoch`` (the list's last value repeats)."""
        return self.update_freq[min(epoch, len(self.update_freq)) - 1]


@section
class CapacityConfig(_Section):
    """How the global batch is split between ranks (capacity.py)."""
    capacity: str
    global_batch_size: int | None
    no_rebalance: bool


@section
class ElasticConfig(_Section):
    """Nodes that come and go (hetseq/run/elastic.py, distributed/membership.py)."""
    elastic: bool
    min_nodes: int
    max_nodes: int
    heartbeat_timeout: float      # a member silent this long is lost (health.Watchdog)


@section
class CheckpointConfig(_Section):
    """When a run saves, what it keeps and what a resume loads (checkpoint.py)."""
    save_interval: int
    save_interval_updates: int
    keep_interval_updates: int
    keep_last_epochs: int
    no_epoch_checkpoints: bool
    best_checkpoint_metric: str
    maximize_best_checkpoint_metric: bool
    export_hf: str | None
    reset_optimizer: bool
    reset_lr_scheduler: bool
    reset_dataloader: bool
    reset_meters: bool

    @classmethod
    def from_args(cls, args):
        maximize = args.maximize_best_checkpoint_metric
        if maximize is None:     # as Hugging Face: larger is better but for a loss
            maximize = not args.best_checkpoint_metric.endswith("loss")
        return super().from_args(args, maximize_best_checkpoint_metric=maximize)


@section
class JobConfig(_Section):
    """Everything every node of the job must agree on."""
    task: str
    distributed_backend: str | None
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

    def identity(self):
        """{flag: value} that a node presents at rendezvous, plus HetSeq's
        version and code. A flag naming a file (a model config, a vocab) is
        compared by the file's content, since each node may keep its copy
        elsewhere; one naming a folder is each node's own location."""
        out = {"hetseq_version": hetseq.__version__, "hetseq_code": code_digest()}
        for name, value in sorted(self.flags().items()):
            if isinstance(value, str) and os.path.isfile(value):
                value = file_digest(os.path.abspath(value))
            elif isinstance(value, str) and os.path.isdir(value):
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        return json.loads(json.dumps(out))     # plain JSON types, as compared in the store


# ---- the node's sections ----

@section
class LaunchConfig(_Section):
    """Which ranks this node runs, on which devices, and where they meet
    (distributed/topology.py, rendezvous.py). The world size is compared
    when ranks claim their numbers, with a message of its own."""
    distributed_world_size: int | None
    distributed_rank: int | None
    distributed_gpus: int | None
    distributed_init_method: str | None
    distributed_interface: str | None
    distributed_port: int
    distributed_timeout: float
    distributed_no_spawn: bool
    job_secret_file: str | None   # the secret itself never enters a config
    device_id: int
    cpu: bool


@section
class ShareConfig(_Section):
    """This node's share of the work and its memory (capacity.py)."""
    max_sentences: int | None
    max_sentences_valid: int | None
    capacity_weight: float | None
    micro_batch_cap: int
    max_memory_gb: float | None

    @classmethod
    def from_args(cls, args):
        valid = args.max_sentences_valid
        return super().from_args(
            args, max_sentences_valid=args.max_sentences if valid is None else valid)


def save_dir(args):
    """--save-dir, by default checkpoints/<task>."""
    return args.save_dir or os.path.join("checkpoints", args.task)


@section
class SaveConfig(_Section):
    """Where this node keeps checkpoints and the balance log."""
    save_dir: str
    restore_file: str
    no_save: bool

    @classmethod
    def from_args(cls, args):
        return super().from_args(args, save_dir=save_dir(args))


@section
class LogConfig(_Section):
    """What this node prints and writes for people to read."""
    log_interval: int
    log_format: str
    log_all_ranks: bool
    no_progress_bar: bool
    tensorboard_logdir: str | None
    no_tensorboard: bool

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
class NodeConfig(_Section):
    """Everything that may differ from node to node."""
    data: str | None          # each node's own folder; datasets must agree in size
    num_workers: int
    user_dir: str | None
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


def build(args, task_dests=(), task_per_node=frozenset()):
    """(JobConfig, NodeConfig) from parsed flags. ``task_dests``: the flags the
    task added; those in ``task_per_node`` (the task's ``per_node_flags``)
    may differ per node, the rest are the job's."""
    task_flags = sorted((d, _frozen(getattr(args, d))) for d in task_dests)
    job = JobConfig(task=args.task, distributed_backend=args.distributed_backend,
                    **{name: cls.from_args(args) for name, cls in JOB_SECTIONS.items()},
                    task_flags=tuple((d, v) for d, v in task_flags if d not in task_per_node))
    node = NodeConfig(data=args.data, num_workers=args.num_workers, user_dir=args.user_dir,
                      **{name: cls.from_args(args) for name, cls in NODE_SECTIONS.items()},
                      task_flags=tuple((d, v) for d, v in task_flags if d in task_per_node))
    return job, node


def per_node_flags(node):
    """The dests of every flag that may differ per node."""
    return frozenset(node.flags())


def given_flags(args, defaults, dests):
    """The flags among ``dests`` set to other than their default (``defaults``:
    the parser's, so a default is written once, where its flag is declared)."""
    return ["--" + dest.replace("_", "-") for dest in dests
            if getattr(args, dest) != defaults[dest]]


# ---- digests for the identity ----


