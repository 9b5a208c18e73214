"""The model's state cut into units and laid flat, for state shares that are
not even (``--state-shares memory``, uneven.py): a unit is what FSDP would
wrap, its parameters of one dtype lie end to end in one flat vector, and
rank r owns a contiguous range of about n * share_r of its n elements.
Ranges are gathered and reduced owner by owner, since gloo all-gathers only
equal sizes (docs/memory-and-precision.md, 'State shares by memory').
"""

import torch
import torch.distributed as dist
from torch import nn


def _members(model):
    """Every member of an ``nn.ModuleList`` (at any depth), in model order."""
    return [unit for module in model.modules() if isinstance(module, nn.ModuleList)
            for unit in module]


def _owners(model, members):
    """{id(parameter): the innermost member (its index, None for the root)
    holding it}, one entry per module holding it: a tied weight has several."""
    index = {id(unit): i for i, unit in enumerate(members)}
    owners = {}

    def walk(module, unit):
        unit = index.get(id(module), unit)
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(unit)
        for child in module._modules.values():
            if child is not None:
                walk(child, unit)
    walk(model, None)
    return owners


def units(model):
    """[(module, [its own trainable parameters])]: every member of an
    ``nn.ModuleList`` (at any depth: a parameter belongs to the innermost
    member holding it), in model order, then the root with every parameter
    left. A parameter held by modules of two units (tied weights: a layer's
    and the root's head's) belongs to the root, gathered all through."""
    members = _members(model)
    owners = _owners(model, members)
    held = {}
    for param in model.parameters():
        if param.requires_grad:
            (unit,) = owners[id(param)] if len(owners[id(param)]) == 1 else (None,)
            held.setdefault(unit, []).append(param)
    found = [(unit, held[i]) for i, unit in enumerate(members) if i in held]
    return found + ([(model, held[None])] if None in held else [])


def wrapped_members(model):
    """The members FSDP2 may wrap on their own, innermost first (it wraps
    bottom-up: a member wrapped after its parent finds its parameters taken):
    units()'s members, less any holding a parameter tied outside it, which
    FSDP2 refuses to split between groups; those go to the root's group."""
    members = _members(model)
    owners = _owners(model, members)
    tied = {param for param, held in owners.items() if len(held) > 1}
    inner_first = [m for m in reversed(list(model.modules())) if id(m) in
                   {id(unit) for unit in members}]
    return [m for m in inner_first if not any(id(p) in tied for p in m.parameters())]


def bounds(numel, shares):
    """Where each rank's range of ``numel`` elements begins, and the end:
    [0, ..., numel], rank r owning about numel * shares[r] (``shares`` sum
    to 1; rounding goes to the cumulative sum, so the ranges tile exactly)."""
    cuts, total = [0], 0.0
    for share in shares[:-1]:
        total += share
        cuts.append(min(numel, max(cuts[-1], round(numel * total))))
    return cuts + [numel]


def unit_bytes(model):
    """Bytes of each unit's trainable parameters (units() order)."""
    return [sum(p.numel() * p.element_size() for p in params) for _, params in units(model)]


def _pieces(tensors, lo, hi):
    """The elements [lo, hi) of ``tensors`` laid end to end, as a list of
    flat views (no copy of the rest)."""
    pieces, offset = [], 0
    for tensor in tensors:
        n = tensor.numel()
        start, end = max(lo, offset), min(hi, offset + n)
        if start < end:
            pieces.append(tensor.reshape(-1)[start - offset:end - offset])
        offset += n
    return pieces


def owned(tensors, lo, hi):
    """A new flat tensor of the elements [lo, hi) of ``tensors`` laid end to end."""
    pieces = _pieces(tensors, lo, hi)
    if pieces:
        return torch.cat(pieces)
    return tensors[0].new_empty(0)


def _repoint(param, data):
    """``param.data = data``, with a gradient accumulator of its own from
    now on: set_data keeps the cached one unless the dtype or device
    changes, hence the empty tensor of another dtype first. A graph built
    on a freed parameter's view then sends its gradient (the view's shape)
    to the hook uneven.py refuses it in, not into the whole weight's
    accumulator, where autograd dies mid-backward ('invalid gradient')."""
    other = torch.float32 if data.dtype != torch.float32 else torch.float64
    param.data = data.new_empty(0, dtype=other)
    param.data = data


class FlatUnit:
    """One unit's parameters (of one dtype) as one flat vector ``full``, of
    which this rank owns [lo, hi). Gathered, the parameters are views of
    ``full`` in their shapes (``shapes``, ``numels``, ``offsets``); freed
    (storage resized to 0), each is a flat view of its part of this rank's
    shard, or empty, as FSDP1's are: read outside forward, valid memory."""

    # ``kept`` (--zero 1): always gathered, the shard a view of ``full``;
    # else the shard is a tensor of its own on ``home`` (the host under
    # --cpu-offload). The optimizer steps ``pieces``: one parameter per model
    # parameter the range overlaps, views of the shard; a model parameter no
    # rank gave a gradient in an update gives its pieces none, so the
    # optimizer leaves it alone.

    def __init__(self, params, cuts, rank, device, home, kept):
        self.params, self.kept = params, kept
        self.shapes = [param.shape for param in params]
        self.numels = [param.numel() for param in params]
        self.numel = sum(self.numels)
        self.full = torch.empty(self.numel, dtype=params[0].dtype, device=device)
        self._bytes = self.full.untyped_storage().nbytes()
        self.offsets, offset = [], 0
        with torch.no_grad():
            for param, n in zip(params, self.numels):
                self.full[offset:offset + n].copy_(param.detach().reshape(-1))
                self.offsets.append(offset)
                offset += n
        self._as_views()
        self.gathered = True
        self._own(cuts, rank, home)
        if not kept:
            self.free()

    def _own(self, cuts, rank, home):
        """The range [cuts[rank], cuts[rank+1]) (the unit gathered)."""
        self.cuts, self.lo, self.hi = cuts, cuts[rank], cuts[rank + 1]
        own = self.full[self.lo:self.hi]
        self.shard = own if self.kept else own.detach().to(home, copy=True)
        self.pieces = []          # (parameter index, its first element, the piece)
        for i, (n, offset) in enumerate(zip(self.numels, self.offsets)):
            start, end = max(self.lo, offset), min(self.hi, offset + n)
            if start < end:
                piece = nn.Parameter(self.shard[start - self.lo:end - self.lo])
                self.pieces.append((i, start - offset, piece))
        self.grad = None          # this range's summed gradient / W, while an update runs
        self.used = torch.zeros(len(self.params), dtype=torch.int32)

    def recut(self, cuts, rank):
        """Own the range [cuts[rank], cuts[rank+1]) from now on (a
        collective: the unit is gathered first, where it is not)."""
        was = self.gathered
        self.gather()
        self._own(cuts, rank, self.shard.device)
        if not was:
            self.free()

    def ranges(self):
        return [(r, self.cuts[r], self.cuts[r + 1]) for r in range(len(self.cuts) - 1)
                if self.cuts[r + 1] > self.cuts[r]]

    def gather(self):
        """Every rank's range into ``full`` (a collective): owner by owner."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._bytes)
        data = self.full.data      # a write not seen by autograd's version counter
        data[self.lo:self.hi].copy_(self.shard.detach())
        for r, lo, hi in self.ranges():
            dist.broadcast(data[lo:hi], src=r)
        self._as_views()
        self.gathered = True

    def _as_views(self):
        """Each parameter a view of ``full`` in its shape (the unit gathered).
        ``.data`` is swapped, not the parameter: autograd's graph, hooks and
        the optimizer keep the same objects."""
        for param, offset, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            _repoint(param, self.full[offset:offset + n].view(shape))

    def _as_shard(self):
        """Each parameter the flat view of its part of this rank's shard, or
        an empty tensor where the range holds none of it (the unit freed):
        a task that reads one outside forward reads memory that exists,
        never the freed storage of ``full`` (issue 58: a segfault)."""
        shard = self.shard.detach()
        for param, offset, n in zip(self.params, self.offsets, self.numels):
            start, end = max(self.lo, offset), min(self.hi, offset + n)
            _repoint(param, shard[start - self.lo:end - self.lo] if start < end else
                     shard.new_empty(0))

    def copy_whole(self):
        """A new flat vector of the unit's whole weights (a collective where
        the unit is freed: each owner's range broadcast), never a view of
        ``full``, whose storage free() releases: what ``full_weights``
        yields stays valid however long a task keeps it."""
        if self.gathered:
            return self.full.detach().clone()
        return self.whole(self.shard.detach().to(self.full.device))

    def write_whole(self, flat):
        """What a task left in ``flat`` (copy_whole's) into the unit: this
        rank's range into its shard and, where the unit is gathered, each
        parameter it changed into ``full`` too (a write, as a write to the
        parameter: autograd sees it)."""
        with torch.no_grad():
            if not self.gathered:
                self.shard.copy_(flat[self.lo:self.hi])
                return
            for param, offset, n, shape in zip(self.params, self.offsets, self.numels,
                                               self.shapes):
                part = flat[offset:offset + n].view(shape)
                if not torch.equal(part, param.data):
                    param.detach().copy_(part)
            self.write_back()

    def write_back(self):
        """What was written into ``full`` while gathered (a task's
        ``full_weights``), this rank's range of it, into the shard that the
        optimizer steps and the next gather reads."""
        if not self.kept and self.gathered:
            with torch.no_grad():
                self.shard.copy_(self.full.data[self.lo:self.hi])

    def share_update(self):
        """--zero 1, after the step: each owner's updated range to every rank."""
        data = self.full.data
        for r, lo, hi in self.ranges():
            dist.broadcast(data[lo:hi], src=r)

    def free(self):
        if self.gathered and not self.kept:
            self._as_shard()
            # Resized to 0, as FSDP1 does: the views of ``full`` autograd saved in
            # forward (a weight's transpose) see the data again once the unit is
            # gathered; the parameters themselves point at the shard meanwhile.
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def _whole_grads(self):
        """The parameters' gradients (zeros where none), noting which had one."""
        self.used |= torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        # Zeros in the parameter's own shape: a unit whose backward never ran
        # is freed here, its parameters then views of the shard.
        return [p.grad if p.grad is not None else
                torch.zeros(shape, dtype=self.full.dtype, device=self.full.device)
                for p, shape in zip(self.params, self.shapes)]

    def reduce_grads(self, world, dtype):
        """The summed gradient of this rank's range, divided by W, added to
        ``grad``; every parameter's whole gradient freed. A collective."""
        grads = self._whole_grads()
        flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype or grads[0].dtype)
        for p in self.params:
            p.grad = None
        for r, lo, hi in self.ranges():
            dist.reduce(flat[lo:hi], dst=r)
        # A copy: a view would keep the whole unit's gradient alive until the step.
        mine = flat[self.lo:self.hi].to(self.shard.dtype, copy=True).div_(world)
        mine = mine.to(self.shard.device)
        self.grad = mine if self.grad is None else self.grad.add_(mine)

    def gather_grads(self):
        """--zero 1: this rank's range of the (already summed) gradients."""
        self.grad = owned(self._whole_grads(), self.lo, self.hi).to(self.shard.device)

    def hand_over(self, used):
        """The gradient to the pieces of the parameters ``used`` (by any
        rank in this update); the others' pieces get none."""
        for i, start, piece in self.pieces:
            lo = self.offsets[i] + start - self.lo
            # No gradient: the optimizer leaves the piece alone, as torch's leaves a
            # parameter whose gradient is None (momentum and weight decay would move it).
            piece.grad = self.grad[lo:lo + piece.numel()] if used[i] else None

    def clear(self):
        self.grad = None
        self.used.zero_()
        for _, _, piece in self.pieces:
            piece.grad = None
        for p in self.params:
            p.grad = None

    # ---- the full format ----

    def whole(self, values):
        """The flat vector whose range [lo, hi) is ``values`` (this rank's),
        the others' from their owners: a collective, the result on every rank."""
        full = torch.empty(self.numel, dtype=values.dtype, device=self.full.device)
        full[self.lo:self.hi].copy_(values)
        for r, lo, hi in self.ranges():
            dist.broadcast(full[lo:hi], src=r)
        return full

    def split(self, flat):
        """``flat`` cut into one host tensor per parameter, in its shape."""
        return [flat[offset:offset + n].view(shape).detach().cpu().clone()
                for offset, n, shape in zip(self.offsets, self.numels, self.shapes)]
