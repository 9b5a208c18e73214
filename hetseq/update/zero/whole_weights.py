"""The whole weights a task asks for (``Task.full_weights``, docs/tasks.md)
under every --zero mode and state shares: the mode that shards a model is
found from any module inside it, and FSDP2's DTensor shards are gathered
whole, then each rank's chunk written back (sharding.py, uneven.py)."""

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetseq.base.errors import UserError


@contextlib.contextmanager
def whole_here(model):
    """The parameters as they are, detached (a write is a write to the
    parameter): a model whose every rank holds them whole."""
    yield named_weights(model, lambda param: param.detach())


def named_weights(model, whole):
    """{name: whole(parameter)} over every parameter, a tied one under each
    of its names (each computed once)."""
    done = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in done:
            done[id(param)] = whole(param)
    return {name: done[id(param)] for name, param in model.named_parameters(remove_duplicate=False)}


# Each module of a sharded model -> (weak references to the mode that shards
# it and to the model, its name's prefix there), for full_weights: weak, so
# that neither keeps a finished Controller's model or mode alive.
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def holds(mode, model):
    """``mode`` shards ``model`` from now on (its ``wrap``): full_weights of
    the model, or of any module inside it, asks it for the whole weights."""
    for name, module in model.named_modules():
        _HOLDERS[module] = (weakref.ref(mode), weakref.ref(model), f"{name}." if name else "")


def full_weights(model):
    """Context: {name: whole weight} of the model a task was handed (DDP's
    wrapper or the model itself) or of a module inside it, in any --zero
    mode and state shares: Task.full_weights (docs/tasks.md). Names are the
    module's own (``named_parameters``)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if not isinstance(model, nn.Module):
        raise UserError(f"full_weights takes the model a task's loss is handed (an "
                        f"nn.Module), or a module of it, not {type(model).__name__}")
    held = _HOLDERS.get(model)
    mode, root = (held[0](), held[1]()) if held is not None else (None, None)
    if mode is None or root is None:
        return whole_here(model)
    return _within(mode.full_weights(root), held[2])


@contextlib.contextmanager
def _within(whole, prefix):
    """The weights of the module at ``prefix`` of the model's, named as its own:
    a module's weights still gather their whole model (every rank alike)."""
    with whole as weights:
        yield {name[len(prefix):]: weight for name, weight in weights.items()
               if name.startswith(prefix)}


@contextlib.contextmanager
def gathered(sharded, device):
    """{name: whole weight} of ``sharded`` (an FSDP2 model's named
    parameters): each DTensor shard gathered whole on ``device`` (a
    collective, in the model's order: the same on every rank), in the
    parameters' own dtype (not the 16-bit copies forward runs on); on
    leaving, each rank's chunk of it written back into its shard, which the
    next forward's all-gather reads."""
    from torch.distributed.tensor import DTensor
    unique = list({id(param): param for _, param in sharded}.values())
    with torch.no_grad():
        whole = {id(p): _whole_of(p, device) if isinstance(p, DTensor) else p.detach()
                 for p in unique}
    try:
        yield {name: whole[id(param)] for name, param in sharded}
    finally:
        with torch.no_grad():
            for param in unique:
                if isinstance(param, DTensor):
                    _write_chunk(param, whole[id(param)])


def _shard_of(param):
    """(the DTensor's dim, its chunk's length, this rank's first row): a
    DTensor sharded on dim d of a 1-D mesh is split as torch.chunk splits,
    rank r holding rows from r * ceil(n / W), the last ones fewer or none.
    None for a replicated one."""
    from torch.distributed.tensor import Shard
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return None
    group = param.device_mesh.get_group()
    chunk = -(-param.shape[placement.dim] // dist.get_world_size(group))
    return placement.dim, chunk, dist.get_rank(group) * chunk


def _whole_of(param, device):
    """A DTensor parameter whole, on its shard's device: each rank pads its
    shard to the chunk's length, all gather them on ``device`` (the host
    over gloo, as full_state.py gathers), the padding is cut."""
    local = param.to_local()
    shard = _shard_of(param)
    if shard is None:
        return local.clone()               # replicated: every rank has it whole
    dim, chunk, _ = shard
    shape = list(local.shape)
    shape[dim] = chunk
    padded = local.new_zeros(shape, device=device)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(
        param.device_mesh.get_group()))]
    dist.all_gather(parts, padded, group=param.device_mesh.get_group())
    return torch.cat(parts, dim).narrow(dim, 0, param.shape[dim]).to(local.device)


def _write_chunk(param, whole):
    """This rank's chunk of ``whole`` into the DTensor's own shard (in place:
    the optimizer's parameter and FSDP2's all-gather read it)."""
    local = param.to_local()
    shard = _shard_of(param)
    if shard is None:
        local.copy_(whole)
    elif local.numel():
        dim, _, first = shard
        local.copy_(whole.narrow(dim, first, local.shape[dim]))
