"""--zero 1, 2 and 3 with state shares that follow memory (--state-shares
memory): rank r holds the fraction ``shares[r]`` of each unit's sharded
state, where torch's engines (ZeroRedundancyOptimizer, FSDP2) split evenly.
A small card beside a big one then holds a small share, and the job trains
a model whose even share would not fit the small card.

Each unit's parameters are laid flat (flat_units.py); rank r owns the range
[cuts[r], cuts[r+1]) of each flat vector: the optimizer updates that range
(its ``shard``, an ordinary parameter), so the optimizer state is that size.

    --zero 1   parameters whole on every rank (DDP sums the gradients);
               after the step each owner broadcasts its range
    --zero 2   at rest a rank holds only its ranges of the parameters, the
               gradients and the optimizer state; a unit is gathered at its
               first forward and freed after its backward
    --zero 3   as 2, and each unit freed after its forward, gathered again
               for its backward

The gradient math is the other modes': a rank's gradient shard is the SUM
over ranks of that range divided by W (the reduce below), which the
Controller multiplies by W/N. Only element-wise optimizers (SGD, Adam(W),
Adadelta: every element's update depends on its own gradient and state)
give the same update on a range as on the whole tensor, and all of
HetSeq's do. Checkpoints hold the full state in the one format of the
other modes: a run resumes under even shares, another world size and back.
"""

import logging
import time

import torch
import torch.distributed as dist

from hetseq.update import flat_units
from hetseq.update.flat_units import FlatUnit, owned
from hetseq.update.held import rebuilt_optimizer
from hetseq.update.sharding import SHARDS_BY_MEMORY, Replicas, Sharding

logger = logging.getLogger(__name__)


class UnevenOptimizer:
    """The optimizer the Controller steps: the job's own kind (rebuilt over
    this rank's shards) and, under --zero 1, the ranges shared after the
    step. ``optim`` is the inner one (as ZeroRedundancyOptimizer's)."""

    def __init__(self, optimizer, flats, kept):
        self.optim = rebuilt_optimizer(optimizer, [flat.shard for flat in flats])
        self.flats, self.kept = flats, kept

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def rebuild(self):
        """Over the flats' shards as they are now, before any state exists
        (the rate the schedule set is kept)."""
        if any(self.optim.state.values()):
            raise RuntimeError("the state shares change only before the first update")
        rates = [group["lr"] for group in self.optim.param_groups]
        self.optim = rebuilt_optimizer(self.optim, [flat.shard for flat in self.flats])
        for group, rate in zip(self.optim.param_groups, rates):
            group["lr"] = rate

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)
        for flat in self.flats:
            for p in flat.params:
                p.grad = None

    def step(self, closure=None):
        if self.kept:
            for flat in self.flats:
                flat.gather_grads()
        self.optim.step()
        if self.kept:
            with torch.no_grad():
                for flat in self.flats:
                    flat.share_update()
                    flat.shard.grad = None

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state):
        self.optim.load_state_dict(state)


class UnevenBase:
    """What the three uneven modes share: the flats, their shares, the full
    format of a checkpoint. Mixed into a Sharding subclass."""
    shares = None          # every rank's fraction, set by build()

    def make_flats(self, model, device, home, kept):
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._index = {id(p): i for i, p in enumerate(
            p for p in model.parameters() if p.requires_grad)}
        self.flats = []
        for unit, params in flat_units.units(model):
            for dtype in dict.fromkeys(p.dtype for p in params):
                group = [p for p in params if p.dtype == dtype]
                cuts = flat_units.bounds(sum(p.numel() for p in group), self.shares)
                self.flats.append((unit, FlatUnit(group, cuts, self.ctx.rank, device, home, kept)))
        return [flat for _, flat in self.flats]

    def reshare(self, shares, optimizer):
        """Every rank's fraction of each unit from now on (a collective),
        before the first update: the optimizer is rebuilt over the new ranges."""
        self.shares = list(shares)
        for _, flat in self.flats:
            flat.recut(flat_units.bounds(flat.numel, self.shares), self.ctx.rank)
        optimizer.rebuild()

    def describe_shares(self):
        return ", ".join(f"{share:.0%}" for share in self.shares)

    def build_optimizer(self, optimizer):
        return UnevenOptimizer(optimizer, [flat for _, flat in self.flats], self.kept)

    def model_state(self, model):
        """Collective: the full state on rank 0 (an empty dict on the others)."""
        whole = {}
        for _, flat in self.flats:
            was = flat.gathered
            flat.gather()
            if self.ctx.is_main:
                for param, value in zip(flat.params, flat.split(flat.full)):
                    whole[id(param)] = value
            if not was:
                flat.free()
        if not self.ctx.is_main:
            return {}
        return {name: whole[id(value)] if id(value) in whole else value.detach().cpu()
                for name, value in model.state_dict(keep_vars=True).items()}

    def load_model_state(self, model, state):
        names = dict(model.named_parameters(remove_duplicate=False))
        for name, param in names.items():
            if name not in state:
                raise RuntimeError(f"the checkpoint has no parameter {name}")
            if tuple(state[name].shape) != tuple(param.shape):
                raise RuntimeError(f"parameter {name} has shape {tuple(param.shape)} but the "
                                   f"checkpoint holds {tuple(state[name].shape)}")
        with torch.no_grad():
            for _, flat in self.flats:
                saved = [state[self._names[id(p)]].to(flat.shard) for p in flat.params]
                if flat.gathered:
                    flat.full.data.copy_(owned(saved, 0, flat.numel))
                else:
                    flat.shard.data.copy_(owned(saved, flat.lo, flat.hi))
        rest = {k: v for k, v in state.items() if k not in names}
        model.load_state_dict(rest, strict=False)

    def optimizer_state(self, model, optimizer):
        """Collective: a plain optimizer's state over the model's trainable
        parameters (keyed by position), on rank 0; None on the others."""
        inner = optimizer.optim
        state = {}
        for _, flat in self.flats:
            mine = inner.state.get(flat.shard, {})
            for key in sorted(mine):
                value = mine[key]
                if torch.is_tensor(value) and value.dim() > 0:
                    parts = flat.split(flat.whole(value.to(flat.full.device)))
                else:   # one tensor per parameter: a shared step would count each update N times
                    parts = [value.clone() if torch.is_tensor(value) else value
                             for _ in flat.params]
                if self.ctx.is_main:
                    for param, part in zip(flat.params, parts):
                        state.setdefault(self._index[id(param)], {})[key] = part
        if not self.ctx.is_main:
            return None
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": list(range(len(self._index)))} for group in inner.param_groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, model, optimizer, state):
        inner = optimizer.optim
        saved = state["param_groups"]
        for group, settings in zip(inner.param_groups, saved):
            group.update({k: v for k, v in settings.items() if k != "params"})
        for _, flat in self.flats:
            per_param = [state["state"].get(self._index[id(p)], {}) for p in flat.params]
            keys = set(per_param[0]) if per_param else set()
            if not keys:
                inner.state.pop(flat.shard, None)
                continue
            mine = {}
            for key in keys:
                values = [entry[key] for entry in per_param]
                if torch.is_tensor(values[0]) and values[0].dim() > 0:
                    mine[key] = owned([v.to(flat.shard) for v in values], flat.lo, flat.hi)
                else:
                    mine[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
            inner.state[flat.shard] = mine


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
        self._root = model
        self.syncing, self._waited, self._queued = True, 0.0, False
        from hetseq.update.precision import DTYPES
        # float32 (the default) means: summed in the parameters' own dtype.
        low = self.precision.reduce_dtype != "float32"
        self._reduce_dtype = DTYPES[self.precision.reduce_dtype] if low else None
        for unit, flat in self.flats:
            flat.pending = 0
            unit.register_forward_pre_hook(self._before_forward(flat))
            unit.register_forward_hook(self._after_forward(flat))
            for param in flat.params:
                param.register_post_accumulate_grad_hook(self._after_grad(flat))
        return model

    def _timed(self, work):
        started = time.perf_counter()
        work()
        self._waited += time.perf_counter() - started

    def _before_forward(self, flat):
        def hook(module, args):
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
        """A unit's backward is done: its gradient reduced to the owners on
        an update's last micro-batch (else kept whole to accumulate), the
        unit freed."""
        if self.syncing:
            flat.reduce_grads(self.ctx.world_size, self._reduce_dtype)
        flat.free()

    def sync(self, wrapped, last):
        self.syncing = last
        return super().sync(wrapped, last)

    def can_idle(self):
        return not self.ctx.distributed

    def local_grads(self, params):
        return [flat.shard.grad for _, flat in self.flats if flat.shard.grad is not None]

    def counted_params(self, params):
        return [flat.shard for _, flat in self.flats]     # the parameters' own ranges

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
