"""What a part of a checkpoint must be, checked before anything loads.

A checkpoint file is data from outside the run (another machine, flipped
bits, or one made to harm): torch.load with weights_only builds only
containers, numbers, strings and tensors, but any may stand where another
is expected, and used to fail deep inside torch, on one rank. So each part
is checked against a kind below, declared by its writer (hetseq/checkpoints/state.py's
``Component(name, kind=...)``, or a component's ``state_kind()``); a
mismatch is one line naming the field (StateMismatch, exit 2).
"""

import math

import torch

from hetseq.base.errors import UserError


class StateMismatch(UserError):
    """A field of a checkpoint that is not what this run expects."""

    def __init__(self, path, found, expected, verb="is"):
        self.path, self.found, self.expected = path, found, expected
        super().__init__(f"{path or 'the state'} {verb} {found}, expected {expected}")


def describe(value):
    """A value in a few words, for a message (never its whole contents)."""
    if torch.is_tensor(value):
        return f"a tensor of shape {list(value.shape)} ({_dtype_name(value.dtype)})"
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, int) and abs(value) >= 10 ** 15:   # str() refuses past 4300 digits
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (int, float)):
        return f"the {type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


class Kind:
    """What a value must be. ``check(value, path)`` raises StateMismatch
    naming ``path``; ``expected`` says it in words."""

    expected = "anything"

    def check(self, value, path):
        pass

    def refuse(self, value, path, expected=None):
        raise StateMismatch(path, describe(value), expected or self.expected)


ANYTHING = Kind()


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Number(Kind):
    """An int or a float (never a bool); ``integer``: an int; ``low``: the
    least allowed (``strict``: values must exceed it); ``high``: the most;
    ``finite`` unless told (a running loss may be inf or NaN)."""

    def __init__(self, integer=False, low=None, high=None, strict=False, finite=True):
        self.integer, self.low, self.high, self.strict = integer, low, high, strict
        self.finite = finite and not integer
        words = "an int" if integer else "a number"
        if low is not None:
            words += f" {'>' if strict else '>='} {low}"
        if high is not None:
            words += f"{' and' if low is not None else ''} <= {high}"
        self.expected = words + (", finite" if self.finite else "")

    def check(self, value, path):
        if not (isinstance(value, int) if self.integer else _number(value)) \
                or isinstance(value, bool):
            self.refuse(value, path)
        # Past these every reader fails: a tensor or a float cannot hold it.
        if isinstance(value, int) and not -2 ** 63 <= value < 2 ** 63:
            self.refuse(value, path, f"{self.expected}, within 64 bits")
        if self.finite and not math.isfinite(value):
            self.refuse(value, path)
        if self.low is not None and not (value > self.low if self.strict else value >= self.low):
            self.refuse(value, path)
        if self.high is not None and not value <= self.high:
            self.refuse(value, path)


def Count(low=0, high=None):
    """An int of at least ``low`` (updates, samples, epochs)."""
    return Number(integer=True, low=low, high=high)


class OfType(Kind):
    """An instance of ``types`` (bool, str, None: ``type(None)``)."""

    def __init__(self, *types):
        self.types = types
        self.expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)

    def check(self, value, path):
        # bool is an int: an int where a bool is expected is refused, and the other way
        if not isinstance(value, self.types) or \
                (isinstance(value, bool) and bool not in self.types):
            self.refuse(value, path)


class Choice(Kind):
    """One of ``values`` (strings, numbers)."""

    def __init__(self, *values):
        self.values = values
        self.expected = " or ".join(repr(v) for v in values)

    def check(self, value, path):
        if type(value) not in {type(v) for v in self.values} or value not in self.values:
            self.refuse(value, path)


class Optional(Kind):
    """None, or ``kind``."""

    def __init__(self, kind):
        self.kind = kind
        self.expected = f"None or {kind.expected}"

    def check(self, value, path):
        if value is not None:
            self.kind.check(value, path)


class Tensor(Kind):
    """A tensor: of ``shape`` when given (else of ``dims`` dimensions when
    given), of ``dtype`` when given, else of the same family as ``like``
    (floating, integer, bool, complex: load_state_dict casts within one)."""

    def __init__(self, shape=None, dtype=None, like=None, dims=None, low=None):
        self.shape = None if shape is None else tuple(shape)
        self.dtype, self.like, self.low = dtype, like, low
        self.dims = len(self.shape) if self.shape is not None else dims
        words = "a tensor"
        if self.shape is not None:
            words += f" of shape {list(self.shape)}"
        elif dims is not None:
            words += f" of {dims} dimension(s)"
        if dtype is not None:
            words += f" ({_dtype_name(dtype)})"
        elif like is not None:
            words += f" ({_family(like)})"
        if low is not None:     # for small tensors: a step count
            words += f" of finite values >= {low}"
        self.expected = words

    def check(self, value, path):
        if not torch.is_tensor(value) or (self.dims is not None and value.dim() != self.dims) \
                or (self.shape is not None and tuple(value.shape) != self.shape) \
                or (self.dtype is not None and value.dtype != self.dtype) \
                or (self.like is not None and _family(value.dtype) != _family(self.like)):
            self.refuse(value, path)
        # torch.save keeps a layout and strides as they were: a sparse or
        # expanded (stride 0) tensor of the right shape fails in the step's
        # views (agreement's checksum), so only dense memory of its own is taken.
        if value.layout != torch.strided or _overlaps(value):
            self.refuse(value, path, f"{self.expected}, dense, no element stored twice "
                        f"(found: {str(value.layout).replace('torch.', '')}, strides "
                        f"{list(value.stride()) if value.layout == torch.strided else '-'})")
        if self.low is not None and not bool((value.isfinite() & (value >= self.low)).all()):
            self.refuse(value, path)


def _overlaps(tensor):
    """Whether two elements of a strided ``tensor`` may share memory: its
    dimensions by stride, each must step past all the smaller ones span."""
    span = 0
    if tensor.numel() == 0:
        return False
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _family(dtype):
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


class Either(Kind):
    """Any one of ``kinds``."""

    def __init__(self, *kinds):
        self.kinds = kinds
        self.expected = " or ".join(kind.expected for kind in kinds)

    def check(self, value, path):
        for kind in self.kinds:
            try:
                kind.check(value, path)
                return
            except StateMismatch:
                continue
        self.refuse(value, path)


class Fields(Kind):
    """A dict with string keys: ``required`` ({key: kind}) present,
    ``optional`` checked when present; other keys are refused unless
    ``extra`` (a kind for their values)."""

    def __init__(self, required=None, optional=None, extra=None, one_of=()):
        self.required, self.optional, self.extra = dict(required or {}), dict(optional or {}), extra
        self.one_of = tuple(one_of)     # optional keys of which one at least must be present
        self.expected = "a dict"

    def check(self, value, path):
        if not isinstance(value, dict):
            self.refuse(value, path)
        if self.one_of and not any(key in value for key in self.one_of):
            raise StateMismatch(_join(path, self.one_of[0]), "missing",
                                self.optional[self.one_of[0]].expected)
        for key, kind in self.required.items():
            if key not in value:
                raise StateMismatch(_join(path, key), "missing", kind.expected)
        for key, item in value.items():
            kind = self.required.get(key) or self.optional.get(key) \
                if isinstance(key, str) else None
            kind = kind or self.extra
            if kind is None:
                known = ", ".join(sorted([*self.required, *self.optional])) or "none"
                raise StateMismatch(_join(path, key), "a key this run does not know",
                                    f"one of: {known}")
            kind.check(item, _join(path, key))


class MapOf(Kind):
    """A dict whose keys are ``keys`` and values ``values``."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.expected = f"a dict of {values.expected}"

    def check(self, value, path):
        if not isinstance(value, dict):
            self.refuse(value, path)
        for key, item in value.items():
            self.keys.check(key, _join(path, f"<key {key!r}>"[:60]))
            self.values.check(item, _join(path, key))


class ListOf(Kind):
    """A list or tuple of ``item``; of ``length`` items when given."""

    def __init__(self, item, length=None):
        self.item, self.length = item, length
        self.expected = f"a list of {'' if length is None else f'{length} x '}{item.expected}"

    def check(self, value, path):
        if not isinstance(value, (list, tuple)) or \
                (self.length is not None and len(value) != self.length):
            self.refuse(value, path)
        for i, item in enumerate(value):
            self.item.check(item, _join(path, i))


class Items(Kind):
    """A list or tuple of exactly these kinds, in order."""

    def __init__(self, *kinds):
        self.kinds = kinds
        self.expected = f"a list of {len(kinds)}"

    def check(self, value, path):
        if not isinstance(value, (list, tuple)) or len(value) != len(self.kinds):
            self.refuse(value, path)
        for i, (item, kind) in enumerate(zip(value, self.kinds)):
            kind.check(item, _join(path, i))


def like(value):
    """The kind of ``value``, a part of this run's own state: the same
    structure, types and shapes, and no negative number where this run's
    is not negative (a count, a rate, a size). For parts whose sign and
    shape follow from the run (a schedule's epoch, an optimizer's settings)."""
    if torch.is_tensor(value):
        return Tensor(shape=value.shape, like=value.dtype)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return OfType(type(value))
    if _number(value):
        return Number(integer=isinstance(value, int), low=0 if value >= 0 else None)
    if isinstance(value, (list, tuple)):
        return Items(*(like(item) for item in value))
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return Fields({key: like(item) for key, item in value.items()})
    return ANYTHING


class ModelState(Kind):
    """A model's ``state_dict`` as this run's model has it: ``expected``
    {name: (shape, dtype), or None for an entry that is not a tensor}.
    Keys missing, keys it does not know and tensors of another shape are
    counted in one line with an example of each, as a checkpoint of another
    model shows many at once (and tests/system/test_bad_inputs.py reads them)."""

    expected = "the model this run builds"

    def __init__(self, expected):
        self.shapes = dict(expected)

    def check(self, value, path):
        if not isinstance(value, dict):
            self.refuse(value, path, "a dict of the model's tensors")
        missing = [k for k in self.shapes if k not in value]
        unexpected = [k for k in value if k not in self.shapes]
        for key, item in value.items():
            if key in self.shapes and self.shapes[key] is not None and not torch.is_tensor(item):
                spec = self.shapes[key]
                self.refuse(item, _join(path, key), Tensor(shape=spec[0], dtype=spec[1]).expected)
        sizes = [(k, list(value[k].shape), list(spec[0])) for k, spec in self.shapes.items()
                 if spec is not None and k in value and tuple(value[k].shape) != tuple(spec[0])]
        # Keys by their names in the model (docs/checkpoints.md quotes them so).
        parts = [f"{len(keys)} {label} key(s), e.g. {keys[0]}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        if sizes:
            name, saved, here = sizes[0]
            parts.append(f"{len(sizes)} tensor(s) of another shape, e.g. {name}: {saved} saved, "
                         f"{here} here")
        if parts:
            raise StateMismatch(path, "; ".join(parts), "the model this run builds (a checkpoint "
                                "of another model or task?)", verb="holds")
        for key, spec in self.shapes.items():
            if spec is not None:
                # Its own dtype: a mode may load another without casting (FSDP's
                # shards), and no HetSeq run saves a model in another.
                Tensor(shape=spec[0], dtype=spec[1]).check(value[key], _join(path, key))
