"""Every rank's random generators in a checkpoint: their state as plain data
and tensors (rng_state), what a checkpoint's "rng" must be (rng_kind,
checked before anything loads) and setting them on resume (set_rng_state).
"""

import random

import numpy as np
import torch

from hetseq.checkpoints.kinds import (ANYTHING, Choice, Count, Fields, Items, Kind, ListOf, Number,
                                      Optional, Tensor)


def rng_state():
    """This process's random generators, as plain data and tensors."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_kind():
    """What a checkpoint's "rng" must be (hetseq/checkpoints/kinds.py): per rank, the
    generators as rng_state() gives them here; random.setstate,
    numpy's set_state and torch.set_rng_state take nothing else."""
    word = Count(0, 2 ** 32 - 1)
    python = Items(Count(3, 3), Items(*[word] * 624, Count(0, 624)),
                   Optional(Number(finite=False)))
    numpy = Items(Choice("MT19937"), Tensor(shape=(624,), dtype=torch.int64), Count(0, 624),
                  Count(0, 1), Number(finite=False))
    return ListOf(Fields({"python": python, "numpy": numpy, "torch": _CpuGenerator()},
                         {"cuda": ListOf(_CudaGenerator())}, extra=ANYTHING))


class _CpuGenerator(Kind):
    """torch.get_rng_state()'s tensor, one a scratch generator takes:
    bytes of the right size may still be no mt19937 state (all zeros)."""

    def __init__(self):
        own = torch.get_rng_state()
        self.tensor = Tensor(shape=own.shape, dtype=own.dtype)
        self.expected = f"{self.tensor.expected}: a CPU generator's state"

    def check(self, value, path):
        self.tensor.check(value, path)
        try:
            torch.Generator().set_state(value)
        except RuntimeError:
            self.refuse(value, path, f"{self.expected} (torch.get_rng_state())")


class _CudaGenerator(Kind):
    """A CUDA generator's state: its seed and offset, 8 bytes each, the
    offset a multiple of 4 (as torch's generator takes it); on a host
    with a GPU, one a scratch generator takes."""

    expected = "a tensor of shape [16] (uint8): a CUDA generator's seed and offset"

    def check(self, value, path):
        Tensor(shape=(16,), dtype=torch.uint8).check(value, path)
        if int.from_bytes(bytes(value.tolist()[8:]), "little") % 4:
            self.refuse(value, path, f"{self.expected}, the offset a multiple of 4")
        if torch.cuda.is_available():
            try:
                torch.Generator(device="cuda").set_state(value)
            except RuntimeError:
                self.refuse(value, path)


def set_rng_state(state):
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # A host that sees fewer GPUs than the one that saved takes those it has.
        for device, cuda in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda, device)


def _tuples(value):
    # A checkpoint may hand back lists where random.setstate wants tuples.
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
