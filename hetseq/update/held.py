"""What a rank holds of the model state, counted from its tensors, and the
optimizer's own: its state tensors in a fixed order, its settings, the
same optimizer rebuilt over other parameters (a rank's shards)."""

import inspect

import torch


def _bytes(tensor):
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor   # a shard: its part
    return tensor.numel() * tensor.element_size()


def model_state_bytes(params, optimizer, slots):
    """Parameters + gradients + optimizer state that this rank holds, counted
    from its tensors. Before the first step the optimizer holds nothing yet:
    its state is then ``slots`` tensors the size of each parameter it updates
    (2 for Adam)."""
    held = sum(_bytes(p) for p in params)
    total = 2 * held     # gradients take the parameters' size and layout
    inner = getattr(optimizer, "optim", optimizer)     # ZeroRedundancyOptimizer's own part
    states = [state for state in inner.state.values() if state]
    if states:
        total += sum(_bytes(v) for state in states for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    else:
        total += slots * sum(_bytes(p) for group in inner.param_groups for p in group["params"])
    return total


def settings(optimizer):
    """The defaults ``optimizer``'s constructor takes but lr (some are
    derived, e.g. AdamW's decoupled_weight_decay), so any registered
    optimizer rebuilds."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "lr"}


def rebuilt_optimizer(optimizer, params):
    """An optimizer of ``optimizer``'s kind and settings over ``params``."""
    return type(optimizer)(params, lr=optimizer.defaults["lr"], **settings(optimizer))


def optimizer_tensors(optimizer):
    """The optimizer's state tensors, in parameter order (the same on every rank)."""
    return [value for group in optimizer.param_groups for p in group["params"]
            for _, value in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(value)]
