"""What a rank holds of the model state, counted from its tensors, and the
optimizer's own: its state tensors in a fixed order, its settings, the
same optimizer rebuilt over other parameters (a rank's shards), and what a
checkpoint must hold of the model and optimizer (their kinds, state.py)."""

import inspect

import torch
from torch import nn

from hetseq.checkpoints.state import (ANYTHING, Count, Either, Fields, Kind, ListOf, ModelState,
                                      Number, OfType, StateMismatch, Tensor, describe, like)


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


class SavedAs:
    """What a checkpoint holds of a model, in its one format: ``model``, the
    kind of its state_dict; ``params``, (shape, dtype) of each trainable
    parameter in order (the optimizer state's positions)."""

    def __init__(self, model):
        self.model = ModelState({name: (tuple(value.shape), value.dtype)
                                 if torch.is_tensor(value) else None
                                 for name, value in model.state_dict().items()})
        self.params = [(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad]


def saved_as(model):
    """``model``'s SavedAs, taken before a --zero mode wraps it (shards and
    flat units change what its parameters look like, not the format)."""
    return SavedAs(model)


def _slots(optimizer, dtype, device):
    """{key: whether it is a tensor of the parameter's shape} of the state
    an optimizer of ``optimizer``'s kind and settings keeps per parameter:
    learnt from one step of a copy over one element with a zero gradient
    (a user's optimizer declares nothing of its state)."""
    param = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
    probe = rebuilt_optimizer(optimizer, [param])
    param.grad = torch.zeros_like(param)
    probe.step()
    return {key: torch.is_tensor(value) and value.dim() > 0
            for key, value in probe.state.get(param, {}).items()}


def _setting(value):
    """The kind of a saved group setting, from this run's: the loaded
    state's settings replace its own (torch's load_state_dict), so a string
    where a rate is read would fail mid-step. Kernel choices (None, or a
    bool) may differ between ranks' devices (keep_own_kernels)."""
    if value is None or isinstance(value, bool):
        return OfType(bool, type(None))
    if torch.is_tensor(value) and value.dim() == 0:     # a capturable rate
        return Either(Number(low=0 if value.item() >= 0 else None), Tensor(dims=0))
    return like(value)


class OptimizerState(Kind):
    """The full format of a plain optimizer's state over this run's
    trainable parameters (``params``: (shape, dtype) each, in order):
    "state" keyed by position, each entry with every slot this kind of
    optimizer keeps (``slots``: {key: a tensor of the parameter's shape, or a
    count}); "param_groups" as many as this run's, holding every position
    once, with settings of this run's types (``groups``: each group's
    settings and its number of parameters)."""

    expected = "an optimizer state"

    def __init__(self, params, slots, groups, same=None):
        self.params, self.slots, self.groups = params, slots, groups
        self.same = same

    def check(self, value, path):
        Fields({"state": OfType(dict), "param_groups": ListOf(OfType(dict))},
               extra=ANYTHING).check(value, path)
        if self.same is not None:
            # A state of another kind of optimizer: named as such (its settings), before
            # its slots (Adam's exp_avg where Adadelta keeps square_avg) say less.
            self.same(value)
        position = Count(0, len(self.params) - 1)
        for key, entry in value["state"].items():
            position.check(key, f"{path}.state.<key {key!r}>"[:80])
            where = f"{path}.state.{key}"
            shape, dtype = self.params[key]
            slots = {name: Tensor(shape=shape, dtype=dtype) if whole else _count()
                     for name, whole in self.slots.items()}
            # Slots of another kind of optimizer are left to check_same_optimizer's
            # message (it names the settings), unknown ones to torch (it ignores them).
            Fields(slots, extra=Either(OfType(type(None)), _count(), Tensor(shape=shape))) \
                .check(entry, where)
        groups = value["param_groups"]
        if len(groups) != len(self.groups):
            raise StateMismatch(f"{path}.param_groups", describe(groups),
                                f"a list of {len(self.groups)} (this optimizer's groups)")
        first = 0
        for i, (group, (settings, count)) in enumerate(zip(groups, self.groups)):
            where = f"{path}.param_groups.{i}"
            kinds = {name: _setting(setting) for name, setting in settings.items()}
            # A missing setting is check_same_optimizer's to name (another optimizer).
            Fields({"params": ListOf(position, length=count)}, kinds, extra=ANYTHING) \
                .check(group, where)
            # torch gives the saved positions to this run's parameters by their
            # order in the groups, and "state" above was checked by position:
            # any other order would load a state onto a parameter of another shape.
            for j, index in enumerate(group["params"]):
                if index != first + j:
                    raise StateMismatch(f"{where}.params.{j}", f"position {index}",
                                        f"position {first + j} (this run's parameters in "
                                        "order, each once)")
            first += count


def _count():
    """A step count: a number or a one-element tensor, finite, not negative."""
    return Either(Number(low=0), Tensor(dims=0, like=torch.float32, low=0))


def optimizer_kind(optimizer, params, same=None):
    """The OptimizerState a checkpoint must hold for ``optimizer`` (the plain
    one the Controller built: its kind and settings) over parameters of
    ``params`` ((shape, dtype) each, SavedAs.params); ``same(state)``
    raises a UserError for a state of another kind of optimizer."""
    first = optimizer.param_groups[0]["params"][0]
    local = first.to_local() if hasattr(first, "to_local") else first
    # ZeroRedundancyOptimizer's own optimizer is of the job's kind (its
    # groups, the wrapper's, hold every parameter).
    slots = _slots(getattr(optimizer, "optim", optimizer), local.dtype, local.device)
    groups = [({k: v for k, v in group.items() if k != "params"}, len(group["params"]))
              for group in optimizer.param_groups]
    return OptimizerState(params, slots, groups, same)
