"""Which ranks take part in the gradient exchange, and what a rank that sits
out still does: a plan may leave out ranks that would slow the job more than
their samples speed it (``Plan.sitting``, chosen in plan/links.py).

For as long as it sits out, a rank:

- takes part in every update's stats all-reduce, with zeros, so it stays on
  the others' loop (validations, saves, the end) and in an elastic job's
  generation (heartbeats, no change of members);
- runs no forward or backward, joins no gradient collective and makes no
  step: its model and optimizer stay as they were when it left;
- hears from rank 0, after each update, whether the update was made, the
  count it reached and whether the run stops there (three numbers, sent
  without waiting for them), so its update count, LR schedule and stop
  decisions stay every rank's;
- receives, when it comes back, rank 0's whole Controller state (one
  broadcast in a group of rank 0 and the ranks coming back, bounded as
  every object ranks exchange: collectives.MAX_OBJECT_BYTES).

The members' gradients are summed in a process group of their own (one per
set of members, made by every rank in the same order: new_group's rule), so
the divisor W of the gradient math (controller.py) is the members' count:
(G/W) * (W/N) is still the gradient of the mean loss over the global batch,
to which a rank that sits out adds no sample. Rank 0 is always a member.
"""

import torch
import torch.distributed as dist

from hetseq.distributed.collectives import wire_device
from hetseq.errors import PeerLost


class Members:
    """The ranks in the gradient exchange (``active``) and their group
    (None: the world's)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.active = tuple(range(ctx.world_size))
        self.group = None
        self._groups = {}
        self._sent = []          # rank 0's messages still on their way

    @property
    def sitting(self):
        """Whether this rank sits out."""
        return self.ctx.rank not in self.active

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
        if not self.ctx.is_main or len(self.active) == self.ctx.world_size:
            return
        for work in self._sent:      # the last update's, long received
            work.wait()
        message = torch.tensor([float(made), float(updates), float(stops)],
                               dtype=torch.float64, device=wire_device(self.ctx))
        self._sent = [dist.isend(message, dst=rank) for rank in range(self.ctx.world_size)
                      if rank not in self.active]

    def hear(self):
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
