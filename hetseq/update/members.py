"""Which ranks take part in the gradient exchange, and what a rank that sits
out still does (docs/capacity.md, "When a rank sits out"): it sends zeros in
every stats all-reduce, runs no forward and makes no step, receives each
update's outcome from rank 0, and takes rank 0's whole state when it comes
back. The members sum their gradients in a process group of their own, so
W of the gradient math is the members' count."""

import torch
import torch.distributed as dist

from hetseq.distributed.collectives import wire_device
from hetseq.base.errors import PeerLost


class Members:
    """The ranks in the gradient exchange (``active``) and their group
    (None: the world's)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.active = tuple(range(ctx.world_size))
        self.sitting = False         # this rank sits out
        self.someone_sits = False    # some rank does (rank 0 tells them each outcome)
        self.group = None
        self._groups = {}
        self._sent = []          # rank 0's messages still on their way

    def change(self, active):
        """Make ``active`` the members (every rank calls it at the same
        update). Returns the ranks that come back, or None when nothing changed."""
        active = tuple(sorted(active))
        if 0 not in active:
            raise ValueError(f"rank 0 must take part in the exchange (members {active})")
        if active == self.active:
            return None
        returning = [rank for rank in active if rank not in self.active]
        self.active = active
        self.sitting = self.ctx.rank not in active
        self.someone_sits = len(active) < self.ctx.world_size
        self.group = None if len(active) == self.ctx.world_size else self.group_of(active)
        return returning

    def group_of(self, ranks):
        """A process group of ``ranks`` (every rank calls this, in one order)."""
        ranks = tuple(sorted(ranks))
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks))
        return self._groups[ranks]

    def tell(self, made, updates, stops=False):
        """Rank 0, after an update: whether it was made, the count reached and
        whether the run stops there, to every rank that sits out (nothing on
        a member other than rank 0)."""
        if not self.ctx.is_main or not self.someone_sits:
            return
        for work in self._sent:      # the last update's, long received
            work.wait()
        message = torch.tensor([float(made), float(updates), float(stops)],
                               dtype=torch.float64, device=wire_device(self.ctx))
        self._sent = [dist.isend(message, dst=rank) for rank in range(self.ctx.world_size)
                      if rank not in self.active]

    def receive_outcome(self):
        """A rank that sits out: (made, updates, stops) of the update, from rank 0."""
        message = torch.zeros(3, dtype=torch.float64, device=wire_device(self.ctx))
        dist.recv(message, src=0)
        made, updates, stops = message.tolist()
        if made not in (0.0, 1.0) or stops not in (0.0, 1.0) or not 0 <= updates < 2 ** 53 \
                or updates != int(updates):
            raise PeerLost(f"rank 0 sent {message.tolist()} as an update's outcome, expected "
                           "[0 or 1, a count, 0 or 1]: a rank of another version, or corrupted "
                           "traffic; restart the job with the same HetSeq everywhere")
        return bool(made), int(updates), bool(stops)
