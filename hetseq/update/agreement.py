"""Keeping every rank's copy of the model equal to rank 0's, for runs of any
length: two kinds of device round the same optimizer step differently, so
replicas drift apart by about one rounding per step. Every
``--divergence-check-interval`` updates the ranks compare an exact checksum
in the stats all-reduce; rank 0's copy replaces a rounding difference, and a
larger one stops the run with exit 4 (docs/checkpoints.md, the divergence check).
"""

import logging
import time

import torch
import torch.distributed as dist

from hetseq.distributed import all_gather_object
from hetseq.base.errors import TrainingFailed
from hetseq.base.sections import Section, flag, section

logger = logging.getLogger(__name__)

_MODULUS = 2 ** 50          # kept below 2**53: the checksum travels in float64
_INTS = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@torch.no_grad()
def checksum(tensors):
    """An integer fingerprint of ``tensors`` (their bits, their order), as a
    float in 1..2**50; 0.0 when there is nothing to check."""
    if not tensors:
        return 0.0
    sums = torch.stack([t.detach().reshape(-1).view(_INTS[t.element_size()])
                        .sum(dtype=torch.int64).to(tensors[0].device) for t in tensors])
    weights = torch.arange(1, len(tensors) + 1, dtype=torch.int64, device=sums.device)
    # Weighted by position so that two tensors trading values are seen too;
    # the products stay far below 2**63 (a sum of int32s times a count).
    total = int((sums.remainder(_MODULUS) * weights).remainder(_MODULUS).sum())
    return float(total % _MODULUS + 1)


@section
class AgreementConfig(Section):
    """How often ranks compare their copies, and how far apart they may be."""
    divergence_check_interval: int = flag(
        10, type=int, metavar="N",
        help="every N updates, check that all ranks hold the same parameters and optimizer "
             "state (an exact checksum; 0: never; default: 10)")
    divergence_tolerance: float = flag(
        1e-4, type=float, metavar="REL",
        help="ranks that drifted from rank 0 by at most this relative distance (rounding "
             "on different devices) take rank 0's copy; further apart, the run stops with "
             "exit 4 (0: any difference stops it; default: %(default)s)")


class Agreement:
    """``cfg``: the job's AgreementConfig; ``replicated()``: the tensors
    every rank holds a copy of (``Sharding.replicated_state``); ``members``:
    the ranks in the exchange (update/members.py). A rank that sits out
    holds the state of the update it left: it sends no checksum and takes
    no part in a resync (it receives rank 0's whole state when it comes back)."""

    def __init__(self, cfg, ctx, replicated, members):
        self.cfg, self.ctx, self.replicated, self.members = cfg, ctx, replicated, members
        self.pending = 0.0     # this rank's checksum for the next update's stats (0: none)
        self._last = 0         # the update of the last call

    def due(self, num_updates, now=False):
        """After update ``num_updates`` (``now``: at start-up or after a resume):
        checksum the state if a check is due, for the next update's stats: when
        a multiple of the interval was reached since the last call (updates
        come in rounds of several under --local-steps)."""
        every, last, self._last = self.cfg.divergence_check_interval, self._last, num_updates
        self.pending = checksum(self.replicated()) if every and not self.members.sitting and (
            now or num_updates // every > last // every) else 0.0

    def check(self, checksums, update):
        """``checksums``: every rank's, as the stats of update ``update``
        brought them; a collective when any differs (every rank gets them)."""
        if disagreeing(checksums) and not self.members.sitting:
            resync(self.replicated(), self.ctx, self.cfg.divergence_tolerance, update,
                   self.members.group)


def disagreeing(checksums):
    """Ranks whose checksum differs from rank 0's (none when nothing was
    sent; a rank that sent none, sitting out, is not asked)."""
    reference = checksums[0]
    return [] if reference == 0.0 else [r for r, c in enumerate(checksums)
                                        if c and c != reference]


@torch.no_grad()
def resync(tensors, ctx, tolerance, update, group=None):
    """Give every rank (of ``group``: the members) rank 0's ``tensors`` when
    all are within ``tolerance`` of them (relative); otherwise stop the run
    (TrainingFailed). A collective: every rank of the group calls it in the
    same update."""
    _check_layout(tensors, ctx, update, group)
    start = time.perf_counter()
    own = reference = 0.0
    for bucket in _buckets(tensors):
        # One broadcast per bucket of up to 64 MB, not one per tensor.
        # On this rank's device: a GPU rank keeps some state on the host
        # (Adam's step counts), a CPU rank all of it.
        mine = torch.cat([t.reshape(-1).to(ctx.device) for t in bucket])
        received = mine.clone()
        dist.broadcast(received, src=0, group=group)
        own += float(torch.linalg.vector_norm(mine - received, dtype=torch.float64)) ** 2
        reference += float(torch.linalg.vector_norm(received, dtype=torch.float64)) ** 2
        offset = 0
        for tensor in bucket:
            tensor.copy_(received[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    distances = torch.zeros(ctx.world_size, dtype=torch.float64, device=ctx.device)
    distances[ctx.rank] = own ** 0.5 / max(reference ** 0.5, 1e-30)
    dist.all_reduce(distances, group=group)
    far = {r: d for r, d in enumerate(distances.tolist()) if d > tolerance}
    if far:
        raise TrainingFailed(
            f"parameters differ between ranks before update {update}: relative distance to "
            "rank 0's " + ", ".join(f"{d:.3g} on rank {r}" for r, d in far.items()) +
            f", beyond --divergence-tolerance {tolerance:g} (different devices only round "
            "apart by about 1e-7 per update). Every rank must run the same code, model and "
            "flags; a rank changing parameters outside the Controller, or a non-deterministic "
            "optimizer, does this")
    if ctx.is_main:
        logger.info("ranks drifted apart by rounding (relative distance to rank 0: %s); all "
                    "now hold rank 0's parameters and optimizer state (%.1f ms)",
                    ", ".join(f"rank {r} {d:.2g}" for r, d in enumerate(distances.tolist())
                              if r), 1000 * (time.perf_counter() - start))


def _buckets(tensors, limit=2 ** 24):
    """``tensors`` in runs of one dtype, up to ``limit`` elements each. Split by
    what every rank agrees on (dtypes and sizes), never by device: a GPU rank
    keeps Adam's step counts on the host where a CPU rank has everything
    there, and ranks whose buckets differed would make different broadcasts
    (a hang)."""
    bucket, size = [], 0
    for tensor in tensors:
        if bucket and (size + tensor.numel() > limit or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel()
    if bucket:
        yield bucket


def _check_layout(tensors, ctx, update, group=None):
    """The same tensors in the same shapes on every rank, or a broadcast would
    hang or mix them up."""
    layouts = all_gather_object([tuple(t.shape) for t in tensors], ctx, group)
    ranks = range(ctx.world_size) if group is None else dist.get_process_group_ranks(group)
    odd = [(r, layout) for r, layout in zip(ranks, layouts) if layout != layouts[0]]
    if odd:
        raise TrainingFailed(
            f"ranks {[r for r, _ in odd]} hold a different model or optimizer state than "
            f"rank 0 before update {update} ({len(odd[0][1])} tensors against "
            f"{len(layouts[0])}); every rank must build the same model with the same flags")
