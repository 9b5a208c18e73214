"""Optimizer registry. Each entry adds its flags and builds a torch optimizer."""

import torch

from hetseq.errors import UserError
from hetseq.optim.lr_scheduler import (SCHEDULERS, LRScheduler, add_shared_args,
                                       register_lr_scheduler)
from hetseq.registry import Registry


class OptimizerFactory:
    """Base for registry entries: ``add_args`` for flags, ``build`` for the
    optimizer from the job's OptimizerConfig (config.py; its fields are the
    flags) and the first learning rate (the schedule owns --lr and sets the
    rate of every update)."""

    @classmethod
    def add_args(cls, group):
        pass

    @classmethod
    def build(cls, cfg, params, lr):
        raise NotImplementedError

    @classmethod
    def state_slots(cls, cfg):
        """Tensors of a parameter's size the optimizer keeps per parameter (for
        memory planning before its state exists); 2 unless a factory says."""
        return 2


OPTIMIZERS = Registry("optimizer", base=OptimizerFactory)
register_optimizer = OPTIMIZERS.register

# Devices whose parameters are stepped by torch's fused kernels (one launch
# for every parameter instead of a dozen foreach passes: what a bare CUDA
# loop uses); elsewhere torch's default. The numbers agree to rounding; the
# agreement check keeps ranks on different devices together anyway.
FUSED_DEVICES = ("cuda",)


def fused_for(params):
    """``fused=`` for an optimizer of ``params`` (tensors or param groups):
    True where every one is on a fused device, None (torch's choice) otherwise."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return True if tensors and all(t.device.type in FUSED_DEVICES for t in tensors) else None


def parse_float_tuple(text):
    """'(0.9, 0.999)' (HetSeq's spelling) or '0.9,0.999' -> (0.9, 0.999); no eval."""
    stripped = text.strip().strip("()[]")
    try:
        return tuple(float(part) for part in stripped.split(",") if part.strip())
    except ValueError:
        raise UserError(f"expected numbers separated by commas such as '(0.9, 0.999)', got '{text}'")


# HetSeq's "adam" was fairseq's Adam, which already decouples weight decay
# (Loshchilov & Hutter): that is torch's AdamW, so both names build it.
@register_optimizer("adamw", aliases=("adam",))
class AdamW(OptimizerFactory):
    @classmethod
    def add_args(cls, group):
        group.add_argument("--adam-betas", default="(0.9, 0.999)", metavar="B",
                           help="betas for Adam, e.g. '(0.9, 0.999)' (default: %(default)s)")
        group.add_argument("--adam-eps", type=float, default=1e-8, metavar="D",
                           help="epsilon for Adam (default: %(default)s)")

    @classmethod
    def build(cls, cfg, params, lr):
        params = list(params)
        betas = parse_float_tuple(cfg.adam_betas)
        if len(betas) != 2:
            raise UserError(f"--adam-betas {cfg.adam_betas}: expected two numbers, e.g. '(0.9, 0.999)'")
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, fused=fused_for(params))


@register_optimizer("adadelta")
class Adadelta(OptimizerFactory):
    @classmethod
    def add_args(cls, group):
        group.add_argument("--adadelta-rho", "--adadelta_rho", type=float, default=0.9,
                           help="Adadelta rho (default: %(default)s)")
        group.add_argument("--adadelta-eps", "--adadelta_eps", type=float, default=1e-6,
                           help="Adadelta epsilon (default: %(default)s)")

    @classmethod
    def build(cls, cfg, params, lr):
        return torch.optim.Adadelta(params, lr=lr, rho=cfg.adadelta_rho,
                                    eps=cfg.adadelta_eps, weight_decay=cfg.weight_decay)


@register_optimizer("sgd")
class SGD(OptimizerFactory):
    @classmethod
    def state_slots(cls, cfg):
        return 1 if cfg.momentum > 0 else 0

    @classmethod
    def add_args(cls, group):
        group.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: 0)")
        group.add_argument("--nesterov", action="store_true", help="Nesterov momentum for SGD")

    @classmethod
    def build(cls, cfg, params, lr):
        if cfg.nesterov and cfg.momentum <= 0:
            raise UserError("--nesterov needs --momentum > 0")
        params = list(params)
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, fused=fused_for(params))


def keep_own_kernels(optimizer, kernels):
    """A loaded state brings the saver's kernel settings (a GPU rank's
    fused=True, a CPU rank's None): this rank keeps ``kernels``, the fused
    and foreach settings built for its own parameters, and a fused
    optimizer its step counts on their device, as float32 (torch moves them
    only when the saver was fused; ZeRO's loader puts them on the host)."""
    for inner in (optimizer, getattr(optimizer, "optim", None)):
        for group in getattr(inner, "param_groups", ()):
            for setting in ("fused", "foreach"):
                if setting in group:
                    group[setting] = kernels.get(setting)
            if not group.get("fused"):
                continue
            for param in group["params"]:
                state = inner.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(param.device, torch.float32)


# Settings torch fills in itself when an older state lacks them (__setstate__).
_OPTIONAL_SETTINGS = {"foreach", "maximize", "capturable", "differentiable", "fused",
                      "decoupled_weight_decay"}


def check_same_optimizer(saved, name, settings):
    """A state saved by another kind of optimizer loads without complaint and
    fails at the first step (Adam's state has no Adadelta 'rho'): refuse it
    here, before any rank trains, when the saved settings lack one this
    optimizer needs."""
    groups = (saved or {}).get("param_groups") or []
    missing = sorted(settings - _OPTIONAL_SETTINGS - set(groups[0])) if groups else []
    if missing:
        raise UserError(
            f"the checkpoint's optimizer state was saved by another optimizer than --optimizer "
            f"{name} (it has no {', '.join(repr(m) for m in missing)}): add --reset-optimizer to "
            "keep the model and start the optimizer afresh, pass --restore-file for another "
            "checkpoint, or a new --save-dir to start over")


def add_optimization_args(parser):
    """Flags of every registered optimizer and LR scheduler, so --help lists them all."""
    group = parser.add_argument_group("Optimizer")
    group.add_argument("--optimizer", default="adam",
                       help=f"one of: {', '.join(OPTIMIZERS.names())} ('adam' is AdamW, "
                            "as in HetSeq/fairseq) (default: %(default)s)")
    group.add_argument("--weight-decay", "--wd", "--dadelta_weight_decay", type=float,
                       default=0.0, metavar="WD", help="weight decay (default: %(default)s)")
    for _, factory in OPTIMIZERS.items():
        factory.add_args(group)
    group = parser.add_argument_group("Learning-rate schedule")
    group.add_argument("--lr-scheduler", "--lr_scheduler", default="polynomial_decay",
                       help=f"one of: {', '.join(SCHEDULERS.names())} (default: %(default)s)")
    add_shared_args(group)
    for _, scheduler in SCHEDULERS.items():
        scheduler.add_args(group)


def build_optimizer(cfg, params, lr):
    """The optimizer of OptimizerConfig ``cfg`` over ``params``, at rate ``lr``."""
    return OPTIMIZERS.get(cfg.optimizer).build(cfg, params, lr)


def build_lr_scheduler(cfg, optimizer, max_update=0):
    """The schedule of ScheduleConfig ``cfg``; ``max_update``: the run's
    --max-update, its horizon until the run tells it more (``set_horizon``)."""
    return SCHEDULERS.get(cfg.lr_scheduler)(cfg, optimizer, max_update)


__all__ = ["OPTIMIZERS", "SCHEDULERS", "OptimizerFactory", "LRScheduler", "register_optimizer",
           "register_lr_scheduler", "add_optimization_args", "build_optimizer", "build_lr_scheduler",
           "fused_for", "keep_own_kernels", "check_same_optimizer"]
