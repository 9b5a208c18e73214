"""BERT pretraining data in the HDF5 format of NVIDIA's BERT recipe, read as is.
Start-up reads only each shard's shape, so the time to the first step does not
grow with the data set; a shard is decompressed whole when first needed and
kept, since its gzip chunks span many rows and random rows would decompress a
chunk each. docs/bert.md, "How shards are read".
"""

import collections
import os
import re

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from hetseq.base.errors import UserError

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
        "next_sentence_labels")
SUFFIXES = (".hdf5", ".h5", ".hdf")


def _natural(name):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_shards(folder, split, num_files=0):
    """Shards in ``folder`` whose name contains ``split`` (so 'train' matches
    NVIDIA's '..._training_0.hdf5'), in natural order; the first ``num_files``."""
    if not folder or not os.path.isdir(folder):
        raise UserError(f"--data {folder}: not a directory; pass the folder of HDF5 shards")
    shards = [name for name in os.listdir(folder) if name.endswith(SUFFIXES)]
    if not shards:
        raise UserError(f"--data {folder} holds no .hdf5 shards; create them with "
                        "preprocessing/create_pretraining_data.py")
    chosen = sorted((n for n in shards if split in n), key=_natural)
    if not chosen:
        raise UserError(f"--data {folder}: no shard name contains '{split}' (shards: "
                        f"{', '.join(sorted(shards)[:5])}{' ...' if len(shards) > 5 else ''}); "
                        "check --train-subset/--valid-subset")
    if num_files > 0:
        chosen = chosen[:num_files]
    return [os.path.join(folder, name) for name in chosen]


def _read(path, f, key, rows=()):
    """``f[key][rows]``; a corrupt chunk is named with the shard and the dataset
    (h5py alone says only 'filter returned failure during read')."""
    try:
        return f[key][rows]
    except OSError as err:
        raise UserError(f"{path}: dataset '{key}' cannot be read ({err}); the shard is corrupt: "
                        "copy or create it again") from None


def _shard_rows(path):
    """Rows in one shard, after checking its keys and shapes and reading the
    first chunk of every dataset (cheap; a corrupt chunk later in the shard is
    named when the shard is first read)."""
    try:
        with h5py.File(path, "r") as f:
            missing = [key for key in KEYS if key not in f]
            if missing:
                raise UserError(f"{path} lacks datasets {missing}; expected NVIDIA's BERT HDF5 "
                                f"keys {list(KEYS)}")
            shapes = {key: f[key].shape for key in KEYS}
            for key in KEYS:
                _read(path, f, key, slice(0, 1))
    except OSError as err:
        raise UserError(f"{path} is not a readable HDF5 file ({err})") from None
    rows = shapes["input_ids"][0]
    if any(shape[0] != rows for shape in shapes.values()) or len(shapes["input_ids"]) != 2:
        raise UserError(f"{path}: datasets disagree on the number of sequences: {shapes}")
    return rows, shapes


def _check_token_ids(path, arrays, vocab_size):
    """Token ids must index the vocab: an id past it fails deep in the embedding
    ('index out of range in self') without naming the shard."""
    for key in ("input_ids", "masked_lm_ids"):
        ids = arrays[key]
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
            raise UserError(f"{path}: dataset '{key}' holds token id {bad}, outside the vocab "
                            f"of {vocab_size} (ids 0..{vocab_size - 1}): the shard was made with "
                            "another vocab; pass the --dict and --config_file it was made with, "
                            "or create the shards again")


class BertH5Dataset(Dataset):
    """All shards of one split as one dataset. ``__getitem__`` returns the index;
    ``collater`` reads a whole batch at once (vectorised)."""

    def __init__(self, files, max_pred_length=None, cached_shards=2, vocab_size=None):
        self.files = list(files)
        self.vocab_size = vocab_size
        rows, shapes = zip(*(_shard_rows(path) for path in self.files))
        self.shard_sizes = list(rows)
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.seq_length = shapes[0]["input_ids"][1]
        self.max_pred = shapes[0]["masked_lm_positions"][1]
        if max_pred_length:
            self.max_pred = min(self.max_pred, max_pred_length)
        self.cached_shards = cached_shards
        self._cache = collections.OrderedDict()   # shard -> {key: array}, per process
        self._pid = None

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, index):
        return index

    def __getstate__(self):
        # Loaded shards stay with the process that loaded them.
        return {**self.__dict__, "_cache": collections.OrderedDict(), "_pid": None}

    def _shard(self, shard):
        if self._pid != os.getpid():
            self._cache, self._pid = collections.OrderedDict(), os.getpid()
        if shard in self._cache:
            self._cache.move_to_end(shard)
        else:
            path = self.files[shard]
            with h5py.File(path, "r") as f:
                arrays = {key: _read(path, f, key) for key in KEYS}
            if self.vocab_size:
                _check_token_ids(path, arrays, self.vocab_size)
            self._cache[shard] = arrays
            while len(self._cache) > self.cached_shards:
                self._cache.popitem(last=False)
        return self._cache[shard]

    def read(self, indices):
        """Rows ``indices`` (global) as a dict of int64 numpy arrays."""
        indices = np.asarray(indices, dtype=np.int64)
        shard_of = np.searchsorted(self.offsets, indices, side="right") - 1
        out = {}
        for shard in np.unique(shard_of):
            where = np.nonzero(shard_of == shard)[0]
            local = indices[where] - self.offsets[shard]
            arrays = self._shard(shard)
            for key in KEYS:
                rows = arrays[key][local]
                block = out.setdefault(key, np.zeros((len(indices),) + rows.shape[1:], np.int64))
                block[where] = rows
        return out

    def collater(self, indices):
        batch = self.read(indices)
        P = self.max_pred
        return {
            "input_ids": torch.from_numpy(batch["input_ids"]),
            "segment_ids": torch.from_numpy(batch["segment_ids"]),
            "input_mask": torch.from_numpy(batch["input_mask"]),
            "masked_lm_positions": torch.from_numpy(batch["masked_lm_positions"][:, :P]),
            "masked_lm_ids": torch.from_numpy(batch["masked_lm_ids"][:, :P]),
            "next_sentence_labels": torch.from_numpy(batch["next_sentence_labels"].reshape(-1)),
        }
