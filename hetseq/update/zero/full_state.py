"""Sharded model and optimizer states in the one full format of a checkpoint
(sharding.py's FSDP modes): gathered whole on rank 0's host, keyed by
parameter position as a plain optimizer keeps them, and back."""

import torch
import torch.distributed as dist


def gather(get, *objects):
    """``get``'s state (get_model_state_dict, get_optimizer_state_dict) whole,
    on rank 0's host; other ranks get an empty dict. A collective.

    Over nccl torch gathers it. Over gloo the shards are gathered here, as
    host tensors: torch's gather is a functional all-gather on each rank's
    own device, which crashed (SIGSEGV, torch 2.11, an H200) in a job of a
    GPU rank and a CPU rank; gloo moves host tensors natively anyway."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    if dist.get_backend() != "gloo":
        return get(*objects, options=full_options(cpu_offload=True))
    state = _walk(get(*objects, options=StateDictOptions()), _whole_on_host)
    return state if dist.get_rank() == 0 else {}


def _walk(state, convert):
    """``state`` (nested dicts and lists) with ``convert`` applied to each leaf,
    in the same order on every rank (the same model and optimizer)."""
    if isinstance(state, dict):
        return {key: _walk(value, convert) for key, value in state.items()}
    if isinstance(state, list):
        return [_walk(value, convert) for value in state]
    return convert(state)


def _whole_on_host(value):
    """A leaf of a sharded state as a whole host tensor. A DTensor sharded on
    dim d of a 1-D mesh is split as torch.chunk splits (rank r holds rows
    from r * ceil(n / W), the last ones fewer or none): each rank pads its
    shard to ceil(n / W), all ranks gather them, and the padding is cut."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(value, DTensor):
        return value.detach().cpu() if torch.is_tensor(value) else value
    local = value.to_local().detach().cpu()
    (placement,) = value.placements
    if not isinstance(placement, Shard):
        return local                               # replicated: every rank has it whole
    dim, size = placement.dim, value.shape[placement.dim]
    group = value.device_mesh.get_group()
    world = dist.get_world_size(group)
    shape = list(local.shape)
    shape[dim] = -(-size // world)
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts, dim).narrow(dim, 0, size).contiguous()


def full_options(**options):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **options)


def _names(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def by_index(model, state):
    """An optimizer state keyed by parameter name -> keyed by position, as a plain
    optimizer over the model's trainable parameters keeps it."""
    index = {name: i for i, name in enumerate(_names(model))}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(model, state):
    names = _names(model)
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def load_settings(optimizer, state):
    """The per-group settings (lr, momentum, ...) of a state without tensors."""
    saved = state["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this "
                         f"one {len(optimizer.param_groups)}")
    for group, settings in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in settings.items() if k != "params"})


def check_shapes(model, state):
    """A clear error before FSDP's own (which names no parameter)."""
    from torch.distributed.tensor import DTensor
    for name, param in model.named_parameters():
        shape = tuple(param.shape if not isinstance(param, DTensor) else param.size())
        saved = state.get(name)
        if saved is not None and tuple(saved.shape) != shape:
            raise RuntimeError(f"parameter {name} has shape {shape} but the checkpoint holds "
                               f"{tuple(saved.shape)}")
