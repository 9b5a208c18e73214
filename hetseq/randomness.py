"""Randomness that belongs to the sample, not to the rank.

Every random draw made for a sample while training (a dropout mask, an
augmentation) comes from a stream fixed by

    (--seed, epoch, the sample's index in its dataset, the call site)

so a sample gets the same draws whichever rank, micro-batch, padding,
capacity plan, resume or set of elastic members processes it: the update
stays the one of a single device, dropout included. torch's generators
cannot do this: they are one stream per process, so which samples a rank
holds would decide the masks they get.

How a draw is made (the same integer arithmetic on every device, so a CPU
node and a GPU node draw identical masks):

- the iterator gives each micro-batch its samples' *keys*, one 32-bit word
  per sample hashed from (seed, epoch, index) (``sample_keys``);
- a call site (a ``hetseq.nn.Dropout``'s module path, or the name a task
  passes, and how many times that site has drawn in this forward) is hashed
  into each key (``_site_keys``);
- each element of a sample's tensor has a *coordinate word*: the hash of its
  indices, dimension by dimension (``_coordinates``). It does not depend on
  the tensor's size, so padding a sequence to another length leaves the
  words of its real positions, and hence their draws, unchanged;
- the draw is ``mix(coordinate word ^ site key)``: 32 random bits per element,
  a counter-based generator (the role Philox plays in cuRAND), computed with
  about ten elementwise integer passes. On CPU that is faster than torch's
  own dropout, whose Mersenne Twister runs on one thread.

The mixing function is Wellons's ``lowbias32`` (two multiply-xorshift
rounds; full avalanche). Tensors hold int32 and wrap on overflow; shifts are
made logical with a mask. ``tests/test_randomness.py`` checks every step
against the same function on Python integers.

A task draws through this module inside ``Task.loss`` (``uniform``,
``generators``, ``dropout``) or with ``hetseq.nn.Dropout`` in its model. The
Controller opens ``using(keys)`` around each micro-batch's forward; outside
it (a model run by hand, evaluation) nothing is keyed and ``dropout`` is
torch's. A site draws once per call: a module called twice in a forward
draws twice, in call order. An activation-checkpointing recompute (inside
backward) is refused unless ``checkpoint_context`` replays the forward's
call counts.
"""

import contextlib
import dataclasses
import functools
import random
import zlib

import numpy as np
import torch
import torch.nn.functional as F

WORD = 1 << 32
GOLDEN = 0x9E3779B9            # added at every absorb, so that a zero word still mixes
MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
SHIFTS = (16, 15, 16)


# ---- the hash, on Python integers (the reference the tensors must equal) ----

def mix32(value):
    """lowbias32 of an unsigned 32-bit integer."""
    x = value % WORD
    for shift, multiplier in zip(SHIFTS, MULTIPLIERS + (None,)):
        x ^= x >> shift
        if multiplier is not None:
            x = (x * multiplier) % WORD
    return x


def absorb32(state, word):
    """The state after taking in one more 32-bit word."""
    return mix32(((state ^ (word % WORD)) + GOLDEN) % WORD)


def _signed(value):
    """An unsigned 32-bit value as the int32 a tensor holds."""
    value %= WORD
    return value - WORD if value >= 1 << 31 else value


# ---- the same on int32 tensors, in place ----

_MULTIPLIERS = tuple(_signed(m) for m in MULTIPLIERS)
_GOLDEN = _signed(GOLDEN)


def _mix_(x):
    """lowbias32 of every element of the int32 tensor ``x``, in place."""
    for shift, multiplier in zip(SHIFTS, _MULTIPLIERS + (None,)):
        # >> on int32 copies the sign bit; the mask makes the shift logical.
        x.bitwise_xor_(x.bitwise_right_shift(shift).bitwise_and_((1 << (32 - shift)) - 1))
        if multiplier is not None:
            x.mul_(multiplier)            # wraps modulo 2**32
    return x


def _absorb_(state, words):
    """``absorb32`` elementwise, in place on ``state`` (int32; ``words`` broadcast)."""
    state.bitwise_xor_(words).add_(_GOLDEN)
    return _mix_(state)


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
    keys = torch.full(low.shape, _signed(state), dtype=torch.int32)
    return _absorb_(_absorb_(keys, low), high)


def _site_word(site):
    return zlib.crc32(site.encode("utf-8"))


def _site_keys(keys, site, call):
    """The samples' keys for the ``call``-th draw of ``site`` in a forward."""
    return _absorb_(_absorb_(keys.clone(), _signed(_site_word(site))), _signed(call))


@functools.lru_cache(maxsize=32)
def _coordinates(shape, device):
    """int32 words for every element of a per-sample tensor of ``shape``,
    hashed dimension by dimension from its indices, never from the sizes:
    element (i, j) has the same word in a (4, 7) tensor and in a (9, 7) one."""
    words = torch.zeros((), dtype=torch.int32, device=device)
    for size in shape:
        index = torch.arange(size, dtype=torch.int32, device=device)
        words = _absorb_(words.unsqueeze(-1).expand(*words.shape, size).clone(), index)
    return words


def _bits(keys, site, call, shape, device):
    """32 random bits (int32) for each element of a [len(keys), *shape] tensor."""
    site_keys = _site_keys(keys.to(device), site, call)
    coordinates = _coordinates(tuple(shape), device)
    bits = coordinates.unsqueeze(0).bitwise_xor(
        site_keys.view((-1,) + (1,) * len(shape)))
    return _mix_(bits.add_(_GOLDEN))


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
        if not self.replaying and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                f"hetseq.randomness: '{site}' draws again during backward: activation "
                "checkpointing recomputes the forward, and a keyed draw counts its calls. "
                "Pass context_fn=hetseq.randomness.checkpoint_context to "
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
        raise RuntimeError(f"hetseq.randomness.{what} draws per sample and works inside a "
                           "training step only (Task.loss while the Controller trains); "
                           "check randomness.active() first")
    return draws


def _check_batch(tensor_batch, draws, what):
    if tensor_batch != len(draws.keys):
        raise ValueError(f"hetseq.randomness.{what}: the tensor's first dimension is "
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


@_eager
def uniform(site, shape, device=None):
    """Uniform floats in [0, 1) of shape [batch, *shape], row i drawn for the
    batch's sample i at ``site`` (a name unique in the task's forward)."""
    draws = _draws("uniform")
    bits = _bits(draws.keys, site, draws.next_call(site), shape, device or draws.keys.device)
    return bits.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float().mul_(2.0 ** -24)


@_eager
def generators(site):
    """One CPU ``torch.Generator`` per sample of the batch, seeded from its
    key at ``site``: for a task's own per-sample draws (``torch.randint(...,
    generator=g)``) when a tensor of uniforms does not fit."""
    draws = _draws("generators")
    seeds = _site_keys(draws.keys.cpu(), site, draws.next_call(site)).tolist()
    return [torch.Generator().manual_seed(seed % WORD) for seed in seeds]


def dropout(x, p, site, training=True):
    """Dropout of ``x`` ([batch, ...]) with the mask of each sample drawn
    from its own stream at ``site``; torch's dropout when nothing is keyed."""
    if not training or p == 0.0:
        return x
    if not active():
        return F.dropout(x, p, training=True)
    return _keyed_dropout(x, p, site)


@_eager
def _keyed_dropout(x, p, site):
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    threshold = round(p * WORD) - (1 << 31)
    if threshold >= 1 << 31:      # p within 2**-33 of 1: nothing is kept
        return x * 0.0
    draws = _draws("dropout")
    _check_batch(x.shape[0], draws, "dropout")
    bits = _bits(draws.keys, site, draws.next_call(site), x.shape[1:], x.device)
    keep = bits >= threshold     # kept with probability 1 - p, to 2**-32
    # x * keep / (1 - p) in one kernel that saves only the boolean mask for
    # backward: the op torch's own dropout backward uses.
    return torch.ops.aten.native_dropout_backward(x, keep, 1.0 / (1.0 - p))


def name_sites(model):
    """Give every module of ``model`` that draws per sample (it has a
    ``site`` attribute left None) its path in the model as its site: the
    same on every rank, since every rank builds the same model."""
    for name, module in model.named_modules():
        if hasattr(module, "site") and module.site is None:
            module.site = name or type(module).__name__
