"""Optimizer registry: each entry builds a torch optimizer from the job's
OptimizerConfig, declared here with every optimizer's flags as its fields
(one declaration per flag: the parser is built from it).
Layer 6: imports base. Tests: tests/unit/optim/."""

import torch

from hetseq.base.errors import UserError
from hetseq.optim.lr_scheduler import (SCHEDULERS, LRScheduler, ScheduleConfig,
                                       register_lr_scheduler)
from hetseq.base.registry import Registry
from hetseq.base.sections import Section, flag, section


class OptimizerFactory:
    """Base for registry entries: ``build`` for the optimizer from the job's
    OptimizerConfig (below; its fields are the flags) and the first learning
    rate (the schedule owns --lr and sets the rate of every update)."""

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
        raise UserError("expected numbers separated by commas such as '(0.9, 0.999)', "
                        f"got '{text}'")


# HetSeq's "adam" was fairseq's Adam, which already decouples weight decay
# (Loshchilov & Hutter): that is torch's AdamW, so both names build it.
@register_optimizer("adamw", aliases=("adam",))
class AdamW(OptimizerFactory):
    @classmethod
    def build(cls, cfg, params, lr):
        params = list(params)
        betas = parse_float_tuple(cfg.adam_betas)
        if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):   # (nan fails too)
            raise UserError(f"--adam-betas {cfg.adam_betas}: expected two numbers from 0 up to "
                            "(not including) 1, e.g. '(0.9, 0.999)'")
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, fused=fused_for(params))


@register_optimizer("adadelta")
class Adadelta(OptimizerFactory):
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
    def build(cls, cfg, params, lr):
        if cfg.nesterov and cfg.momentum <= 0:
            raise UserError("--nesterov needs --momentum > 0")
        params = list(params)
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, fused=fused_for(params))


@section
class OptimizerConfig(Section):
    """The optimizer and every optimizer's settings (all the job's, whichever runs)."""
    optimizer: str = flag("adam", help=lambda: f"one of: {', '.join(OPTIMIZERS.names())} "
                                               "('adam' is AdamW, as in HetSeq/fairseq) "
                                               "(default: %(default)s)")
    weight_decay: float = flag(0.0, type=float, names=("--wd", "--dadelta_weight_decay"),
                               metavar="WD", help="weight decay (default: %(default)s)")
    adadelta_rho: float = flag(0.9, type=float, names=("--adadelta_rho",),
                               help="Adadelta rho (default: %(default)s)")
    adadelta_eps: float = flag(1e-6, type=float, names=("--adadelta_eps",),
                               help="Adadelta epsilon (default: %(default)s)")
    adam_betas: str = flag("(0.9, 0.999)", metavar="B",
                           help="betas for Adam, e.g. '(0.9, 0.999)' (default: %(default)s)")
    adam_eps: float = flag(1e-8, type=float, metavar="D",
                           help="epsilon for Adam (default: %(default)s)")
    momentum: float = flag(0.0, type=float, help="SGD momentum (default: 0)")
    nesterov: bool = flag(False, action="store_true", help="Nesterov momentum for SGD")


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


def build_optimizer(cfg, params, lr):
    """The optimizer of OptimizerConfig ``cfg`` over ``params``, at rate ``lr``."""
    return OPTIMIZERS.get(cfg.optimizer).build(cfg, params, lr)


def build_lr_scheduler(cfg, optimizer, max_update=0):
    """The schedule of ScheduleConfig ``cfg``; ``max_update``: the run's
    --max-update, its horizon until the run tells it more (``set_horizon``)."""
    return SCHEDULERS.get(cfg.lr_scheduler)(cfg, optimizer, max_update)


__all__ = ["OPTIMIZERS", "SCHEDULERS", "OptimizerConfig", "ScheduleConfig", "OptimizerFactory",
           "LRScheduler", "register_optimizer", "register_lr_scheduler", "build_optimizer",
           "build_lr_scheduler", "fused_for", "keep_own_kernels", "check_same_optimizer"]
