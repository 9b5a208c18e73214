"""The model's state cut into units and laid flat, for state shares that are
not even (``--state-shares memory``, uneven.py).

A unit is what FSDP would wrap (sharding.py): every module inside an
``nn.ModuleList`` (the layers of most models), then the root for the
parameters left. Each unit's parameters of one dtype are laid end to end in
one flat vector of n elements; rank r owns the contiguous range
[bounds[r], bounds[r+1]), of about n * share_r elements. A parameter keeps
its shape: it is a view of the unit's full vector while the unit is gathered.

Gathering and reducing a range go owner by owner (W broadcasts, W
reduces), whatever the sizes: gloo's all-gather takes only equal sizes, and
its broadcasts of a 1:3 split of 11M floats took 13 ms on this 2-core host
where an even all-gather took 50 ms (bench/memory_shares.py measures whole
steps against torch's even engines).
"""

import torch
import torch.distributed as dist
from torch import nn


def units(model):
    """[(module, [its own trainable parameters])]: the ModuleLists' members
    first, in model order, then the root with every parameter left. A
    parameter shared by two units (tied weights) belongs to the root."""
    members = [unit for module in model.modules() if isinstance(module, nn.ModuleList)
               for unit in module]
    owners = {}
    for index, unit in enumerate(members):
        for param in unit.parameters():
            owners.setdefault(id(param), set()).add(index)
    found = []
    for index, unit in enumerate(members):
        mine = [p for p in unit.parameters() if p.requires_grad and owners[id(p)] == {index}]
        if mine:
            found.append((unit, mine))
    taken = {id(p) for _, params in found for p in params}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return found + ([(model, rest)] if rest else [])


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


class FlatUnit:
    """One unit's parameters (of one dtype) as one flat vector ``full``, of
    which this rank owns [lo, hi). The parameters are views of ``full``;
    when the unit is not gathered its storage is freed (resized to 0, as
    FSDP1 does: autograd's saved parameters keep their shapes and see the
    data again once it is gathered). ``kept`` (--zero 1): always gathered,
    the shard a view of ``full``; else the shard is a tensor of its own on
    ``home`` (the host under --cpu-offload)."""

    def __init__(self, params, cuts, rank, device, home, kept):
        self.params, self.cuts, self.kept = params, cuts, kept
        self.lo, self.hi = cuts[rank], cuts[rank + 1]
        self.numel = cuts[-1]
        self.full = torch.empty(self.numel, dtype=params[0].dtype, device=device)
        self._bytes = self.full.untyped_storage().nbytes()
        offset = 0
        with torch.no_grad():
            for param in params:
                view = self.full[offset:offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view(param.shape)
                offset += param.numel()
        own = self.full[self.lo:self.hi]
        self.shard = nn.Parameter(own if kept else own.detach().to(home, copy=True))
        self.gathered = True
        if not kept:
            self.free()

    def recut(self, cuts, rank):
        """Own the range [cuts[rank], cuts[rank+1]) from now on (a
        collective: the unit is gathered first, where it is not)."""
        was = self.gathered
        self.gather()
        self.cuts, self.lo, self.hi = cuts, cuts[rank], cuts[rank + 1]
        own = self.full[self.lo:self.hi]
        self.shard = nn.Parameter(own if self.kept else
                                  own.detach().to(self.shard.device, copy=True))
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
        self.gathered = True

    def share_update(self):
        """--zero 1, after the step: each owner's updated range to every rank."""
        data = self.full.data
        for r, lo, hi in self.ranges():
            dist.broadcast(data[lo:hi], src=r)

    def free(self):
        if self.gathered and not self.kept:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def reduce_grads(self, world, dtype):
        """The summed gradient of this rank's range, divided by W, into the
        shard's gradient (accumulated: a second backward of one update
        adds); every parameter's whole gradient freed. A collective."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype or grads[0].dtype)
        for p in self.params:
            p.grad = None
        for r, lo, hi in self.ranges():
            dist.reduce(flat[lo:hi], dst=r)
        # A copy: a view would keep the whole unit's gradient alive until the step.
        mine = flat[self.lo:self.hi].to(self.shard.dtype, copy=True).div_(world)
        mine = mine.to(self.shard.device)
        if self.shard.grad is None:
            self.shard.grad = mine
        else:
            self.shard.grad.add_(mine)

    def gather_grads(self):
        """--zero 1: this rank's range of the (already summed) gradients."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.shard.grad = owned(grads, self.lo, self.hi).to(self.shard.device)

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
        out, offset = [], 0
        for param in self.params:
            out.append(flat[offset:offset + param.numel()].view(param.shape).detach().cpu().clone())
            offset += param.numel()
        return out
