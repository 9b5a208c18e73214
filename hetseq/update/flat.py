"""Parameters as one flat copy per dtype and device: what --local-steps
reads, averages and writes back in one piece per group, instead of one
tensor per parameter."""

import torch


class FlatParams:
    """The parameters as one flat copy per dtype and device."""

    def __init__(self, params):
        groups = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.groups = list(groups.values())

    @torch.no_grad()
    def read(self):
        return [torch.cat([p.detach().reshape(-1) for p in group]) for group in self.groups]

    @torch.no_grad()
    def write(self, flats):
        for group, flat in zip(self.groups, flats):
            for p, part in zip(group, self._views(group, flat)):
                p.copy_(part)

    def set_grads(self, flats):
        for group, flat in zip(self.groups, flats):
            for p, part in zip(group, self._views(group, flat)):
                p.grad = part

    @staticmethod
    def _views(group, flat):
        offset = 0
        for p in group:
            yield flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
