"""Capacity planning: how many samples of each global batch every rank takes.

With equal batches every step waits for the slowest device, so the job runs at
N x (slowest rate). Giving rank i a share b_i proportional to its rate r_i
makes all ranks finish together and the job runs at sum(r_i). The global
batch B = sum(b_i) never changes, so neither does the mathematics: any split
gives the same update (see controller.py).

Modes (``--capacity``): ``manual`` (each node's --max-sentences), ``equal``,
weights (``3,1,1`` per rank, or ``--capacity-weight`` per node) and ``auto``
(measured). A rank's micro-batch is capped by its memory (``micro_cap``); the
rest of its share is accumulated locally, without extra communication.
While training, ``rebalance.Rebalancer`` follows the per-rank compute times of
the stats all-reduce and recomputes an ``auto`` plan when a rank's speed
changes by more than the noise of its measurements.
"""

import dataclasses
import logging
import math

from hetseq.errors import UserError

logger = logging.getLogger(__name__)


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


def describe(plan, devices):
    """One log line per rank: device, rate, memory cap, share and micro-batches."""
    lines = []
    for rank, device in enumerate(devices):
        rate = f"{plan.rates[rank]:.1f}/s" if plan.rates[rank] else "n/a"
        cap = plan.micro_caps[rank] or "none"
        if rank in plan.sitting:
            lines.append(f"  rank {rank} {device}: rate {rate}, sits out (no samples, not in "
                         "the gradient exchange)")
            continue
        lines.append(f"  rank {rank} {device}: rate {rate}, memory cap {cap}, batch "
                     f"{plan.batch_sizes[rank]} in {plan.micro_batches(rank)} micro-batch(es)")
    return "\n".join(lines)


# ---- measuring a rank: speed and memory cap ----

def add_args(group):
    group.add_argument("--capacity", default="manual", metavar="MODE",
                       help="how the global batch is split: manual (each node's "
                            "--max-sentences), equal, auto (measured speed), or one weight "
                            "per rank such as 3,1,1 (default: manual)")
    group.add_argument("--capacity-weight", type=float, metavar="W",
                       help="this node's weight per rank (all nodes must pass it; "
                            "instead of a --capacity list)")
    group.add_argument("--global-batch-size", type=int, metavar="B",
                       help="samples per global batch (default: sum of the nodes' --max-sentences)")
    group.add_argument("--micro-batch-cap", type=int, default=0, metavar="N",
                       help="largest micro-batch on this node's ranks; the rest of a share is "
                            "accumulated locally (0: none; auto measures one)")
    group.add_argument("--max-memory-gb", type=float, metavar="GB",
                       help="memory each rank of this node may use (model state under the "
                            "--zero mode, plus activations) when --capacity auto sizes "
                            "micro-batches (default: CPU: available memory / ranks on the "
                            "node; GPU: its memory)")
    group.add_argument("--no-rebalance", action="store_true",
                       help="keep the auto plan fixed (no rebalancing while training)")


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


# ---- making the plan at start-up ----

RATE_PROBES = 3      # timed forward+backward passes for a rank's speed (their median)
# Untimed passes before them: a GPU's first calls choose kernels, allocate
# and raise its clocks (a probe after one warm-up once read 3x slow). At
# least the first number; then, where ranks may call apart (not FSDP), more
# until two in a row agree within SETTLED, up to the second number.
WARMUPS = (2, 8)
SETTLED = 0.1
# A device far slower than the others (a CPU beside GPUs) would take minutes per probe at
# its even share: SIZING single samples first, then probes of about PROBE_SECONDS.
SIZING, PROBE_SECONDS = 2, 2.0


def steady_rate(run, size, lockstep):
    """Samples/s of ``run(size)`` (which returns its seconds) once warm.
    ``lockstep``: every rank must call as often (FSDP's forwards
    communicate), so the warm-up is the fixed minimum."""
    sample = [run(1) for _ in range(SIZING)][-1]
    size = max(1, min(size, int(PROBE_SECONDS / max(sample, 1e-9))))
    times = [run(size) for _ in range(WARMUPS[0])]
    while not lockstep and len(times) < WARMUPS[1] and \
            abs(times[-1] - times[-2]) > SETTLED * min(times[-2:]):
        times.append(run(size))
    timed = sorted(run(size) for _ in range(RATE_PROBES))
    return size / timed[len(timed) // 2]


def _shares_manual(cfg, peers):
    shares = [peer["max_sentences"] for peer in peers]
    if None in shares:
        raise UserError("--capacity manual splits --global-batch-size by each rank's "
                        "--max-sentences, and ranks "
                        f"{[r for r, s in enumerate(shares) if s is None]} have none: give "
                        "--max-sentences on every node, or --capacity equal or auto")
    return shares


def _shares_equal(cfg, peers):
    return [1.0] * len(peers)


def _shares_auto(cfg, peers):
    return [peer["rate"] for peer in peers]


SHARES = {"manual": _shares_manual, "equal": _shares_equal, "auto": _shares_auto}


def _weights(cfg, peers):
    node_weights = [peer["weight"] for peer in peers]
    if any(w is not None for w in node_weights):
        if None in node_weights or cfg.capacity != "manual":
            raise UserError("--capacity-weight must be given on every node (ranks without it: "
                            f"{[r for r, w in enumerate(node_weights) if w is None]}) and not "
                            "together with another --capacity mode")
        return node_weights
    if cfg.capacity in SHARES:
        return SHARES[cfg.capacity](cfg, peers)
    return parse_weights(cfg.capacity, len(peers))


def _global_batch(cfg, peers, elastic=False):
    sizes = [peer["max_sentences"] for peer in peers]
    total = sum(sizes) if None not in sizes else None
    batch = cfg.global_batch_size or total
    if elastic:
        return batch
    if batch is None:
        raise UserError("set --global-batch-size, or --max-sentences on every node (the global "
                        "batch is then their sum)")
    if cfg.capacity == "manual" and total is not None and batch != total:
        raise UserError(f"--global-batch-size {batch} differs from the sum of the nodes' "
                        f"--max-sentences ({total}) with --capacity manual; drop one or pick "
                        "another --capacity mode")
    return batch


def _memory_budget(shares, ctx, controller, local_world_size):
    """Bytes this rank may use for activations: its memory minus the model
    state it holds under the --zero mode (parameters, gradients, optimizer)."""
    import torch
    if shares.max_memory_gb:
        total = shares.max_memory_gb * 2**30
    elif ctx.device.type == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory * 0.9
    else:
        total = available_memory_bytes() * 0.8 / local_world_size
    return total - controller.state_bytes(on_device=True)


def _measure(cfg, shares, ctx, controller, dataset, collate_fn, local_world_size):
    """This rank's (samples/s, micro-batch cap) on the real model and task:
    forward and backward passes that make no update (``Controller.probe``,
    which returns their compute seconds)."""
    from hetseq.randomness import KeyedBatch, sample_keys

    def run(size):
        indices = [i % len(dataset) for i in range(size)]
        # Keyed as training batches are, so the probe times the same draws.
        return controller.probe(KeyedBatch(collate_fn([dataset[i] for i in indices]),
                                           sample_keys(0, 0, indices)))
    # Profile at about the share this rank will get: per-step overheads make
    # a tiny probe batch under-estimate the rate.
    even_share = (cfg.global_batch_size or 8 * ctx.world_size) // ctx.world_size
    probe = max(1, shares.micro_batch_cap or shares.max_sentences or even_share)
    if ctx.device.type == "cuda" and not controller.lockstep:
        # Bisection until out of memory: exact, but ranks make different numbers
        # of calls, which only works when forwards do not communicate.
        cap = cuda_memory_cap(run, probe, cfg.global_batch_size or 4 * probe)
    else:
        if ctx.device.type == "cuda":
            # Kernels chosen and tuned first (every rank alike): the tuner's
            # one-off buffers are no activations.
            run(probe)
        measure = cuda_peak_bytes(run, ctx.device) if ctx.device.type == "cuda" \
            else saved_activation_bytes(run)
        cap = slope_memory_cap(measure, probe,
                               _memory_budget(shares, ctx, controller, local_world_size))
    if shares.micro_batch_cap:
        cap = min(cap, shares.micro_batch_cap) if cap else shares.micro_batch_cap
    micro = min(probe, cap) if cap else probe
    return steady_rate(run, micro, controller.lockstep), cap


def make_plan(cfg, shares, ctx, controller, dataset, collate_fn, local_world_size=1,
              elastic=False):
    """Every rank's share of the global batch, agreed by all ranks: (plan,
    every rank's device, the links measured (links.py; None alone)).
    ``cfg``: the job's CapacityConfig; ``shares``: this node's ShareConfig.
    ``elastic``: the members change while B stays (--elastic), so each node's
    --max-sentences is its weight and the most it takes per forward. With
    ``auto`` the plan counts the exchange too: a rank that would slow the
    job sits out where the --zero mode and exchange allow."""
    from hetseq.distributed import all_gather_object
    from hetseq.plan import links as exchange_links
    rate, cap = 0.0, shares.micro_batch_cap
    if elastic and cfg.capacity == "manual" and shares.max_sentences:
        cap = min(cap, shares.max_sentences) if cap else shares.max_sentences
    if cfg.capacity == "auto":
        rate, cap = _measure(cfg, shares, ctx, controller, dataset, collate_fn, local_world_size)
    peers = all_gather_object({"max_sentences": shares.max_sentences,
                               "weight": shares.capacity_weight, "rate": rate, "cap": cap,
                               "device": device_name(ctx.device)}, ctx)
    batch, caps = _global_batch(cfg, peers, elastic), [peer["cap"] for peer in peers]
    rates = [peer["rate"] for peer in peers]
    plan = proportional(batch, _weights(cfg, peers), caps, rates, controller.can_sit_out(),
                        fixed=cfg.capacity != "auto")
    links = exchange_links.measure(ctx, controller.gradient_bytes())
    if cfg.capacity == "auto":
        plan = exchange_links.best_plan(batch, rates, caps, links, controller.can_sit_out(),
                                        controller.updates_per_exchange()).plan
    return plan, [peer["device"] for peer in peers], links
