"""Fewer bytes over slow links: the codecs of the outer exchange
(``--outer-dtype``, modes/local_steps.py) and PowerSGD for the synchronous
update (``--grad-compression powersgd``, modes/powersgd.py). A codec sums one
flat tensor over the ranks in as many bytes as it says (docs/slow-links.md,
'`--outer-dtype`', gives each codec's bytes and rounding).
"""

import torch
import torch.distributed as dist

from hetseq.base.registry import Registry

CODECS = Registry("outer dtype")
BLOCK = 256     # values per int8 scale


@CODECS.register("float32")
def _full(flat, group=None):
    dist.all_reduce(flat, group=group)
    return flat


@CODECS.register("bfloat16")
def _bfloat16(flat, group=None):
    # Half the bytes; about 3 significant digits per value and per partial sum.
    low = flat.to(torch.bfloat16)
    dist.all_reduce(low, group=group)
    return low.to(flat.dtype)


def quantize(values):
    """(int8 values, float32 scale per BLOCK) of ``values`` (length a multiple of BLOCK)."""
    blocks = values.float().view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(blocks / scales[:, None]).to(torch.int8).view(-1), scales


def dequantize(q, scales):
    return (q.view(-1, BLOCK).float() * scales[:, None]).view(-1)


@CODECS.register("int8")
def _int8(flat, group=None):
    # A quarter of the bytes, plus 1.6% for the scales (one float32 per BLOCK).
    # A ring all-reduce of n values moves 2 (W-1)/W n values per rank; this moves
    # as many int8s (an all-to-all of W partitions, then an all-gather of the
    # sums), so float32, bfloat16 and int8 move 4 : 2 : 1.06 bytes per value.
    # Each rank sums its partition of everyone's dequantized values in float32
    # and quantizes the sum once more: every value carries at most two roundings
    # of half a step of its block's scale, whatever the world size.
    world = dist.get_world_size(group)
    n = flat.numel()
    padded = torch.zeros(-(-n // (world * BLOCK)) * world * BLOCK, dtype=flat.dtype,
                         device=flat.device)
    padded[:n] = flat
    q, scales = quantize(padded)
    # Every rank receives its partition of every rank's values (a reduce-scatter by hand).
    q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
    dist.all_to_all_single(q_in, q, group=group)
    dist.all_to_all_single(scales_in, scales, group=group)
    part = dequantize(q_in, scales_in).view(world, -1).sum(dim=0)
    q_sum, scales_sum = quantize(part)
    q_all = [torch.empty_like(q_sum) for _ in range(world)]
    scales_all = [torch.empty_like(scales_sum) for _ in range(world)]
    dist.all_gather(q_all, q_sum, group=group)
    dist.all_gather(scales_all, scales_sum, group=group)
    flat.copy_(dequantize(torch.cat(q_all), torch.cat(scales_all))[:n])
    return flat


def powersgd_hook(cfg):
    """(state, hook) for DDP: PyTorch's PowerSGD with error feedback and warm
    start (``cfg``: the job's ExchangeConfig). Exact for uneven batches as it
    stands: each rank's gradient is the gradient of its SUM of sample losses
    (controller.py), so the compressed average is (an approximation of) G / W
    and the Controller's W / N makes it the mean over the global batch, each
    sample weighted once; compressing per-rank means would weight ranks equally.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
        start_powerSGD_iter=cfg.powersgd_start, min_compression_rate=cfg.powersgd_min_compression,
        use_error_feedback=True, warm_start=True, orthogonalization_epsilon=1e-12,
        random_seed=0)
    return state, powersgd.powerSGD_hook
