"""What the gradient exchange costs on the job's real links, and which ranks
pay for their place in it: a CPU rank beside a GPU, or a fast machine behind
a slow link, can add fewer samples/s than its link costs, and the job is
then faster without it. Rank 0 times each link; every rank then makes the
same choice from rank 0's figures. docs/capacity.md, "When a rank sits out".
"""

import dataclasses
import itertools
import logging
import time

from hetseq.plan.capacity import Plan, split_among

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20      # the larger of the two sizes timed (the gradient's, when smaller)
SMALLER = 16               # the smaller size: PROBE_BYTES / SMALLER
# Round trips timed per size; the fastest counts: a busy host only ever adds
# to a link's time (scheduling, another process), never takes from it.
REPEATS = 5
EXHAUSTIVE = 12            # up to this many ranks every subset is tried; above, nested ones


@dataclasses.dataclass(frozen=True)
class Links:
    """Each rank's link to rank 0, one direction: (latency seconds, seconds
    per byte); rank 0's own entry is (0, 0). ``gradient_bytes``: what one
    exchange sums."""
    fits: tuple
    gradient_bytes: int

    def seconds(self, members):
        """Predicted seconds of one exchange among ``members`` (X, below)."""
        # A ring all-reduce of the G gradient bytes among n members: 2(n-1) steps,
        # each a message of G/n, paced by the slowest link (a_i, b_i: its fit):
        #   X(S) = max_{i in S, i != 0} [2(n-1) a_i + 2(n-1)/n G b_i],  X({0}) = 0
        n = len(members)
        if n < 2:
            return 0.0
        return max(2 * (n - 1) * self.fits[i][0] + 2 * (n - 1) / n * self.gradient_bytes *
                   self.fits[i][1] for i in members if i != 0)

    def describe(self):
        return ", ".join(f"rank {rank} {1000 * a:.2f} ms + {_rate(b)}"
                         for rank, (a, b) in enumerate(self.fits) if rank)


def _rate(per_byte):
    return "no measurable cost per byte" if per_byte <= 0 else \
        f"{8 / per_byte / 1e6:.1f} Mbit/s"


def measure(ctx, gradient_bytes):
    """Every rank's link to rank 0 (a collective: every rank calls it, in
    the same update). None when there is nothing to measure (one rank)."""
    import torch

    from hetseq.distributed.collectives import broadcast_from_main, wire_device
    if not ctx.distributed:
        return None
    big = max(4096, min(gradient_bytes, PROBE_BYTES)) // 4 * 4
    small = max(4, big // SMALLER // 4 * 4)
    device = wire_device(ctx)
    buffers = {size: torch.zeros(size // 4, device=device) for size in (small, big)}
    fits = [(0.0, 0.0)]
    for rank in range(1, ctx.world_size):
        if ctx.rank not in (0, rank):
            continue
        peer = rank if ctx.is_main else 0
        _bounce(buffers[big], peer, ctx.is_main)        # both arrive; the path is warm
        times = {size: min(_bounce(buffer, peer, ctx.is_main) for _ in range(REPEATS))
                 for size, buffer in buffers.items()}
        # A round trip carries the bytes each way: twice one direction's cost.
        per_byte = max(0.0, (times[big] - times[small]) / (big - small)) / 2
        fits.append((max(0.0, times[small] / 2 - per_byte * small), per_byte))
    fits = broadcast_from_main(lambda: fits, ctx)
    return Links(tuple(tuple(fit) for fit in fits), int(gradient_bytes))


def _bounce(buffer, peer, first):
    """Seconds of ``buffer`` sent to ``peer`` and back (``first``: this rank
    sends first); point to point, so no group is made and no other rank waits."""
    import torch
    import torch.distributed as dist
    start = time.perf_counter()
    if first:
        dist.send(buffer, peer)
        dist.recv(buffer, peer)
    else:
        dist.recv(buffer, peer)
        dist.send(buffer, peer)
    if buffer.device.type == "cuda":
        torch.cuda.synchronize(buffer.device)
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Choice:
    """A plan and what it was chosen on: the predicted seconds of an update
    (compute and exchange) for its members and for every rank."""
    plan: Plan
    compute: float
    exchange: float
    everyone: tuple        # (compute, exchange) with every rank taking part


def update_seconds(shares, rates, members, links, per_update=1):
    """(compute, exchange) seconds of an update: the slowest member's share
    and the exchange among the members, per update served."""
    # T(S) = max_{i in S} s_i / r_i + X(S) / H: H updates served by one exchange.
    compute = max((shares[i] / rates[i] for i in members if shares[i]), default=0.0)
    exchange = links.seconds(members) / per_update if links is not None else 0.0
    return compute, exchange


def best_plan(global_batch, rates, caps, links, can_sit, per_update=1, overhead=0.0):
    """The Choice of least predicted update time: every subset of ranks that
    holds rank 0 when ``can_sit`` (the --zero mode and exchange let a rank
    sit out), else every rank with its fastest split. ``overhead``: seconds
    an update of several members costs beyond the model (measured)."""
    world = len(rates)
    known = [rank for rank in range(world) if rates[rank] > 0]   # a fixed plan's weight 0: out
    if not can_sit or links is None or world < 2:
        plan = _split(global_batch, rates, caps, known)
        seconds = update_seconds(plan.batch_sizes, rates, known, links, per_update)
        return Choice(plan, *seconds, seconds)
    best = None
    for members in _candidates(rates):
        plan = _split(global_batch, rates, caps, members)
        # A member left without samples only slows the exchange.
        members = [i for i in members if plan.batch_sizes[i] or i == 0]
        plan = dataclasses.replace(plan, sitting=[i for i in range(world) if i not in members])
        compute, exchange = update_seconds(plan.batch_sizes, rates, members, links, per_update)
        seconds = (compute, exchange + (overhead if len(members) > 1 else 0.0))
        if best is None or sum(seconds) < sum(best[1]) * (1 - 1e-9):
            best = (plan, seconds)
    compute, exchange = update_seconds(_split(global_batch, rates, caps, known).batch_sizes,
                                       rates, known, links, per_update)
    everyone = (compute, exchange + (overhead if len(known) > 1 else 0.0))
    return Choice(best[0], *best[1], everyone)


def _split(global_batch, rates, caps, members):
    return Plan(split_among(global_batch, rates, members), list(caps), list(rates))


def _candidates(rates):
    """Sets of ranks holding rank 0: all of them for a small world; above
    EXHAUSTIVE ranks, rank 0 with the k fastest others, for every k."""
    others = [rank for rank in range(1, len(rates)) if rates[rank] > 0]
    if len(rates) <= EXHAUSTIVE:
        for k in range(len(others) + 1):
            for chosen in itertools.combinations(others, k):
                yield (0, *chosen)
        return
    ordered = sorted(others, key=lambda i: -rates[i])
    for k in range(len(ordered) + 1):
        yield (0, *sorted(ordered[:k]))


def why_sitting(plan, links, devices, per_update=1):
    """One line per rank that sits out, with the figures it was chosen on:
    what its samples/s would save of the update, what its exchange costs."""
    if not all(rate > 0 for rate in plan.rates):     # a fixed plan: the user's weight of 0
        return [f"rank {rank} {devices[rank]} sits out: its --capacity weight is 0"
                for rank in plan.sitting]
    return [f"rank {rank} {devices[rank]} sits out: " + _worth(plan, rank, links, per_update)
            for rank in plan.sitting]


def who_pays(global_batch, rates, caps, links, devices, per_update):
    """Where no rank can sit out (--zero 1-3, PowerSGD, --local-steps): one
    line per rank but 0, saying whether it pays for its place in the
    exchange (with --local-steps, once per round)."""
    if links is None or not all(rate > 0 for rate in rates):
        return []
    best = best_plan(global_batch, rates, caps, links, True, per_update).plan
    lines = []
    for rank in range(1, len(rates)):
        if rank in best.sitting:
            lines.append(f"rank {rank} {devices[rank]} does not pay for its place: "
                         + _worth(best, rank, links, per_update) + "; this mode keeps every "
                         "rank in the exchange: leave it out of the job"
                         + (" or raise --local-steps" if per_update > 1 else ""))
        else:
            others = [i for i in range(len(rates)) if i != rank]
            others = dataclasses.replace(_split(global_batch, rates, caps, others),
                                         sitting=[rank])
            lines.append(f"rank {rank} {devices[rank]} pays for its place: "
                         + _worth(others, rank, links, per_update))
    return lines


def _worth(plan, rank, links, per_update):
    """What ``rank`` adds to ``plan`` (where it sits out): compute saved, exchange cost."""
    rates = plan.rates
    members = [i for i in range(len(rates)) if i not in plan.sitting]
    now = update_seconds(plan.batch_sizes, rates, members, links, per_update)[0]
    joined = sorted([*members, rank])
    with_it = _split(plan.global_batch, rates, plan.micro_caps, joined)
    compute, exchange = update_seconds(with_it.batch_sizes, rates, joined, links, per_update)
    served = f" ({exchange * per_update:.3f} s per exchange of {per_update} updates)" \
        if per_update > 1 else ""
    return (f"{rates[rank]:.1f} samples/s would save {max(0.0, now - compute):.3f} s of "
            f"{now:.3f} s of compute per update; the exchange with it costs "
            f"{exchange:.3f} s{served}")
