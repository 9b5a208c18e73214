"""Randomness that belongs to the sample, not to the rank, so that the update
stays one device's, dropout included: every draw made for a sample while
training comes from a stream fixed by (--seed, epoch, the sample's index,
the call site), the same integer arithmetic on every device. The Controller
opens ``using(keys)`` around each micro-batch's forward; outside it
``dropout`` is torch's. docs/design.md, 'Where randomness comes from';
docs/tasks.md says how a task draws.
"""

import contextlib
import dataclasses
import functools
import random
import zlib

import numpy as np
import torch
import torch.nn.functional as F

from hetseq.keyed import kernels
from hetseq.keyed.kernels import ops, philox
from hetseq.keyed.kernels.words import WORD, absorb32, absorb_, signed


def _words(values):
    """Non-negative integers (numpy) as two int32 word arrays: low and high."""
    values = np.asarray(values, dtype=np.int64)
    low = (values & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    high = (values >> 32).astype(np.uint32).view(np.int32)
    return torch.from_numpy(low.copy()), torch.from_numpy(high.copy())


def seed_generators(seed):
    """Seed Python's, numpy's and torch's own generators: the model's initial
    weights (the same on every rank) and a task's draws outside this module."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- keys ----

def sample_keys(seed, epoch, indices):
    """One int32 key per sample of ``indices`` (dataset indices) in ``epoch``."""
    state = 0
    for word in (seed % WORD, seed // WORD % WORD, epoch % WORD):
        state = absorb32(state, word)
    low, high = _words(indices)
    keys = torch.full(low.shape, signed(state), dtype=torch.int32)
    return absorb_(absorb_(keys, low), high)


# Each site's word, computed once: a compiled forward reads it from here
# (torch.compile cannot trace zlib), so name_sites fills it before compiling.
_SITE_WORDS: dict[str, int] = {}


def _site_word(site):
    word = _SITE_WORDS.get(site)
    if word is None:
        word = _SITE_WORDS[site] = zlib.crc32(site.encode("utf-8"))
    return word


def _site(site, call):
    """The second key word of the ``call``-th draw of ``site`` in a forward."""
    return philox.site_word(_site_word(site), call)


# ---- the keys of the forward under way ----

@dataclasses.dataclass
class KeyedBatch:
    """A micro-batch as the task collated it, with its samples' keys (in the
    batch's order): what the training iterator yields."""
    sample: object
    keys: torch.Tensor


class _Draws:
    """The keys of the forward under way and how often each site drew in it."""

    def __init__(self, keys, calls=None, replaying=False):
        self.keys = keys
        self.calls = dict(calls or {})
        self.replaying = replaying

    def next_call(self, site):
        # A draw inside backward is a recompute (activation checkpointing): it
        # must draw what the forward drew, which only checkpoint_context knows.
        # (A compiled forward counts its draws while it is traced; dynamo
        # replays the counts each run.)
        if not (self.replaying or torch.compiler.is_compiling()) and \
                torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                f"hetseq.keyed.randomness: '{site}' draws again during backward: activation "
                "checkpointing recomputes the forward, and a keyed draw counts its calls. "
                "Pass context_fn=hetseq.keyed.randomness.checkpoint_context to "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) so the "
                "recompute draws the forward's masks")
        call = self.calls.get(site, 0)
        self.calls[site] = call + 1
        return call


class _Current:
    # Process-wide, not per thread: autograd recomputes a checkpointed
    # forward on its own threads. One training forward runs at a time.
    draws = None


_current = _Current()


@contextlib.contextmanager
def using(keys):
    """Draws inside the block are keyed by ``keys`` (None: not keyed)."""
    previous = _current.draws
    _current.draws = None if keys is None else _Draws(keys)
    try:
        yield
    finally:
        _current.draws = previous


@contextlib.contextmanager
def _replaying(draws):
    previous = _current.draws
    _current.draws = draws
    try:
        yield
    finally:
        _current.draws = previous


def checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ...,
    use_reentrant=False, context_fn=checkpoint_context)``: the recompute in
    backward makes the draws the forward made (the same keys, each site's
    call count as it was when the checkpointed segment began)."""
    draws = _current.draws
    if draws is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _replaying(_Draws(draws.keys, draws.calls, replaying=True))


def active():
    """Whether draws are keyed here (inside the Controller's training forward)."""
    return _current.draws is not None


def _draws(what):
    draws = _current.draws
    if draws is None:
        raise RuntimeError(f"hetseq.keyed.randomness.{what} draws per sample and works inside a "
                           "training step only (Task.loss while the Controller trains); "
                           "check randomness.active() first")
    return draws


def _check_batch(tensor_batch, draws, what):
    if tensor_batch != len(draws.keys):
        raise ValueError(f"hetseq.keyed.randomness.{what}: the tensor's first dimension is "
                         f"{tensor_batch} but the batch has {len(draws.keys)} samples; the "
                         "first dimension must be the sample")


# ---- what tasks and models call ----

def _eager(fn):
    """``fn`` run outside any compiled graph (torch.compiler.disable): a
    draw advances Python-side call counts that a trace must not freeze.
    Applied only while something compiles, since importing torch._dynamo
    (which torch.compiler.disable does) is about a second of every rank's
    start-up, half of it."""
    twin = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not twin:
                twin.append(torch.compiler.disable(fn))
            return twin[0](*args, **kwargs)
        return fn(*args, **kwargs)
    return call


def uniform(site, shape, device=None):
    """Uniform floats in [0, 1) of shape [batch, *shape], row i drawn for the
    batch's sample i at ``site`` (a name unique in the task's forward)."""
    draws = _draws("uniform")
    keys = draws.keys.to(device or draws.keys.device)
    bits = ops.keyed_words(keys, _site(site, draws.next_call(site)), list(shape))
    return bits.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float().mul_(2.0 ** -24)


@_eager
def generators(site):
    """One CPU ``torch.Generator`` per sample of the batch, seeded from its
    key at ``site``: for a task's own per-sample draws (``torch.randint(...,
    generator=g)``) when a tensor of uniforms does not fit."""
    draws = _draws("generators")
    seeds = philox.seeds(draws.keys.cpu(), _site(site, draws.next_call(site)))
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def dropout(x, p, site, training=True):
    """Dropout of ``x`` ([batch, ...]) with the mask of each sample drawn
    from its own stream at ``site``; torch's dropout when nothing is keyed.
    An element is kept when its byte of the draw is at or above round(256 p)
    (philox.cut): p is drawn to 1/256, and kept values are scaled by the
    inverse of the keep probability drawn, so their expectation is x's."""
    if not training or p == 0.0:
        return x
    if not active():
        return F.dropout(x, p, training=True)
    kernels.cut(p)                  # a bad p is refused before any draw counts
    return kernels.dropout(x, _draw_of(x, site, "dropout"), p)


def attention(q, k, v, key_mask, p, site):
    """Scaled dot-product attention (q, k, v: [batch, heads, L, d]) whose
    probabilities' dropout is drawn per sample at ``site``, (head, query,
    key) each an element's coordinates: the same mask for a sample however
    it is batched or padded. ``key_mask``: [batch, L], True where a key may
    be attended (None: every key). Torch's fused attention and dropout when
    nothing is keyed. On CUDA one flash-style kernel (kernels/), elsewhere
    the explicit arithmetic, with the same masks."""
    if p == 0.0 or not active():
        return kernels.sdpa(q, k, v, key_mask, p)
    kernels.cut(p)
    return kernels.attention(q, k, v, key_mask, _draw_of(q, site, "attention"), p)


def _draw_of(x, site, what):
    """The draw of ``site`` for a tensor ``x`` of the batch (kernels.Draw)."""
    draws = _draws(what)
    _check_batch(x.shape[0], draws, what)
    return kernels.Draw(draws.keys.to(x.device), _site_word(site), draws.next_call(site))


def name_sites(model):
    """Give every module of ``model`` that draws per sample (it has a
    ``site`` attribute left None) its path in the model as its site: the
    same on every rank, since every rank builds the same model."""
    kernels.chosen()                # HETSEQ_KERNELS checked before the first forward
    for name, module in model.named_modules():
        if hasattr(module, "site") and module.site is None:
            module.site = name or type(module).__name__
        if getattr(module, "site", None):
            _site_word(module.site)
