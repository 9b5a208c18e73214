"""The kernels keyed draws run in (hetseq/keyed/randomness.py chooses what to
draw; these draw it and apply it), on two paths that give the same bits for
every element (philox.py's draw): torch passes (CPUs, and the reference) or
Triton kernels (CUDA), chosen per device or by ``HETSEQ_KERNELS=torch|triton``.
docs/design.md, "Where randomness comes from"; docs/gpu.md, "Choosing the path".
"""

import dataclasses
import logging
import os

import torch
import torch.nn.functional as F

from hetseq.base.errors import UserError
from hetseq.keyed.kernels import ops, philox

logger = logging.getLogger(__name__)
PATHS = ("torch", "triton")
_checked: set[str] = set()    # HETSEQ_KERNELS values seen: checked once each
_triton: list[bool] = []        # whether Triton imports, once known
_capable: dict[int, bool] = {}       # CUDA device index -> whether auto takes the Triton path there
DTYPES = (torch.float16, torch.bfloat16, torch.float32)     # what the kernels compute in


def chosen():
    """What HETSEQ_KERNELS asks for: auto, torch or triton. Read at each call
    (a process forked from one that read it may run with another value)."""
    name = os.environ.get("HETSEQ_KERNELS", "auto")
    if name not in _checked:
        if name not in ("auto",) + PATHS:
            raise UserError(f"HETSEQ_KERNELS={name}: expected auto, torch or triton")
        # Triton is imported here, outside any compiled region (name_sites
        # calls this before the first forward), and only where it may run.
        wanted = name == "triton" or (name == "auto" and torch.cuda.is_available())
        if wanted and not _imports_triton() and name == "triton":
            raise UserError("HETSEQ_KERNELS=triton but Triton is not installed; pip install "
                            "triton, or leave HETSEQ_KERNELS out")
        if wanted and torch.cuda.is_available():
            # Ampere (sm_80) and newer: where the tiles were chosen, and bf16
            # products exist; older cards keep the torch path unless forced.
            _capable.update((i, torch.cuda.get_device_capability(i) >= (8, 0))
                            for i in range(torch.cuda.device_count()))
        _checked.add(name)
    return name


def _imports_triton():
    if not _triton:
        try:
            import triton  # noqa: F401
            _triton.append(True)
        except ImportError:
            _triton.append(False)
    return _triton[0]


def path(device):
    """The path keyed draws take for tensors on ``device``."""
    name = chosen()
    if name == "auto":
        fits = device.type == "cuda" and _imports_triton() and _capable.get(device.index or 0)
        return "triton" if fits else "torch"
    if name == "triton" and device.type != "cuda" and \
            os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("HETSEQ_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1 "
                        "(Triton's interpreter); on a CPU use the torch path")
    return name


@dataclasses.dataclass(frozen=True)
class Draw:
    """One draw of a site in a forward: the samples' keys (int32, on the
    tensors' device), the site's word and how many times it drew before in
    this forward. ``site`` is the draw's second key word (philox.site_word)."""
    keys: torch.Tensor
    word: int
    call: int

    @property
    def site(self):
        return philox.site_word(self.word, self.call)


def cut(p):
    """The byte an element's draw must reach to be kept with probability
    1 - p (p drawn to 1/256: philox.cut); None when nothing is kept."""
    value = philox.cut(p)
    return None if value >= philox.RESOLUTION else value


def dropout(x, draw, p):
    """``x`` ([batch, ...]) with sample i's mask drawn for ``draw``'s keys[i]."""
    byte = cut(p)
    if byte is None:
        return x * 0.0
    scale = philox.keep_scale(byte)
    if x.dim() >= 2 and x.dtype in DTYPES and path(x.device) == "triton":
        return ops.keyed_dropout(x, draw.keys, draw.site, byte, scale)
    return _torch_dropout(x, draw, byte, scale)


def _torch_dropout(x, draw, byte, scale):
    keep = ops.keep_mask(draw.keys, draw.site, byte, list(x.shape[1:]))
    # x * keep * scale in one kernel that saves only the boolean mask for
    # backward: the op torch's own dropout backward uses.
    return torch.ops.aten.native_dropout_backward(x, keep, scale)


def attention(q, k, v, key_mask, draw, p):
    """softmax(q k^T / sqrt(d), masked keys out) with its probabilities'
    dropout drawn per (sample, head, query, key) for ``draw``, times v.
    q, k, v: [batch, heads, L, d]; ``key_mask``: [batch, L] bool, True where
    a key may be attended (None: every key)."""
    _check_key_mask(key_mask, k)
    byte = cut(p)
    if byte is not None and _fits_the_kernel(q, k, v) and _kernel_path(q):
        return ops.keyed_attention(q, k, v, key_mask, draw.keys, draw.site, byte,
                                   philox.keep_scale(byte), q.shape[-1] ** -0.5)[0]
    return explicit_attention(q, k, v, key_mask, draw, p)


_noted: set[str] = set()      # what was said once about the path attention takes


def _kernel_path(q):
    """Whether attention of ``q``'s dtype takes the Triton kernels here.
    float32 does only when HETSEQ_KERNELS=triton: its IEEE products run on
    the FMA units and every tile spills (docs/gpu.md), so under auto it takes
    the explicit path, which is exact and keeps the L x L probabilities."""
    if path(q.device) != "triton":
        return False
    if q.dtype == torch.float32 and chosen() == "auto":
        if "float32" not in _noted:
            _noted.add("float32")
            logger.info("keyed attention in float32 takes the explicit path (exact, L x L "
                        "probabilities kept); the kernels run bf16 and fp16 (docs/gpu.md)")
        return False
    return True


def _fits_the_kernel(q, k, v):
    """Head dimensions up to 128 (its tiles), the same for v; one dtype the
    kernel computes in for q, k and v."""
    return q.shape[-1] <= 128 and v.shape[-1] == q.shape[-1] and \
        q.dtype == k.dtype == v.dtype and q.dtype in DTYPES


def _check_key_mask(key_mask, k):
    if key_mask is None:
        return
    if key_mask.dtype != torch.bool or key_mask.shape != (k.shape[0], k.shape[2]):
        raise ValueError(f"hetseq attention: key_mask must be a bool tensor [batch, L] = "
                         f"[{k.shape[0]}, {k.shape[2]}], True where a key may be attended; got "
                         f"{key_mask.dtype} {list(key_mask.shape)} (pass attention_mask.bool())")


def explicit_attention(q, k, v, key_mask, draw, p):
    """The torch path: SDPA's arithmetic with the probabilities as a tensor.
    A masked key's score is the lowest finite value, not -inf: a sample with
    no real token gets even weights instead of NaN (softmax of a row of -inf)."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1)
    byte = cut(p)
    if byte is None:
        return (probs * 0.0) @ v
    return _torch_dropout(probs, draw, byte, philox.keep_scale(byte)) @ v


def sdpa(q, k, v, key_mask, p=0.0):
    """torch's fused attention with the same mask convention (no keys)."""
    _check_key_mask(key_mask, k)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
