"""The state of uneven.py's flat units in the one full format of every
checkpoint: the model's ``state_dict`` and a plain optimizer's state keyed
by position over the model's trainable parameters, gathered whole on rank
0 (collectives) and cut back into each rank's pieces. A parameter with no
optimizer state (never given a gradient) has none in either direction."""

import torch

from hetseq.distributed import all_gather_object


def model_state(flats, model, ctx):
    """Collective: the model's full state on rank 0 (an empty dict elsewhere)."""
    whole = {}
    for flat in flats:
        was = flat.gathered
        flat.gather()
        if ctx.is_main:
            for param, value in zip(flat.params, flat.split(flat.full)):
                whole[id(param)] = value
        if not was:
            flat.free()
    if not ctx.is_main:
        return {}
    return {name: whole[id(value)] if id(value) in whole else value.detach().cpu()
            for name, value in model.state_dict(keep_vars=True).items()}


def load_model_state(flats, model, state):
    """``state`` (whole, on every rank) into this rank's ranges, as strict
    as torch's ``load_state_dict``: its messages, so that a checkpoint of
    another model is named alike whatever the mode (checkpoint._misfit)."""
    # A freed unit's parameters are views of this rank's shard: their shapes are the unit's.
    shapes = {id(p): shape for flat in flats for p, shape in zip(flat.params, flat.shapes)}
    expected = {k: shapes.get(id(v), v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    sizes = [f"size mismatch for {k}: copying a param with shape {state[k].shape} from "
             f"checkpoint, the shape in current model is {expected[k]}."
             for k in expected if k in state and state[k].shape != expected[k]]
    if missing or unexpected or sizes:
        lines = ([f"Missing key(s) in state_dict: {_quoted(missing)}."] if missing else []) + \
            ([f"Unexpected key(s) in state_dict: {_quoted(unexpected)}."] if unexpected else []) \
            + sizes
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                           + "\n\t".join(lines))
    names = {id(p): name for name, p in model.named_parameters()}
    with torch.no_grad():
        for flat in flats:
            saved = [state[names[id(p)]].reshape(-1).to(flat.full) for p in flat.params]
            if flat.gathered:
                flat.full.data.copy_(torch.cat(saved))
            else:
                flat.shard.copy_(torch.cat(saved)[flat.lo:flat.hi])
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model.load_state_dict({k: v for k, v in state.items() if k not in params}, strict=False)


def _quoted(keys):
    return ", ".join(f'"{key}"' for key in keys)


def optimizer_state(flats, inner, index, ctx):
    """Collective: a plain optimizer's state over the model's trainable
    parameters (``index``: id -> position), on rank 0; None elsewhere.
    Each key of a parameter's state is gathered as one flat vector per
    unit, a scalar (a step count) written over its elements."""
    kinds = _kinds(flats, inner, ctx)
    state = {}
    for f, flat in enumerate(flats):
        if not kinds[f]:
            continue
        has = _whole_of(flat, inner, lambda piece, _: 1.0, torch.float32)
        values = {key: _whole_of(flat, inner, _take(key, kind), _dtype(kind))
                  for key, kind in sorted(kinds[f].items())}
        if not ctx.is_main:
            continue
        # The unit's shapes: a freed unit's parameters are views of this rank's shard.
        for param, offset, n, shape in zip(flat.params, flat.offsets, flat.numels, flat.shapes):
            if n == 0 or not has[offset:offset + n].all():
                continue
            entry = state.setdefault(index[id(param)], {})
            for key, kind in kinds[f].items():
                part = values[key][offset:offset + n]
                entry[key] = _part(part, shape, kind)
    if not ctx.is_main:
        return None
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": list(range(len(index)))} for group in inner.param_groups]
    return {"state": state, "param_groups": groups}


def _kinds(flats, inner, ctx):
    """Per flat, {key: kind} of the state its pieces hold on any rank (a
    collective: every rank then gathers the same keys). A kind is
    ("elements", dtype) or ("scalar", dtype or None for a number)."""
    mine = []
    for flat in flats:
        kinds = {}
        for _, _, piece in flat.pieces:
            for key, value in inner.state.get(piece, {}).items():
                tensor = torch.is_tensor(value)
                elements = tensor and value.dim() > 0
                kinds[key] = ("elements" if elements else "scalar",
                              str(value.dtype) if tensor else None)
        mine.append(kinds)
    merged = [{} for _ in flats]
    for theirs in all_gather_object(mine, ctx):
        for f, kinds in enumerate(theirs):
            merged[f].update(kinds)
    return merged


def _dtype(kind):
    return getattr(torch, kind[1].split(".")[-1]) if kind[0] == "elements" else torch.float64


def _take(key, kind):
    def take(piece, state):
        value = state[key]
        return value.reshape(-1) if kind[0] == "elements" else float(value)
    return take


def _whole_of(flat, inner, take, dtype):
    """The unit's flat vector of ``take(piece, its state)`` over each
    piece's elements (0 where a piece has no state), every rank's range."""
    mine = torch.zeros(flat.hi - flat.lo, dtype=dtype, device=flat.full.device)
    for i, start, piece in flat.pieces:
        state = inner.state.get(piece)
        if state:
            lo = flat.offsets[i] + start - flat.lo
            mine[lo:lo + piece.numel()] = take(piece, state)
    return flat.whole(mine)


def _part(values, shape, kind):
    if kind[0] == "elements":
        return values.view(shape).cpu().clone()
    if kind[1] is None:
        return values[0].item()
    return torch.tensor(values[0].item(), dtype=_dtype(("elements", kind[1])))


def load_optimizer_state(flats, inner, state, index):
    """A full optimizer state (on every rank) into this rank's pieces."""
    for group, settings in zip(inner.param_groups, state["param_groups"]):
        group.update({k: v for k, v in settings.items() if k != "params"})
    for flat in flats:
        for i, start, piece in flat.pieces:
            param = flat.params[i]
            entry = state["state"].get(index[id(param)])
            if not entry:
                inner.state.pop(piece, None)
                continue
            mine = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != flat.numels[i]:
                        raise RuntimeError(
                            f"size mismatch for the optimizer's {key} of parameter "
                            f"{index[id(param)]}: {tuple(value.shape)} saved, "
                            f"{tuple(flat.shapes[i])} here")
                    mine[key] = value.reshape(-1)[start:start + piece.numel()].to(piece).clone()
                else:
                    mine[key] = value.clone() if torch.is_tensor(value) else value
            inner.state[piece] = mine
