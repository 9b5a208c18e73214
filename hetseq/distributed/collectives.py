"""Small collectives of plain data that also work (as no-ops) in a single-process run.

What travels is ``torch.save`` bytes in a uint8 tensor, read back with
``torch.load(weights_only=True)``: PyTorch's restricted loader builds only
tensors, numbers, strings and containers of them, so a peer (or anyone who
got between the peers) cannot make this process run code, as unpickling
``all_gather_object``'s payload could; and only an archive of stored
records, as torch.save writes (safe_load.py), so that what a peer makes
this process allocate is bounded by the bytes it sends. Values are therefore plain data:
dicts, lists, tuples, numbers, strings, None and tensors.
"""

import io

import torch
import torch.distributed as dist

from hetseq.base import safe_load
from hetseq.base.errors import PeerLost, UserError

# The largest object a peer may announce: room for a whole checkpoint of the
# BERT models (broadcast_from carries an elastic member's state to the
# others), and a bound on what a buggy or hostile peer can make this
# process allocate.
MAX_OBJECT_BYTES = 8 << 30


def _encode(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(tensor, rank=None):
    """A peer's ``torch.save`` bytes as the object. Only an archive of
    stored records (safe_load.py): torch.load would inflate a compressed
    record past MAX_OBJECT_BYTES, which bounds the bytes sent."""
    try:
        return safe_load.load(tensor.cpu().numpy().tobytes())
    except safe_load.Unsafe as err:
        who = "a peer" if rank is None else f"rank {rank}"
        raise PeerLost(f"{who} sent an object that is not what torch.save writes ({err}): "
                       "a rank of another version, or corrupted traffic; restart the job with "
                       "the same HetSeq everywhere") from None


def wire_device(ctx):
    # NCCL moves only CUDA tensors; gloo works on CPU tensors.
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _checked(size, rank):
    """``size`` (a tensor) as an int, once it is a size this process may allocate."""
    size = int(size)
    if not 0 <= size <= MAX_OBJECT_BYTES:
        raise PeerLost(f"rank {rank} announced an object of {size} bytes, expected 0 to "
                       f"{MAX_OBJECT_BYTES} (MAX_OBJECT_BYTES): a rank of another version, or "
                       "corrupted traffic; restart the job with the same HetSeq everywhere")
    return size


def _padded(obj, ctx, group=None):
    """(this rank's obj as bytes padded to the longest rank's, every rank's length)."""
    device = wire_device(ctx)
    data = _encode(obj).to(device)
    world = ctx.world_size if group is None else dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device),
                    group=group)
    sizes = [_checked(size, rank) for rank, size in enumerate(sizes)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    return padded, sizes


def all_gather_object(obj, ctx, group=None):
    """[rank 0's obj, rank 1's obj, ...] on every rank (of ``group``, in its
    order, when given)."""
    if not ctx.distributed:
        return [obj]
    padded, sizes = _padded(obj, ctx, group)
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [_decode(chunk[:size], rank) for rank, (chunk, size) in enumerate(zip(out, sizes))]


def gather_to_main(obj, ctx):
    """[rank 0's obj, rank 1's obj, ...] on rank 0, None on the others."""
    if not ctx.distributed:
        return [obj]
    padded, sizes = _padded(obj, ctx)
    out = [torch.empty_like(padded) for _ in sizes] if ctx.is_main else None
    dist.gather(padded, out, dst=0)
    if not ctx.is_main:
        return None
    return [_decode(chunk[:size], rank) for rank, (chunk, size) in enumerate(zip(out, sizes))]


def broadcast_from(source, make, ctx, group=None):
    """``make()`` on rank ``source``, its result sent to every rank (of
    ``group``, when given: the source among them) (small objects, or one-off
    states such as a checkpoint being resumed). A UserError raised by
    ``make`` reaches every rank, or the others would wait."""
    if not ctx.distributed:
        return make()
    device = wire_device(ctx)
    data = None
    if ctx.rank == source:
        try:
            data = _encode(("ok", make()))
        except UserError as err:
            data = _encode(("error", str(err)))
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source, group=group)
    size = _checked(size, source)   # on every rank, the source too: all stop, or none
    data = data.to(device) if data is not None else \
        torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=source, group=group)
    status, value = _decode(data, source)
    if status == "error":
        raise UserError(value)
    return value


def broadcast_from_main(make, ctx):
    """``broadcast_from(0, make, ctx)``."""
    return broadcast_from(0, make, ctx)
