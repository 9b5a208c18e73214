"""How the model state is held across ranks (``--zero 0|1|2|3``, ``--cpu-offload``):
DeepSpeed ZeRO's stages built on PyTorch's own engines (DDP,
ZeroRedundancyOptimizer, FSDP2), so a job trades memory for communication
without changing the update. Every mode leaves each rank (a shard of) the
gradients' sum over ranks divided by W, and checkpoints hold the full state in
one format (docs/memory-and-precision.md; docs/design.md, 'The gradient math').
"""

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetseq.base.errors import UserError
from hetseq.base.registry import Registry
from hetseq.base.sections import Section, flag, section
from hetseq.update import stats
from hetseq.update.zero import flat_units, full_state, whole_weights
from hetseq.update.zero.held import optimizer_tensors, settings
from hetseq.update.zero.whole_weights import (full_weights, holds, named_weights)  # noqa: F401 (also sharding.*)

logger = logging.getLogger(__name__)


@section
class ShardingConfig(Section):
    """How the model state is held across ranks: every rank of the job the same."""
    zero: int = flag(0, type=int, choices=(0, 1, 2, 3),
                     help="ZeRO stage: 0 replicas (DDP), 1 optimizer state sharded, "
                          "2 + gradients sharded (FSDP2), 3 + parameters sharded (FSDP2) "
                          "(default: 0)")
    cpu_offload: bool = flag(False, action="store_true",
                             help="with --zero 3: keep parameters, gradients and the optimizer "
                                  "step on the host (FSDP2 CPUOffloadPolicy)")
    state_shares: str = flag("auto", choices=("auto", "even", "memory"),
                             help="with --zero 1/2/3: each rank's share of the sharded state: "
                                  "even, or memory (proportional to the memory each rank has "
                                  "for it; HetSeq's own uneven shards); auto: memory when the "
                                  "ranks' memories differ by more than 10%% (default: auto)")
    # DDP's buckets are collectives: every rank the same.
    bucket_cap_mb: int = flag(25, type=int, metavar="MB",
                              help="DDP gradient bucket size (default: 25)")
    find_unused_parameters: bool = flag(False, action="store_true",
                                        help="let DDP handle parameters that get no gradient "
                                             "in a step")
    # The job's: compiled kernels round differently.
    compile: bool = flag(False, action="store_true",
                         help="torch.compile the model's forward and backward (off by default: "
                              "start-up takes longer, from seconds to minutes; pays on GPUs, "
                              "see docs/memory-and-precision.md)")


def check_args(args):
    if args.cpu_offload and args.zero != 3:
        raise UserError(f"--cpu-offload needs --zero 3 (got --zero {args.zero}): offloading "
                        "keeps the sharded parameters on the host; add --zero 3")
    if args.zero >= 2 and args.find_unused_parameters:
        raise UserError(f"--find-unused-parameters is a DDP option and --zero {args.zero} uses "
                        "FSDP, which needs no such flag; drop it (or use --zero 0 or 1)")


class Sharding:
    """Base for a mode: replicated gradients, full state on every rank."""
    shards_grads = False   # True: each rank holds only a shard of each gradient
    lockstep = False       # True: every forward communicates, so every rank must
                           # run the same number of micro-batches per update
    sits_out = False       # True: a rank may leave the gradient exchange (update/members.py):
                           # every rank holds the whole state, the members' group sums

    shares = None          # every rank's fraction of the split state (None: even)

    def __init__(self, cfg, precision, ctx, comm_hook=None):
        # ShardingConfig, PrecisionConfig; ``comm_hook``: (state, hook) for
        # DDP's gradient all-reduce, from the exchange mode (exchange.py)
        self.cfg, self.precision, self.ctx, self.comm_hook = cfg, precision, ctx, comm_hook
        self.group = None      # the members' process group (None: the world's)

    def describe(self):
        return f"--zero {self.registered_name}"

    def wrap(self, model):
        """The module the task calls (the model itself, or a wrapper)."""
        return model

    def build_optimizer(self, optimizer):
        """The optimizer to step, from the plain one over all parameters."""
        return optimizer

    def sync(self, wrapped, last):
        """Context for a micro-batch: gradients communicated only on the last."""
        return contextlib.nullcontext()

    def can_idle(self):
        """Whether a rank without samples can take its part in the gradient
        exchange without a forward (``idle``); else it runs a zero-weight
        batch, as every rank of a mode whose forwards communicate must."""
        return True

    def idle(self, wrapped, backward_begins):
        """This rank has no samples in the update: its part of the gradient
        exchange, its own gradient zero, calling ``backward_begins()`` where
        the others' backward would begin (their stats go then). Alone, or
        with no gradient collective, there is nothing else to take part in."""
        backward_begins()

    def local_grads(self, params):
        return [p.grad for p in params if p.grad is not None]

    def reduce(self, tensor):
        """Sum ``tensor`` over ranks when gradients are sharded (in place)."""
        return tensor

    # ---- state, always in the full format ----

    def model_state(self, model):
        return model.state_dict()

    def load_model_state(self, model, state):
        model.load_state_dict(state)

    def optimizer_state(self, model, optimizer):
        return optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state):
        optimizer.load_state_dict(state)

    def replicated_state(self, params, optimizer):
        """The tensors every rank holds a copy of, which must stay equal
        (agreement.py): parameters and optimizer state, unless sharded."""
        return [*params, *optimizer_tensors(optimizer)]

    def waited(self):
        """Seconds this process has spent, so far, waiting inside collectives
        that run in the middle of forward and backward (FSDP's); a rank's own
        compute time is its step time minus what this grew by."""
        return 0.0

    def counted_params(self, params):
        """The parameters whose bytes this rank holds (model_state_bytes)."""
        return params

    def gradient_bytes(self, params):
        """Bytes of the whole gradient one exchange sums: the same on every
        rank (plan/links.py sizes its probes by it). A DTensor shard counts
        its whole parameter (its numel is the global one)."""
        return sum(p.numel() * p.element_size() for p in params)

    def full_weights(self, model):
        """Context: {name: the whole weight} of ``model`` (the module built
        by the task, unwrapped), writes to them kept. Here every rank holds
        the parameters whole. Every rank must enter it alike: under the
        sharded modes it is a collective (docs/tasks.md)."""
        return whole_weights.whole_here(model)


SHARDING = Registry("ZeRO stage", base=Sharding)
# The same stages with state shares that follow memory (uneven.py registers them).
SHARDS_BY_MEMORY = Registry("ZeRO stage with memory shares", base=Sharding)


def _ddp(model, ctx, cfg, comm_hook, group=None):
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb, find_unused_parameters=cfg.find_unused_parameters,
        process_group=group)
    if comm_hook is not None:
        state, hook = comm_hook
        # A hook without state of its own sums over the group it is given.
        ddp.register_comm_hook(group if state is None else state, hook)
    return ddp


def _ddp_with_zeros(ddp, backward_begins):
    """DDP's collectives of one update, from a rank that computed nothing:
    what DDP's own join hook does for a rank whose data ran out (the forward's
    bucket rebuild and buffers, then every bucket's all-reduce, in DDP's
    order, through its comm hook), with zeros, keeping the sums: they are
    this rank's gradients, G/W as every rank's. DDP must have run one
    backward on this rank first (its buckets are rebuilt from it)."""
    ddp.reducer._rebuild_buckets()
    ddp._check_and_sync_module_buffers()
    backward_begins()
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    pending = [ddp.reducer._run_comm_hook(bucket) for bucket in buckets]
    for bucket, future in zip(buckets, pending):
        summed = future.wait()
        summed = summed[0] if isinstance(summed, list) else summed
        buffer = bucket.buffer()
        if summed.data_ptr() != buffer.data_ptr():
            buffer.copy_(summed)
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            param.grad = grad.view_as(param)
    if ddp.find_unused_parameters:
        ddp._match_unused_params_allreduce()


@SHARDING.register("0")
class Replicas(Sharding):
    sits_out = True

    def describe(self):
        return "--zero 0 (replicas, DDP)"

    def wrap(self, model):
        # Rank 0 alone in the exchange (the others sit out): nothing to sum.
        alone = self.group is not None and dist.get_world_size(self.group) == 1
        return _ddp(model, self.ctx, self.cfg, self.comm_hook, self.group) \
            if self.ctx.distributed and not alone else model

    def sync(self, wrapped, last):
        if last or not isinstance(wrapped, DistributedDataParallel):
            return contextlib.nullcontext()
        return wrapped.no_sync()   # must wrap the forward too (PLATFORM_NOTES)

    def idle(self, wrapped, backward_begins):
        if not isinstance(wrapped, DistributedDataParallel):
            return backward_begins()
        _ddp_with_zeros(wrapped, backward_begins)


@SHARDING.register("1")
class ShardedOptimizer(Replicas):
    """DDP for the gradients; each rank keeps and updates the optimizer state of
    its own parameters, then broadcasts them (ZeroRedundancyOptimizer)."""
    sits_out = False       # every rank's shard of the optimizer state is needed

    def describe(self):
        return "--zero 1 (optimizer state sharded, DDP + ZeroRedundancyOptimizer)"

    def build_optimizer(self, optimizer):
        if not self.ctx.distributed:
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer),
                                       lr=optimizer.defaults["lr"], **settings(optimizer))

    def replicated_state(self, params, optimizer):
        return list(params)      # each rank's optimizer state is its own part

    def optimizer_state(self, model, optimizer):
        """Collective: every rank sends its part to rank 0 (None on the others)."""
        if not self.ctx.distributed:
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.ctx.is_main else None


@SHARDING.register("2")
class FullyShard(Sharding):
    """FSDP2. Units: every module inside an ``nn.ModuleList`` (the transformer
    layers of most models), then the root, as torchtitan shards each block."""
    shards_grads = True
    lockstep = True
    reshard_after_forward = False

    def replicated_state(self, params, optimizer):
        return []                # every shard exists once: nothing to drift apart

    def describe(self):
        return "--zero 2 (optimizer state and gradients sharded, FSDP2)"

    def wrap(self, model):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        if not dist.is_initialized():   # one process offloading to the host: a group of one
            dist.init_process_group("nccl" if self.ctx.device.type == "cuda" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        mesh = DeviceMesh(self.ctx.device.type, list(range(self.ctx.world_size)))
        options = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                       shard_placement_fn=self._placement, **self.policies())
        for unit in flat_units.wrapped_members(model):
            fully_shard(unit, **options)
        fully_shard(model, **options)
        stats.time_fsdp_waits()
        # The sharded parameters (DTensors), by name: between a forward and
        # its backward the model's own attributes are FSDP2's gathered copies.
        self._sharded = list(model.named_parameters(remove_duplicate=False))
        self._open = 0            # full_weights contexts open now
        # First, before FSDP2's own hook gathers: a refused forward leaves no unit half-run.
        model.register_forward_pre_hook(self._refuse_inside, prepend=True)
        holds(self, model)
        return model

    def _refuse_inside(self, module, args):
        if self._open:
            # The forward would all-gather the shards, not what the task wrote
            # into the whole copies (those reach the shards on leaving).
            raise UserError(f"the model ran inside full_weights under --zero "
                            f"{self.registered_name}: the context is for reading or writing "
                            "the weights; leave it before calling the model")

    @contextlib.contextmanager
    def full_weights(self, model):
        """Each DTensor shard gathered whole where it lives, written back on
        leaving (whole_weights.gathered); the model refuses to run inside."""
        device = torch.device("cpu") if dist.get_backend() == "gloo" else self.ctx.device
        with whole_weights.gathered(self._sharded, device) as weights:
            self._open += 1
            try:
                yield weights
            finally:
                self._open -= 1

    def _placement(self, param):
        """Dim 0 (FSDP's default) unless it is shorter than the world: then a
        (1, 65536) weight would sit whole on one rank, so another dimension
        that splits evenly (FSDP shards only dim 0 unevenly)."""
        from torch.distributed.tensor import Shard
        world = self.ctx.world_size
        if param.dim() == 0 or param.shape[0] >= world:
            return Shard(0)
        even = [d for d in range(1, param.dim()) if param.shape[d] % world == 0]
        return Shard(max(even, key=lambda d: param.shape[d])) if even else Shard(0)

    def policies(self):
        from hetseq.update.precision import mixed_precision_policy
        policy = mixed_precision_policy(self.precision)
        return {"mp_policy": policy} if policy is not None else {}

    def sync(self, wrapped, last):
        wrapped.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def can_idle(self):
        # Every forward all-gathers and every backward reduce-scatters, unit
        # by unit: the rank runs a zero-weight batch to take part.
        return not self.ctx.distributed

    def local_grads(self, params):
        return [p.grad.to_local() for p in params if p.grad is not None]

    def waited(self):
        return stats.fsdp_waited()

    def reduce(self, tensor):
        if self.ctx.distributed:
            dist.all_reduce(tensor)
        return tensor

    # Collectives: every rank calls these; the full state is on rank 0's CPU.
    def model_state(self, model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return full_state.gather(get_model_state_dict, model)

    def load_model_state(self, model, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        full_state.check_shapes(model, state)
        set_model_state_dict(model, state, options=full_state.full_options())

    def optimizer_state(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        state = full_state.gather(get_optimizer_state_dict, model, optimizer)
        return full_state.by_index(model, state) if self.ctx.is_main else None

    def load_optimizer_state(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        if not state["state"]:
            # A stateless optimizer (SGD without momentum), or one saved before
            # its first step: only settings to load, and set_optimizer_state_dict
            # cannot place an empty state on the shards (it fails on the device).
            full_state.load_settings(optimizer, state)
            return
        set_optimizer_state_dict(model, optimizer, full_state.by_name(model, state),
                                 options=full_state.full_options())


@SHARDING.register("3")
class FullyShardParameters(FullyShard):
    reshard_after_forward = True

    def describe(self):
        where = ", on the host (CPU offload)" if self.cfg.cpu_offload else ""
        return f"--zero 3 (parameters, gradients and optimizer state sharded{where}, FSDP2)"

    def policies(self):
        policies = super().policies()
        if self.cfg.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy
            policies["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return policies


def build(cfg, precision, ctx, comm_hook=None, shares=None):
    """The mode for this run (``cfg``: ShardingConfig, ``precision``:
    PrecisionConfig, ``comm_hook``: DDP's, from the exchange mode;
    ``shares``: every rank's fraction of the sharded state when it follows
    memory, None for even shares). One process has nothing to shard:
    --zero N then trains as --zero 0, except --cpu-offload on a GPU (the
    state on the host)."""
    zero = cfg.zero
    if not ctx.distributed and zero and not (cfg.cpu_offload and ctx.device.type == "cuda"):
        logger.info("one process: nothing to shard, --zero %d trains as --zero 0", zero)
        zero = 0
    if shares is None or not zero or not ctx.distributed:
        return SHARDING.get(str(zero))(cfg, precision, ctx, comm_hook)
    mode = SHARDS_BY_MEMORY.get(str(zero))(cfg, precision, ctx, comm_hook)
    mode.shares = list(shares)
    return mode
