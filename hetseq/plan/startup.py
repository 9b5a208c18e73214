"""The first plan, measured at start-up: each rank times forward and backward
passes of the real model on its real device (``--capacity auto``), finds
how many samples fit its memory, and every rank agrees on the split that
capacity.py computes from them, counting the exchange (links.py).

Kept apart from capacity.py, the split's arithmetic, so links.py (which
plans with that arithmetic) and this module (which plans with links) do not
import each other.
"""

from hetseq.base.errors import UserError
from hetseq.plan import links as exchange_links
from hetseq.plan.capacity import (cuda_memory_cap, cuda_peak_bytes, device_name, parse_weights,
                                  proportional, saved_activation_bytes, slope_memory_cap)
from hetseq.plan.state_shares import in_gb, memory_bytes

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


def _global_batch(cfg, peers, members_change=False):
    sizes = [peer["max_sentences"] for peer in peers]
    total = sum(sizes) if None not in sizes else None
    batch = cfg.global_batch_size or total
    if members_change:
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
    return memory_bytes(shares, ctx, local_world_size) - controller.state_bytes(on_device=True)


def _check_state(peers):
    """Refuse, on every rank alike (from the gathered ``peers``), a job where
    some rank's own count of the model state it holds leaves its memory no
    room: caught here, before any probe or update, no rank is left waiting
    for one that stopped."""
    for rank, peer in enumerate(peers):
        if peer["held"] >= peer["memory"]:
            raise UserError(
                f"rank {rank} has {in_gb(peer['memory'])} GB of memory and holds "
                f"{in_gb(peer['held'])} GB of model state (parameters, gradients and "
                "optimizer state, counted from its tensors): no memory left for activations; "
                "raise --max-memory-gb, shard it (--zero 1/2/3, --state-shares memory, "
                "--cpu-offload), or leave this device out")


def _prober(controller, dataset, collate_fn):
    """``size -> seconds``: a forward and backward of ``size`` samples of the
    real model and task, making no update (``Controller.probe``)."""
    from hetseq.keyed.randomness import KeyedBatch, sample_keys

    def run(size):
        indices = [i % len(dataset) for i in range(size)]
        # Keyed as training batches are, so the probe times the same draws.
        return controller.probe(KeyedBatch(collate_fn([dataset[i] for i in indices]),
                                           sample_keys(0, 0, indices)))
    return run


def activation_bytes(controller, dataset, collate_fn, size):
    """Bytes autograd saves for backward in one micro-batch of ``size``
    samples: this rank's activations at its planned micro-batch. Every rank
    probes once (the forwards of --zero 2/3 communicate)."""
    return saved_activation_bytes(_prober(controller, dataset, collate_fn))(max(1, size))


def _measure(cfg, shares, ctx, controller, dataset, collate_fn, local_world_size):
    """This rank's (samples/s, micro-batch cap) on the real model and task:
    forward and backward passes that make no update (``Controller.probe``,
    which returns their compute seconds)."""
    run = _prober(controller, dataset, collate_fn)
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
              members_change=False):
    """Every rank's share of the global batch, agreed by all ranks: (plan,
    every rank's device, the links measured (links.py; None alone), every
    rank's bytes of model state as it counts them (``Controller.state_bytes``,
    host and device)). ``cfg``: the job's CapacityConfig; ``shares``: this
    node's ShareConfig. ``members_change``: the members change while B stays
    (--elastic), so each node's --max-sentences is its weight and the most it
    takes per forward. With ``auto`` the plan counts the exchange too: a rank
    that would slow the job sits out where the --zero mode and exchange allow.
    A rank whose state leaves no memory for activations ends every rank with
    the same UserError, before any probe."""
    from hetseq.distributed import all_gather_object
    # The ranks' own accounting, gathered before the probes: a refusal then
    # reaches every rank at once (a probe's forwards communicate under FSDP).
    held = all_gather_object({"memory": memory_bytes(shares, ctx, local_world_size),
                              "held": controller.state_bytes(on_device=True),
                              "state": controller.state_bytes()}, ctx)
    _check_state(held)
    rate, cap = 0.0, shares.micro_batch_cap
    if members_change and cfg.capacity == "manual" and shares.max_sentences:
        cap = min(cap, shares.max_sentences) if cap else shares.max_sentences
    if cfg.capacity == "auto":
        rate, cap = _measure(cfg, shares, ctx, controller, dataset, collate_fn, local_world_size)
    peers = all_gather_object({"max_sentences": shares.max_sentences,
                               "weight": shares.capacity_weight, "rate": rate, "cap": cap,
                               "device": device_name(ctx.device)}, ctx)
    batch, caps = _global_batch(cfg, peers, members_change), [peer["cap"] for peer in peers]
    rates = [peer["rate"] for peer in peers]
    plan = proportional(batch, _weights(cfg, peers), caps, rates, controller.can_sit_out(),
                        fixed=cfg.capacity != "auto")
    links = exchange_links.measure(ctx, controller.gradient_bytes())
    if cfg.capacity == "auto":
        plan = exchange_links.best_plan(batch, rates, caps, links, controller.can_sit_out(),
                                        controller.updates_per_exchange()).plan
    return plan, [peer["device"] for peer in peers], links, [peer["state"] for peer in held]
