"""--zero 1, 2 and 3 with state shares that follow memory (--state-shares
memory): rank r holds the fraction ``shares[r]`` of each unit's sharded
state, where torch's engines split evenly, so a small card beside a big one
holds a small share. Each unit is laid flat (flat_units.py) and the optimizer
updates this rank's range of it; the gradient math and the checkpoint format
are the other modes' (docs/memory-and-precision.md, 'State shares by memory').
"""

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from hetseq.base.errors import UserError
from hetseq.update.zero import flat_state, flat_units, sharding
from hetseq.update.zero.flat_units import FlatUnit
from hetseq.update.zero.held import rebuilt_optimizer
from hetseq.update.zero.sharding import SHARDS_BY_MEMORY, Replicas, Sharding

logger = logging.getLogger(__name__)


class UnevenOptimizer:
    """The optimizer the Controller steps: the job's own kind, rebuilt over
    this rank's pieces (flat_units.py), and, under --zero 1, the ranges
    shared after the step. ``optim`` is the inner one (as
    ZeroRedundancyOptimizer's). ``ctx``: the run's DistContext."""

    def __init__(self, optimizer, flats, kept, ctx):
        self.flats, self.kept, self.ctx = flats, kept, ctx
        self.optim = rebuilt_optimizer(optimizer, self._pieces())

    def _pieces(self):
        pieces = [piece for flat in self.flats for _, _, piece in flat.pieces]
        # A rank whose ranges are all empty steps nothing (torch refuses an
        # optimizer of no parameters).
        return pieces or [nn.Parameter(torch.zeros(0))]

    def rebuild(self):
        """Over the flats' pieces as they are now, before any state exists
        (the rate the schedule set is kept)."""
        if any(self.optim.state.values()):
            raise RuntimeError("the state shares change only before the first update")
        rates = [group["lr"] for group in self.optim.param_groups]
        self.optim = rebuilt_optimizer(self.optim, self._pieces())
        for group, rate in zip(self.optim.param_groups, rates):
            group["lr"] = rate

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)
        for flat in self.flats:
            flat.clear()

    def step(self, closure=None):
        if self.kept:
            for flat in self.flats:
                flat.gather_grads()
        for flat, used in zip(self.flats, self._used_anywhere()):
            flat.hand_over(used)
        self.optim.step()
        if self.kept:
            with torch.no_grad():
                for flat in self.flats:
                    flat.share_update()

    def _used_anywhere(self):
        """Per flat, which of its parameters got a gradient on some rank in
        this update (one small all-reduce): the others are not stepped."""
        used = torch.cat([flat.used for flat in self.flats]).to(self.ctx.device)
        dist.all_reduce(used)
        return used.cpu().split([len(flat.params) for flat in self.flats])

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state):
        self.optim.load_state_dict(state)


class UnevenBase:
    """What the three uneven modes share: the flats, their shares, the full
    format of a checkpoint (flat_state.py). Mixed into a Sharding subclass;
    ``shares`` set by build()."""

    def make_flats(self, model, device, home, kept):
        self._index = {id(p): i for i, p in enumerate(
            p for p in model.parameters() if p.requires_grad)}
        self.flats = []
        for unit, params in flat_units.units(model):
            for dtype in dict.fromkeys(p.dtype for p in params):
                group = [p for p in params if p.dtype == dtype]
                cuts = flat_units.bounds(sum(p.numel() for p in group), self.shares)
                self.flats.append((unit, FlatUnit(group, cuts, self.ctx.rank, device, home, kept)))
        return [flat for _, flat in self.flats]

    def _flats(self):
        return [flat for _, flat in self.flats]

    def gradient_bytes(self, params):
        # The units' whole sizes: a freed unit's parameters are views of this
        # rank's shard, and every rank must count the same bytes.
        return sum(flat.numel * flat.full.element_size() for flat in self._flats())

    def reshare(self, shares, optimizer):
        """Every rank's fraction of each unit from now on (a collective),
        before the first update: the optimizer is rebuilt over the new ranges."""
        self.shares = list(shares)
        for flat in self._flats():
            flat.recut(flat_units.bounds(flat.numel, self.shares), self.ctx.rank)
        optimizer.rebuild()

    def describe_shares(self):
        return ", ".join(f"{share:.0%}" for share in self.shares)

    def build_optimizer(self, optimizer):
        return UnevenOptimizer(optimizer, self._flats(), self.kept, self.ctx)

    def model_state(self, model):
        return flat_state.model_state(self._flats(), model, self.ctx)

    def load_model_state(self, model, state):
        flat_state.load_model_state(self._flats(), model, state)

    def optimizer_state(self, model, optimizer):
        return flat_state.optimizer_state(self._flats(), optimizer.optim, self._index, self.ctx)

    def load_optimizer_state(self, model, optimizer, state):
        flat_state.load_optimizer_state(self._flats(), optimizer.optim, state, self._index)


@SHARDS_BY_MEMORY.register("1")
class UnevenOptimizerState(UnevenBase, Replicas):
    """--zero 1 by memory: DDP sums whole gradients; the optimizer steps
    this rank's ranges and the owners broadcast them."""
    sits_out = False
    kept = True

    def describe(self):
        return f"--zero 1 (optimizer state sharded by memory: {self.describe_shares()})"

    def wrap(self, model):
        if not getattr(self, "flats", None):
            self.make_flats(model, self.ctx.device, self.ctx.device, kept=True)
        return super().wrap(model)

    def replicated_state(self, params, optimizer):
        return list(params)


@SHARDS_BY_MEMORY.register("2")
class UnevenShards(UnevenBase, Sharding):
    """--zero 2 by memory: units gathered from their first forward to the
    end of their backward; gradients reduced to their owners."""
    shards_grads = True
    lockstep = True
    kept = False
    reshard_after_forward = False

    def describe(self):
        return f"--zero {self.registered_name} (state sharded by memory: {self.describe_shares()})"

    def wrap(self, model):
        if getattr(self, "flats", None):
            return model
        home = torch.device("cpu") if self.cfg.cpu_offload else self.ctx.device
        for name, buffer in list(model.named_buffers()):
            module_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(module_name) if module_name else model
            owner._buffers[attr] = buffer.to(self.ctx.device)
        self.make_flats(model, self.ctx.device, home, kept=False)
        names = {id(param): name for name, param in model.named_parameters()}
        self._root = model
        self._waited, self._queued = 0.0, False
        self._open = 0            # full_weights contexts open now
        sharding.holds(self, model)
        from hetseq.update.precision import DTYPES
        # float32 (the default) means: summed in the parameters' own dtype.
        low = self.precision.reduce_dtype != "float32"
        self._reduce_dtype = DTYPES[self.precision.reduce_dtype] if low else None
        for unit, flat in self.flats:
            flat.pending = 0
            unit.register_forward_pre_hook(self._before_forward(flat))
            unit.register_forward_hook(self._after_forward(flat))
            for param, shape in zip(flat.params, flat.shapes):
                param.register_hook(self._arriving(names.get(id(param), "?"), shape))
                param.register_post_accumulate_grad_hook(self._after_grad(flat))
        return model

    def _arriving(self, name, shape):
        """A gradient of another shape than the weight's came from a graph
        built on the freed parameter (this rank's flat part: flat_units.
        _repoint gives it an accumulator of its own): refused, on every rank
        that holds less than the whole weight."""
        def hook(grad):
            if grad.shape != shape:
                raise UserError(
                    f"a gradient reached parameter {name} from a term of loss computed "
                    f"outside the forward under --zero {self.registered_name} --state-shares "
                    f"memory, where the parameter is this rank's part of it (shape "
                    f"{tuple(grad.shape)}, the weight's {tuple(shape)}): compute a "
                    "regulariser inside the forward of the module holding the weight, or "
                    "read its value without gradient in self.full_weights(model) "
                    "(docs/tasks.md, 'Reading the weights in `loss`')")
        return hook

    def _timed(self, work):
        started = time.perf_counter()
        work()
        self._waited += time.perf_counter() - started

    @contextlib.contextmanager
    def full_weights(self, model):
        """Every unit's whole weights copied into tensors of their own (a
        collective for a freed unit, in the units' order: the same on every
        rank); on leaving, each rank's range of what the task left written
        there into its shard (and into ``full`` where a forward keeps the
        unit gathered for its backward). The units stay as they were."""
        flats = self._flats()
        wholes = []
        for flat in flats:
            self._timed(lambda flat=flat: wholes.append(flat.copy_whole()))
        views = {id(param): whole[offset:offset + n].view(shape)
                 for flat, whole in zip(flats, wholes)
                 for param, offset, n, shape in zip(flat.params, flat.offsets, flat.numels,
                                                    flat.shapes)}
        self._open += 1
        try:
            # Copies, not views of the units' ``full``: a tensor the task keeps
            # (a snapshot, an EMA's source) never points at freed storage.
            yield sharding.named_weights(
                model, lambda param: views.get(id(param), param.detach()))
        finally:
            self._open -= 1
            for flat, whole in zip(flats, wholes):
                flat.write_whole(whole)

    def _before_forward(self, flat):
        def hook(module, args):
            if self._open:
                # Leaving would free a unit that this forward's backward reads.
                raise UserError(f"the model ran inside full_weights under --zero "
                                f"{self.registered_name}: the context is for reading or "
                                "writing the weights; leave it before calling the model")
            self._timed(flat.gather)
            flat.pending = len(flat.params) if torch.is_grad_enabled() else 0
        return hook

    def _after_forward(self, flat):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                flat.free()
                return
            if self.reshard_after_forward and module is not self._root:
                flat.free()
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._before_backward(flat))
        return hook

    def _before_backward(self, flat):
        def hook(grad):
            self._queue_end()
            self._timed(flat.gather)
        return hook

    def _after_grad(self, flat):
        def hook(param):
            self._queue_end()
            flat.pending -= 1
            if flat.pending == 0:
                self._timed(lambda: self._finish(flat))
        return hook

    def _queue_end(self):
        """The end of this backward, once: the units whose parameters did not
        all get a gradient finish there, in a fixed order (every rank alike)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self):
        self._queued = False
        for _, flat in self.flats:
            if flat.pending > 0:
                flat.pending = 0
                self._timed(lambda flat=flat: self._finish(flat))

    def _finish(self, flat):
        """A unit's backward is done: its gradient reduced to the owners (on
        every micro-batch: a whole gradient kept for the next would be
        memory no share counts; FSDP2 keeps it, and reduces once), the unit
        freed."""
        flat.reduce_grads(self.ctx.world_size, self._reduce_dtype)
        flat.free()

    def can_idle(self):
        return not self.ctx.distributed

    def local_grads(self, params):
        return [flat.grad for _, flat in self.flats if flat.grad is not None]

    def counted_params(self, params):
        return [flat.shard for _, flat in self.flats]     # this rank's ranges

    def reduce(self, tensor):
        if self.ctx.distributed:
            dist.all_reduce(tensor)
        return tensor

    def replicated_state(self, params, optimizer):
        return []

    def waited(self):
        return self._waited


@SHARDS_BY_MEMORY.register("3")
class UnevenShardParameters(UnevenShards):
    """--zero 3 by memory: as --zero 2, each unit but the root freed after
    its forward and gathered again when its backward begins."""
    reshard_after_forward = True


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
