"""The step of an update: the gradient, already summed, scaled to the
mean-loss gradient (the Controller computes the factor: controller.py's
math), clipped, checked for non-finite values and handed to the optimizer;
for a whole gradient on its device, or one whose shards are spread over
the ranks (--zero 2/3). UpdateConfig holds the flags of the step."""

import math

import torch

from hetseq.base.sections import Section, flag, section


@section
class UpdateConfig(Section):
    """What the Controller does with a summed gradient: the clip here, the
    count of non-finite updates it tolerates."""
    clip_norm: float = flag(25.0, type=float, metavar="NORM",
                            help="clip the gradient norm to this (0: off; the norm is then "
                                 "measured after the update, for updates that are logged or "
                                 "go to TensorBoard; default: %(default)s)")
    max_nan_updates: int = flag(10, type=int, metavar="N",
                                help="stop after N updates in a row with a non-finite loss or "
                                     "gradient (each is skipped; default: 10)")


class Stepper:
    """``fused``: the optimizer skips a non-finite step on the device itself;
    ``state_slots``: tensors of state it keeps per parameter; ``steps()``:
    the Controller's train_step count (a norm measured later must be of the
    gradient it was made for)."""

    def __init__(self, ctx, sharding, params, optimizer, fused, state_slots, steps):
        self.ctx, self.sharding, self.params, self.optimizer = ctx, sharding, params, optimizer
        self._fused, self._state_slots, self._steps = fused, state_slots, steps

    def __call__(self, grads, scale, clip, step):
        """(finite, the norm or a function measuring it) of the update made
        from ``grads`` times ``scale``, clipped to ``clip`` (0: not)."""
        if self.sharding.shards_grads:
            return self._sharded_step(grads, scale, clip)
        return self._step(grads, scale, clip, step)

    def _step(self, grads, scale, clip, step):
        """Scale (and clip) a whole gradient on its device and step unless it
        is non-finite: (finite, its norm or a function measuring it). The
        host reads one flag per update, after the step is queued when the
        optimizer is fused (it skips on the device, as under GradScaler),
        before it otherwise."""
        if clip > 0:
            # ||scale * g|| = scale * ||g||; the factor in float64, as the host would.
            norm = torch.nn.utils.get_total_norm(grads).double() * scale if grads else \
                torch.zeros((), dtype=torch.float64, device=self.ctx.device)
            found = norm.isfinite().logical_not().float().reshape(1)
            multiply(grads, (clip / (norm + 1e-6)).clamp(max=1.0) * scale)
            shown = read_later(norm)
        else:
            found = scale_and_check(grads, scale, self.ctx.device)
            shown = self._local_norm(step)
        # Once every parameter has its state (or the optimizer keeps none): a
        # fused SGD skipping its first step keeps an uninitialised momentum buffer.
        stateful = self._state_slots and len(self.optimizer.state) < len(self.params)
        if self._fused and not stateful:
            self.optimizer.found_inf = found.reshape(())
            self.optimizer.step()
            return not found.item(), shown
        if found.item():
            return False, shown
        self.optimizer.step()
        return True, shown

    def _sharded_step(self, grads, scale, clip):
        """_step for a gradient whose shards are spread over the ranks (the
        norm and flag come from one all-reduce, read before the step)."""
        norm, finite = self._sharded_norm_and_scale(grads, scale, clip)
        if clip > 0 and finite:   # the scaling and the clipping factor in one pass
            torch._foreach_mul_(grads, scale * min(1.0, clip / (norm + 1e-6)))
        if finite:
            self.optimizer.step()
        return finite, norm

    def _sharded_norm_and_scale(self, grads, scale, clip):
        """(norm, finite) of a gradient whose shards are spread over the ranks:
        one all-reduce of [sum of squares, overflow flag], whatever --clip-norm.
        Without clipping the gradients are scaled (and checked) first."""
        sum_sq = squares(grads, self.ctx.device)
        found = torch.zeros(1, device=self.ctx.device) if clip > 0 else \
            scale_and_check(grads, scale, self.ctx.device)
        summed = self.sharding.reduce(torch.cat([sum_sq, found.to(sum_sq)])).tolist()
        norm = math.sqrt(summed[0]) * scale
        return norm, math.isfinite(norm) and not summed[1]

    def _local_norm(self, step):
        """The norm of this rank's full (scaled) gradient, measured when asked."""
        def measure():
            if step != self._steps():
                return None
            grads = self.sharding.local_grads(self.params)
            return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        return measure


# Passes over a rank's gradients (the math is controller.py's): scaling, the
# non-finite check, norms; all on the gradients' device, read by the host
# only when asked.
def scale_and_check(grads, scale, device):
    """Multiply every gradient by ``scale``; returns a 1-element tensor, nonzero
    if any was NaN or inf. One fused pass: the kernel GradScaler unscales with.
    It takes the factor as a float32 tensor, which is exact for gradients of
    float32 and narrower (their products are float32 roundings anyway); a
    float64 gradient would be scaled 6e-8 off whenever W/N is no binary
    fraction (3/36), so those are scaled in float64 first and only checked."""
    found = torch.zeros(1, device=grads[0].device if grads else device)
    wide = [g for g in grads if g.dtype == torch.float64]
    narrow = [g for g in grads if g.dtype != torch.float64]
    if wide:
        torch._foreach_mul_(wide, scale)
    for group, factor in ((narrow, scale), (wide, 1.0)):
        if group:
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, found, torch.full((1,), factor, device=found.device))
    return found


def multiply(grads, factor):
    """``grads`` times a device scalar, in each gradient's dtype (the fast
    foreach kernel needs the scalar's dtype to match; rounded to it, the
    factor multiplies as a host float of float32 opmath would)."""
    for dtype in {g.dtype for g in grads}:
        group = [g for g in grads if g.dtype == dtype]
        torch._foreach_mul_(group, factor.to(dtype))


def read_later(value):
    """A device value the host reads only when asked (a log line's norm)."""
    return lambda: float(value)


def squares(grads, device):
    """Sum of the squares of ``grads`` (a float64 tensor of one element)."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).double().square().sum().to(total)
    return total
