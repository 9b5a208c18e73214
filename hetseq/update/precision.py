"""Mixed precision: ``--bf16`` (CPU and CUDA) and ``--fp16`` (CUDA, loss scaling).

Both keep fp32 master weights and optimizer state and run the forward under
``torch.autocast``; fp16 scales the loss and ``LossScaler`` below moves the
scale. Everything here is decided once, when the run is built, from the job's
PrecisionConfig: the update itself reads no flag (docs/memory-and-precision.md).
"""

import contextlib
import logging
import os

import torch

from hetseq.base.errors import TrainingFailed, UserError
from hetseq.base.sections import Section, flag, section

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tests run the fp16 code path on CPU (slow there, and not a training mode we offer).
CPU_FP16_FOR_TESTS = "HETSEQ_TEST_FP16_ON_CPU"


@section
class PrecisionConfig(Section):
    """Autocast, loss scaling and the dtype gradients are summed in."""
    bf16: bool = flag(False, action="store_true",
                      help="bfloat16 autocast, fp32 master weights (CPU with bf16 support, "
                           "or CUDA Ampere and newer; a node whose CPU only emulates it, "
                           "AVX2, says so: 12x slower than fp32 on the GLUE demo)")
    fp16: bool = flag(False, action="store_true",
                      help="float16 autocast with dynamic loss scaling, fp32 master weights "
                           "(CUDA only; on CPU use --bf16)")
    fp16_init_scale: float = flag(2 ** 7, type=float, metavar="S",
                                  help="initial loss scale (default: %(default)s)")
    fp16_scale_window: int | None = flag(None, type=int, metavar="N",
                                         help="updates without overflow before the scale "
                                              "doubles (default: 2**14 / world size / "
                                              "update-freq, as fairseq)")
    min_loss_scale: float = flag(1e-4, type=float, metavar="S",
                                 help="stop when the loss scale falls below this (default: "
                                      "%(default)s)")
    reduce_dtype: str = flag("float32", choices=sorted(DTYPES),
                             help="dtype in which gradients are summed across ranks (default: "
                                  "%(default)s)")


def check_args(args):
    if args.bf16 and args.fp16:
        raise UserError("--bf16 and --fp16 both given; pick one")
    cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not cuda and not os.environ.get(CPU_FP16_FOR_TESTS):
        raise UserError("--fp16 needs a CUDA device (float16 on CPU is slow and its loss "
                        "scaling buys nothing there); use --bf16 on CPU")
    if args.bf16 and cuda and not torch.cuda.is_bf16_supported():
        raise UserError(f"--bf16: {torch.cuda.get_device_name()} has no bfloat16 support; "
                        "use --fp16")
    if args.bf16 and not cuda and not cpu_has_bf16():
        # A warning, not an error: --bf16 is the job's and this node's CPU is
        # one of several; the others may have it.
        logger.warning("--bf16 on a CPU without bfloat16 instructions (%s): it is emulated, "
                       "12x slower than fp32 on the GLUE demo; the job is faster in fp32 "
                       "unless its other nodes gain more",
                       torch.backends.cpu.get_cpu_capability())
    if args.fp16_scale_window is not None and args.fp16_scale_window < 1:
        raise UserError(f"--fp16-scale-window {args.fp16_scale_window}: expected 1 or more")
    if args.fp16_init_scale <= 0:
        raise UserError(f"--fp16-init-scale {args.fp16_init_scale}: expected a positive scale")


def cpu_has_bf16():
    """Whether this CPU computes bfloat16 natively (oneDNN's test: AVX-512 or
    AMX); an AVX2 machine emulates it, many times slower than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):     # a build without oneDNN: no claim
        return True


def compute_dtype(cfg):
    """The autocast dtype of PrecisionConfig ``cfg`` (None: fp32)."""
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None


def describe(cfg):
    dtype = compute_dtype(cfg)
    text = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast, loss scaling",
            None: "fp32"}[dtype]
    return text + (f", gradients reduced in {cfg.reduce_dtype}"
                   if cfg.reduce_dtype != "float32" else "")


def autocast(cfg, device):
    """The context every forward runs in, made once: a context manager that
    can be entered again after each exit (not nested)."""
    dtype = compute_dtype(cfg)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def mixed_precision_policy(cfg):
    """FSDP2's policy: parameters gathered in the compute dtype, gradients
    reduced in --reduce-dtype; None in fp32 with fp32 reduction."""
    dtype = compute_dtype(cfg)
    if dtype is None and cfg.reduce_dtype == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[cfg.reduce_dtype])


def ddp_comm_hook(cfg):
    """A DDP hook that sums gradients in --reduce-dtype (then divides by the
    world size, as DDP's own reduction does), or None for float32. Torch's
    bf16 hook needs NCCL; this one runs on gloo too."""
    if cfg.reduce_dtype == "float32":
        return None
    dtype = DTYPES[cfg.reduce_dtype]

    def hook(state, bucket):   # DDP requires these parameter names
        import torch.distributed as dist
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(state))
        future = dist.all_reduce(compressed, group=state, async_op=True).get_future()

        def decompress(done):
            buffer.copy_(done.value()[0])
            return buffer
        return future.then(decompress)
    return hook


class LossScaler:
    """fairseq's dynamic loss scaler for --fp16: halve S on overflow, double
    it after a window of clean updates; ``state_dict`` for checkpoints."""

    def __init__(self, cfg, window_default):
        self.scale = float(cfg.fp16_init_scale)
        self.window = cfg.fp16_scale_window or max(1, int(window_default))
        self.min_scale = cfg.min_loss_scale
        self.clean_updates = 0

    def update(self, overflow):
        """After an update: ``overflow`` True means it was skipped."""
        if overflow:
            self.scale /= 2
            self.clean_updates = 0
            logger.info("gradient overflow: update skipped, loss scale now %g", self.scale)
            if self.scale < self.min_scale:
                raise TrainingFailed(
                    f"the fp16 loss scale fell below --min-loss-scale {self.min_scale}: the "
                    "loss or gradients overflow at any scale; lower --lr, set --clip-norm, "
                    "or train with --bf16")
            return
        self.clean_updates += 1
        if self.clean_updates % self.window == 0:
            self.scale *= 2

    def state_dict(self):
        return {"scale": self.scale, "clean_updates": self.clean_updates}

    def load_state_dict(self, state):
        self.scale, self.clean_updates = float(state["scale"]), int(state["clean_updates"])
