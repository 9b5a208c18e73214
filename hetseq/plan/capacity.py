"""Capacity planning: how many samples of each global batch every rank takes.
With equal batches every step waits for the slowest device; shares
proportional to the ranks' rates make them finish together. The global batch
never changes, so neither does the mathematics: any split gives the same
update. docs/capacity.md gives the modes (``--capacity``) and the memory cap.
"""

import dataclasses
import logging
import math

from hetseq.base.errors import UserError
from hetseq.base.sections import Section, flag, section
from hetseq.checkpoints.state import Count, Fields, ListOf, Number, StateMismatch
from hetseq.checkpoints.state import describe as described

logger = logging.getLogger(__name__)


# The split's flags: how the job splits (the job's), and what each node takes
# and may use (the node's own). Their fields are the flags (sections.py).

@section
class CapacityConfig(Section):
    """How the global batch is split between ranks."""
    capacity: str = flag("manual", metavar="MODE",
                         help="how the global batch is split: manual (each node's "
                              "--max-sentences), equal, auto (measured speed), or one weight "
                              "per rank such as 3,1,1 (default: manual)")
    global_batch_size: int | None = flag(None, type=int, metavar="B",
                                         help="samples per global batch (default: sum of the "
                                              "nodes' --max-sentences)")
    no_rebalance: bool = flag(False, action="store_true",
                              help="keep the auto plan fixed (no rebalancing while training)")


@section
class ShareConfig(Section):
    """This node's share of the work and its memory."""
    max_sentences: int | None = flag(None, type=int, names=("--batch-size",), metavar="N",
                                     help="samples per step on each rank of this node; the "
                                          "global batch is the sum over all ranks (nodes may "
                                          "pass different values; default: the task's)")
    max_sentences_valid: int | None = flag(None, type=int, metavar="N",
                                           help="validation batch per rank (default: "
                                                "--max-sentences)")
    capacity_weight: float | None = flag(None, type=float, metavar="W",
                                         help="this node's weight per rank (all nodes must pass "
                                              "it; instead of a --capacity list)")
    micro_batch_cap: int = flag(0, type=int, metavar="N",
                                help="largest micro-batch on this node's ranks; the rest of a "
                                     "share is accumulated locally (0: none; auto measures one)")
    max_memory_gb: float | None = flag(None, type=float, metavar="GB",
                                       help="memory each rank of this node may use (model state "
                                            "under the --zero mode, plus activations) when "
                                            "--capacity auto sizes micro-batches (default: CPU: "
                                            "available memory / ranks on the node; GPU: its "
                                            "memory)")

    @classmethod
    def from_args(cls, args):
        valid = args.max_sentences_valid
        return super().from_args(
            args, max_sentences_valid=args.max_sentences if valid is None else valid)


@dataclasses.dataclass
class Plan:
    batch_sizes: list        # b_i per rank; sums to the global batch
    micro_caps: list         # largest micro-batch per rank (0: no cap)
    rates: list              # samples/s per rank the plan was made from (0: unknown)
    # Ranks out of the gradient exchange (links.py; never rank 0): no samples
    sitting: list = dataclasses.field(default_factory=list)

    @property
    def global_batch(self):
        return sum(self.batch_sizes)

    def micro_batches(self, rank):
        cap = self.micro_caps[rank]
        return max(1, math.ceil(self.batch_sizes[rank] / cap)) if cap else 1

    def most_micro_batches(self, shares=None):
        """The most micro-batches any rank needs for ``shares`` (default: the
        plan's own): what every rank runs when each forward communicates."""
        shares = self.batch_sizes if shares is None else shares
        return max(-(-share // cap) if cap else 1 for share, cap in zip(shares, self.micro_caps))

    def state_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state):
        return cls(**state)

    @staticmethod
    def state_kind():
        """What a saved plan must be (hetseq/checkpoints/state.py): its fields only (they
        are the constructor's), one entry per rank in each list, a batch of
        at least one sample, sitting ranks among them. Its world may differ
        from this run's (Balance.load_state_dict then starts afresh)."""
        return SavedPlan()


class SavedPlan(Fields):
    """Plan.state_kind(): the fields, then how they agree with each other."""

    def __init__(self):
        super().__init__({"batch_sizes": ListOf(Count()), "micro_caps": ListOf(Count()),
                          "rates": ListOf(Number(low=0))}, {"sitting": ListOf(Count())})

    def check(self, value, path):
        super().check(value, path)
        ranks = len(value["batch_sizes"])
        if sum(value["batch_sizes"]) < 1:
            raise StateMismatch(f"{path}.batch_sizes", described(value["batch_sizes"]) +
                                " summing to 0", "a global batch of at least one sample")
        for key in ("micro_caps", "rates"):
            if len(value[key]) != ranks:
                raise StateMismatch(f"{path}.{key}", described(value[key]),
                                    f"one entry per rank of {path}.batch_sizes ({ranks})")
        for i, rank in enumerate(value.get("sitting", [])):
            Count(0, ranks - 1).check(rank, f"{path}.sitting.{i}")


def proportional(global_batch, weights, caps, rates=None, can_sit=False, fixed=False):
    """The plan with b_i proportional to ``weights`` (summing exactly to B).
    ``fixed``: the user's weights, where 0 (``--capacity 1,0``) keeps a rank
    out of the samples, and out of the exchange when ``can_sit`` (the --zero
    mode and exchange allow); a measured speed of 0 is a failure."""
    for rank, weight in enumerate(weights):
        if not math.isfinite(weight) or weight < 0 or (weight == 0 and (rank == 0 or not fixed)):
            raise UserError(f"rank {rank} has capacity {weight}: every rank needs a positive, "
                            "finite speed or weight (a weight of 0 leaves a rank other than 0 "
                            "without samples); a rank that measured 0 samples/s failed its "
                            "warm-up (check its device) or should leave the job")
    members = [rank for rank, weight in enumerate(weights) if weight > 0]
    if global_batch < len(members):
        raise UserError(f"global batch {global_batch} is smaller than the {len(members)} ranks; "
                        "raise --global-batch-size or --max-sentences")
    sitting = [rank for rank in range(len(weights)) if rank not in members] if can_sit else []
    return Plan(split_among(global_batch, weights, members), list(caps),
                list(rates or [0.0] * len(caps)), sitting)


def split_among(total, rates, members):
    """Every rank's share of ``total``: the fastest split among ``members``
    at their ``rates``, nothing for the others."""
    shares = [0] * len(rates)
    for rank, share in zip(members, fastest_split(total, [rates[i] for i in members])):
        shares[rank] = share
    return shares


def fastest_split(total, rates):
    """Whole-sample shares of ``total`` that finish soonest at these ``rates``:
    minimise max_i b_i / r_i. Each rank first gets the floor of its exact
    share; every leftover sample goes to the rank that would finish it first.
    (Largest-remainder rounding can hand the last sample to a slow rank: one
    sample more on a rank with 18 costs 5% of the whole update.)"""
    # The floors, 1e-9 below the exact share so that float rounding never
    # overshoots the total.
    sizes = [max(0, math.floor(total * r / sum(rates) - 1e-9)) for r in rates]
    for _ in range(total - sum(sizes)):
        rank = min(range(len(rates)), key=lambda i: ((sizes[i] + 1) / rates[i], i))
        sizes[rank] += 1
    return sizes


def parse_weights(text, world_size):
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise UserError(f"--capacity {text}: expected equal, manual, auto or one weight per "
                        "rank such as 3,1,1") from None
    if len(weights) != world_size:
        raise UserError(f"--capacity {text} gives {len(weights)} weights for {world_size} ranks")
    return weights


def describe(plan, devices, state=None):
    """One log line per rank: device, rate, memory cap, share and micro-batches;
    with ``state`` (per rank: (bytes of model state it holds, its share of
    the split state or None)), that state beside its batch."""
    lines = []
    for rank, device in enumerate(devices):
        rate = f"{plan.rates[rank]:.1f}/s" if plan.rates[rank] else "n/a"
        cap = plan.micro_caps[rank] or "none"
        held = ""
        if state is not None:
            nbytes, share = state[rank]
            held = f", state {readable_bytes(nbytes)}" + \
                (f" ({100 * share:.3g}%)" if share is not None else "")
        if rank in plan.sitting:
            lines.append(f"  rank {rank} {device}: rate {rate}, sits out (no samples, not in "
                         f"the gradient exchange){held}")
            continue
        lines.append(f"  rank {rank} {device}: rate {rate}, memory cap {cap}, batch "
                     f"{plan.batch_sizes[rank]} in {plan.micro_batches(rank)} "
                     f"micro-batch(es){held}")
    return "\n".join(lines)


def readable_bytes(nbytes):
    """``nbytes`` in B, KB, MB or GB (powers of 1024, as --max-memory-gb)."""
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


# ---- measuring a rank: speed and memory cap ----

def device_name(device):
    import socket

    import torch
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({socket.gethostname()} cuda:{device.index})"
    return f"cpu ({socket.gethostname()})"


def cuda_memory_cap(run_batch, start, limit):
    """Largest micro-batch <= ``limit`` that fits, by doubling then bisecting."""
    import torch
    fits, fails, size = 0, None, max(1, start)
    while fails is None and fits < limit:
        try:
            run_batch(min(size, limit))
            fits, size = min(size, limit), size * 2
        except torch.cuda.OutOfMemoryError:
            fails = size
        torch.cuda.empty_cache()
    while fails is not None and fails - fits > 1:
        middle = (fits + fails) // 2
        try:
            run_batch(middle)
            fits = middle
        except torch.cuda.OutOfMemoryError:
            fails = middle
        torch.cuda.empty_cache()
    if fits == 0:
        raise UserError("not even one sample fits in this GPU's memory; use a smaller model, "
                        "mixed precision, or leave this GPU out")
    return 0 if fails is None else max(1, int(fits * 0.9))   # margin for fragmentation


def saved_activation_bytes(run_batch):
    """``size -> bytes`` autograd saves for backward in ``run_batch(size)``:
    the activations, counted from the tensors themselves (on a CPU the
    resident-set size says little: freed memory stays with the process)."""
    import torch

    def measure(size):
        storages = {}

        def pack(tensor):
            base = tensor if tensor._base is None else tensor._base
            if base.is_leaf and base.requires_grad:
                return tensor         # a parameter (or a view of one): state, not activations
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run_batch(size)
        return sum(storages.values())
    return measure


def cuda_peak_bytes(run_batch, device):
    """``size -> `` peak bytes allocated on the GPU while running ``size``."""
    import torch

    def measure(size):
        torch.cuda.reset_peak_memory_stats(device)
        run_batch(size)
        return torch.cuda.max_memory_allocated(device)
    return measure


def slope_memory_cap(measure, probe, budget_bytes):
    """Micro-batch cap from how the memory of a micro-batch grows between two
    probe sizes (``measure(size)``: its bytes); ``budget_bytes``: what is left
    after the model state. Two calls, the same on every rank, so it also works
    when every forward communicates (FSDP)."""
    if budget_bytes <= 0:
        raise UserError(f"no memory left for activations: the model state this rank holds "
                        f"exceeds its memory by {-budget_bytes / 2**30:.3f} GB; raise "
                        "--max-memory-gb, shard it (--zero 1/2/3, --cpu-offload), or leave "
                        "this device out")
    small = measure(probe)
    per_sample = (measure(2 * probe) - small) / probe
    if per_sample <= 0:
        return 0          # no growth seen: memory does not limit this rank
    if budget_bytes <= per_sample:
        raise UserError(f"no memory left for activations: {budget_bytes / 2**30:.3f} GB after "
                        "the model state, and one sample needs "
                        f"{per_sample / 2**30:.3f} GB; raise --max-memory-gb, shard more "
                        "(--zero 3, --cpu-offload), or use --bf16")
    return max(1, int(budget_bytes / per_sample))


def available_memory_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
