"""Small collectives that also work (as no-ops) in a single-process run."""

import torch.distributed as dist

from hetseq.errors import UserError


def all_gather_object(obj, ctx):
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_main(make, ctx):
    """``make()`` on rank 0, its result sent to every rank (pickled; small objects
    or one-off states such as a checkpoint being resumed)."""
    if not ctx.distributed:
        return make()
    box = [None]
    if ctx.is_main:
        try:
            box = [("ok", make())]
        except UserError as err:   # every rank must learn of it, or they would wait
            box = [("error", str(err))]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise UserError(value)
    return value
