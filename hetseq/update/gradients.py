"""Passes over a rank's gradients that the Controller's update makes
(controller.py has the math): scaling, the non-finite check, norms; all on
the gradients' device, read by the host only when asked."""

import torch


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
