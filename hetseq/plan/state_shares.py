"""Each rank's share of the sharded model state (``--state-shares``), and
whether the state fits at all, decided before the first update. As the batch
follows each rank's speed, the state follows each rank's memory beyond what
every rank holds whole (Cephalo, Guo et al. 2024). Pure arithmetic apart from
one collective (``agree``), so every rank reaches the same shares or the same
refusal. docs/memory-and-precision.md, "State shares by memory".
"""

import dataclasses
import logging

from hetseq.base.errors import UserError
from hetseq.plan.capacity import available_memory_bytes

logger = logging.getLogger(__name__)

GB = 2 ** 30          # --max-memory-gb's unit
# --state-shares auto: memory shares only when the memories differ by more
# than this; below it the uneven collectives would cost more than they save.
AUTO_SPREAD = 1.1


def memory_bytes(shares_cfg, ctx, local_world_size):
    """Bytes this rank has for model state and activations: the node's
    --max-memory-gb (``shares_cfg``: its ShareConfig), else 90% of its GPU
    (the rest for the allocator's fragmentation and CUDA's context), else 80%
    of the host's available memory split between the node's ranks."""
    if shares_cfg.max_memory_gb:
        return shares_cfg.max_memory_gb * GB
    if ctx.device.type == "cuda":
        import torch
        return torch.cuda.get_device_properties(ctx.device).total_memory * 0.9
    return available_memory_bytes() * 0.8 / local_world_size


@dataclasses.dataclass(frozen=True)
class StateSize:
    """The model state under a --zero mode, in bytes: ``sharded`` is split
    between ranks by their shares, ``whole`` is held by every rank whatever
    its share."""
    sharded: int
    whole: int


@dataclasses.dataclass(frozen=True)
class StateShares:
    """Every rank's share of ``StateSize.sharded`` (``fractions``, summing to
    1), the memories they were computed from, and ``kind``: even or memory."""
    fractions: tuple
    memories: tuple
    kind: str


def state_size(zero, cpu_offload, device_type, model, slots):
    """The StateSize of ``model`` (before it is wrapped) under ``--zero zero``
    with an optimizer keeping ``slots`` tensors per parameter (Adam: 2). A
    single process trains --zero N as --zero 0 (sharding.build): pass 0."""
    from hetseq.update.zero.flat_units import unit_bytes
    units = unit_bytes(model)
    params, largest = sum(units), max(units, default=0)
    if zero == 0:
        # Replicas: parameters, gradients and optimizer state on every rank.
        return StateSize(0, (2 + slots) * params)
    if zero == 1:
        # Only the optimizer state is split; parameters and gradients stay whole.
        return StateSize(slots * params, 2 * params)
    if zero == 2:
        # All three split, but the parameters are gathered whole from forward
        # to backward (no resharding after forward).
        return StateSize((2 + slots) * params, params)
    if cpu_offload and device_type == "cuda":
        # The shards live on the host: the device holds one gathered unit and
        # its full gradient at a time.
        return StateSize(0, 2 * largest)
    # One unit's gathered parameters and its full gradient, at a time.
    return StateSize((2 + slots) * params, 2 * largest)


def describe(shares, size):
    """Bytes of model state each rank will hold under ``shares``."""
    return [int(size.whole + fraction * size.sharded) for fraction in shares.fractions]


def choose(cfg, memories, size, distributed=True, given=True):
    """The StateShares for ``memories`` (every rank's bytes for model state,
    rank order) under ``cfg`` (the ShardingConfig), or a UserError when the
    state cannot fit. Pure: every rank computes it from the same numbers.
    ``given``: the memories come from --max-memory-gb on every node (else
    some are estimates, and the fix says how to give them)."""
    memories, world = tuple(memories), len(memories)
    even = StateShares((1.0 / world,) * world, memories, "even")
    if not distributed or cfg.zero == 0:
        # Nothing split between ranks: every rank holds it all.
        _check_even(cfg, even, size, shardable=False, given=given)
        return even
    kind = cfg.state_shares
    if kind == "auto":
        kind = "memory" if _spread(memories) > AUTO_SPREAD else "even"
    if kind == "even":
        _check_even(cfg, even, size, shardable=True, given=given)
        return even
    _check_memory(cfg, memories, size, given)
    return StateShares(_by_memory(memories, size), memories, "memory")


def agree(cfg, memory, size, ctx, given=None, activation=0):
    """The job's StateShares, agreed by all ranks: a collective that gathers
    every rank's ``memory`` (``memory_bytes``) less ``activation`` (what its
    activations need at its micro-batch, once measured; 0 before), then
    ``choose`` on every rank. ``given``: this rank's memory is its node's
    --max-memory-gb."""
    from hetseq.distributed import all_gather_object
    peers = all_gather_object({"memory": memory - activation, "activation": activation,
                               "given": bool(given)}, ctx)
    memories = [peer["memory"] for peer in peers]
    shares = choose(cfg, memories, size, ctx.distributed, all(p["given"] for p in peers))
    if ctx.rank == 0:
        activations = [peer["activation"] for peer in peers]
        reason = _reason(cfg, shares, ctx.distributed) if not any(activations) else (
            "ranks' memories " + ", ".join(in_gb(m + a) for m, a in zip(memories, activations))
            + " GB less their activations at their micro-batches, "
            + ", ".join(in_gb(a) for a in activations) + " GB")
        logger.info("state shares %s (%s): %s", "by memory" if shares.kind == "memory"
                    else "even", reason, ", ".join(_percent(f) for f in shares.fractions))
    return shares


# ---- the arithmetic and its refusals ----

def _spread(memories):
    smallest = min(memories)
    return max(memories) / smallest if smallest > 0 else float("inf")


def _by_memory(memories, size):
    """Shares proportional to each rank's memory beyond the whole part: with
    them every rank fills the same fraction of what it has left."""
    room = [max(0.0, m - size.whole) for m in memories]
    total = sum(room)
    fractions = [r / total for r in room[:-1]]
    # The last takes the remainder, so the float shares sum to 1.
    return tuple(fractions + [max(0.0, 1.0 - sum(fractions))])


def _memory_fits(memories, size):
    """Whether --state-shares memory holds the state: every rank holds its
    whole part with room to spare, and together they hold the rest."""
    return all(m > size.whole for m in memories) and \
        sum(m - size.whole for m in memories) >= size.sharded


def _check_even(cfg, shares, size, shardable, given):
    world = len(shares.memories)
    need = size.whole + size.sharded / world
    for rank, memory in enumerate(shares.memories):
        if need <= memory:
            continue
        if not shardable:
            fix = (f"shard it (--zero {'1/2/3' if world > 1 else '3 --cpu-offload on a GPU'})"
                   if cfg.zero == 0 else "add ranks to shard it") + " or use a smaller model"
        elif _memory_fits(shares.memories, size):
            fractions = _by_memory(shares.memories, size)
            fix = ("--state-shares memory would fit (" +
                   ", ".join(_percent(f) for f in fractions) + ")")
        else:
            fix = "--state-shares memory would not fit either; " + _more(cfg)
        parts = ([f"{in_gb(size.whole)} GB whole"] if size.whole else []) + \
            ([f"1/{world} of {in_gb(size.sharded)} GB split"] if size.sharded else [])
        raise UserError(f"rank {rank} has {in_gb(memory)} GB for model state{_estimated(given)} "
                        f"and {'its even share' if shardable else 'the state'} under --zero "
                        f"{cfg.zero} needs {in_gb(need)} GB ({' + '.join(parts)}){_NO_ROOM}; {fix}")


def _check_memory(cfg, memories, size, given):
    for rank, memory in enumerate(memories):
        if memory <= size.whole:
            raise UserError(f"rank {rank} has {in_gb(memory)} GB for model state"
                            f"{_estimated(given)} and under --zero {cfg.zero} every rank "
                            f"holds {in_gb(size.whole)} GB whole whatever its share{_NO_ROOM} "
                            f"nor for a share of the {in_gb(size.sharded)} GB split; "
                            f"{_more(cfg, whole=True)}")
    room = sum(m - size.whole for m in memories)
    if room < size.sharded:
        # Shares by memory fill every rank to the same fraction: all overflow
        # alike, so the smallest names the problem.
        rank = min(range(len(memories)), key=lambda r: (memories[r], r))
        need = size.whole + (memories[rank] - size.whole) / room * size.sharded
        held = f" beyond the {in_gb(size.whole)} GB each holds whole" if size.whole else ""
        raise UserError(f"rank {rank} has {in_gb(memories[rank])} GB for model state"
                        f"{_estimated(given)} and its share by memory under --zero {cfg.zero} "
                        f"needs {in_gb(need)} GB{_NO_ROOM} (the ranks have {in_gb(room)} GB "
                        f"together{held} for the {in_gb(size.sharded)} GB split); {_more(cfg)}")


# Every refusal says it as the activations' budget does (capacity.slope_memory_cap).
_NO_ROOM = ": no memory left for activations"


def _more(cfg, whole=False):
    """What else makes the state fit. ``whole``: the part every rank holds
    whatever its share is too big, which more ranks do not shrink."""
    ways = ["raise --max-memory-gb where the memory is there"] + ([] if whole else ["add ranks"])
    if cfg.zero < 3:
        ways.append("shard more (--zero 3)")
    elif not cfg.cpu_offload and not whole:
        ways.append("keep it on the host (--cpu-offload, on GPUs)")
    ways += ["use a smaller model"] + (["leave this device out"] if whole else [])
    return ", ".join(ways[:-1]) + " or " + ways[-1]


def _reason(cfg, shares, distributed):
    if not distributed:
        return "one process: nothing to split"
    if cfg.zero == 0:
        return "--zero 0 splits nothing"
    memories = ", ".join(in_gb(m) for m in shares.memories)
    if cfg.state_shares != "auto":
        return f"--state-shares {cfg.state_shares}; ranks' memories {memories} GB"
    return (f"ranks' memories {memories} GB differ by "
            f"{'more than' if shares.kind == 'memory' else 'at most'} "
            f"{_percent(AUTO_SPREAD - 1)}")


def _estimated(given):
    return "" if given else " (estimated: give --max-memory-gb on each node to set it)"


def in_gb(nbytes):
    """``nbytes`` in GB (--max-memory-gb's unit), to 4 significant digits."""
    text = f"{nbytes / GB:.4g}"
    return text if "." in text or "e" in text else text + ".0"


def _percent(fraction):
    return f"{100 * fraction:.3g}%"
