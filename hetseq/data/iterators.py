"""Global batches, cut per rank by capacity; resumable mid-epoch.

An epoch's global batches depend only on (seed, epoch, the dataset's size and
shard sizes, B), never on the world size or on how B is split, so a run's
mathematics does not depend on the machines that took part. Rank i takes a
contiguous slice of each, proportional to its share, with its samples' keys
(hetseq/keyed/randomness.py). docs/design.md, 'The route of one update', step 2.
"""

import numpy as np
import torch
from torch.utils.data import DataLoader

from hetseq.keyed.randomness import KeyedBatch, sample_keys
from hetseq.checkpoints.state import ANYTHING, Count, Fields


def split_sizes(total, weights):
    """Split ``total`` into non-negative ints proportional to ``weights``, summing to it.

    Largest-remainder rounding; ties go to the lower rank. When ``weights`` sum
    to ``total`` the result is ``weights`` itself.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"shares must be non-negative with a positive sum, got {weights.tolist()}")
    exact = total * weights / weights.sum()
    sizes = np.floor(exact).astype(np.int64)
    leftover = int(total - sizes.sum())
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[:leftover]] += 1
    return sizes.tolist()


class GlobalBatches:
    """The global batches of every epoch, and each rank's slice of them."""

    def __init__(self, dataset_size, global_batch_size, seed, shuffle=True, groups=None):
        if dataset_size <= 0:
            raise ValueError("the dataset is empty")
        if global_batch_size <= 0:
            raise ValueError(f"global batch size must be positive, got {global_batch_size}")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        # Sizes of contiguous groups (a sharded dataset's files), or None.
        self.groups = list(groups) if groups is not None and len(groups) > 1 else None
        if self.groups is not None and sum(self.groups) != dataset_size:
            raise ValueError(f"group sizes {self.groups} do not add up to {dataset_size}")

    @classmethod
    def for_dataset(cls, dataset, global_batch_size, seed, shuffle=True):
        """Batches of ``dataset``, grouped by its ``shard_sizes`` when it has them."""
        return cls(len(dataset), global_batch_size, seed, shuffle,
                   groups=getattr(dataset, "shard_sizes", None))

    def __len__(self):
        return -(-self.dataset_size // self.global_batch_size)

    def epoch(self, epoch, start=0):
        """The global batches of ``epoch`` from its sample ``start`` on: cut at
        start, start + B, ... (a run resumed with another B continues exactly
        where the permutation was left)."""
        order = self.order(epoch)
        B = self.global_batch_size
        return [order[at:at + B] for at in range(start, self.dataset_size, B)]

    def order(self, epoch):
        """The epoch's permutation; it depends on neither B nor the split."""
        if not self.shuffle:
            return np.arange(self.dataset_size)
        if self.groups is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
        else:
            order = self._grouped_order(np.random.default_rng([self.seed, epoch]))
        return order

    def _grouped_order(self, rng):
        """Shards in random order, rows shuffled within each shard (as NVIDIA's
        recipe reads its files): a reader then needs one shard in memory at a
        time instead of seeking across all of them for every batch."""
        starts = np.concatenate([[0], np.cumsum(self.groups)])
        return np.concatenate([starts[g] + rng.permutation(self.groups[g])
                               for g in rng.permutation(len(self.groups))])

    @staticmethod
    def local_bounds(length, shares, rank):
        """[start, end) of ``rank``'s slice of a global batch of ``length``."""
        sizes = split_sizes(length, shares)
        start = sum(sizes[:rank])
        return start, start + sizes[rank]


def micro_split(indices, cap):
    """``indices`` in ceil(n/cap) near-equal micro-batches (one when cap is 0)."""
    if not cap or len(indices) <= cap:
        return [indices] if len(indices) else []
    bounds = np.cumsum([0] + split_sizes(len(indices), [1] * -(-len(indices) // cap)))
    return [indices[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class _LocalSlices:
    """Lazy batch sampler: the micro-batches of this rank's slices of the given global batches."""

    def __init__(self, global_batches, local, cap):
        self.global_batches = global_batches
        self.local = local
        self.cap = cap

    def __iter__(self):
        for global_batch in self.global_batches:
            for micro in micro_split(self.local(global_batch), self.cap):
                yield micro.tolist()


class GlobalBatchIterator:
    """This rank's batches, step by step, with the state needed to resume.

    Each step yields a list: this rank's slice of the global batch cut into
    micro-batches (``KeyedBatch``: the collated samples and their keys) of
    at most ``micro_cap`` samples, or ``[None]`` when the
    slice is empty (padded with None to ``min_micro_batches``). ``shares``
    (one weight per rank) may change between steps
    (rebalancing); the data loader is then rebuilt from the current position.
    """

    def __init__(self, dataset, collate_fn, batches, shares, rank, num_workers=0, micro_cap=0,
                 min_micro_batches=1, pin_memory=False):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batches = batches
        self.shares = list(shares)
        self.rank = rank
        self.num_workers = num_workers
        # For a GPU rank: batches in page-locked memory, so that the
        # Controller's non-blocking copy runs while the host goes on.
        self.pin_memory = pin_memory
        self.micro_cap = micro_cap
        # Padding with None up to this many micro-batches per step, so that
        # every rank runs as many forwards as the others (needed when each
        # forward communicates, as under FSDP).
        self.min_micro_batches = min_micro_batches
        self.epoch = 1                 # the epoch next_epoch_itr() runs
        self.samples_in_epoch = 0      # samples of it already consumed (its next position)
        self._shares_changed = False
        self._dummy = None

    def __len__(self):
        return len(self.batches)

    @property
    def dataset_size(self):
        return self.batches.dataset_size

    def set_shuffle(self, shuffle):
        """Whether the epochs drawn from now on are shuffled (--curriculum)."""
        self.batches.shuffle = shuffle

    @property
    def remaining_steps(self):
        """Global batches left in the current epoch."""
        left = self.batches.dataset_size - self.samples_in_epoch
        return -(-left // self.batches.global_batch_size)

    def set_shares(self, shares, min_micro_batches=1):
        """Every rank's share from the next global batch on, and the
        micro-batches each must run per step (padding under FSDP)."""
        self.min_micro_batches = min_micro_batches
        if list(shares) != self.shares:
            self.shares = list(shares)
            self._shares_changed = True

    def dummy_batch(self):
        """A one-sample batch for steps where this rank has no samples (its
        draws are keyed too, so no rank ever draws from torch's generators)."""
        if self._dummy is None:
            self._dummy = KeyedBatch(self.collate_fn([self.dataset[0]]),
                                     sample_keys(self.batches.seed, 0, [0]))
        return self._dummy

    def next_epoch_itr(self):
        """Yield this rank's micro-batches ([None] if none) for each remaining step."""
        while self.samples_in_epoch < self.batches.dataset_size:
            self._shares_changed = False
            batches = self.batches.epoch(self.epoch, self.samples_in_epoch)
            local, cap = self._local_slicer(), self.micro_cap
            loaded = iter(self._loader(_LocalSlices(batches, local, cap)))
            for global_batch in batches:
                micro = [KeyedBatch(next(loaded), sample_keys(self.batches.seed, self.epoch, part))
                         for part in micro_split(local(global_batch), cap)]
                micro += [None] * (max(1, self.min_micro_batches) - len(micro))
                self.samples_in_epoch += len(global_batch)
                yield micro
                if self._shares_changed:
                    break
        self.epoch += 1
        self.samples_in_epoch = 0

    def _local_slicer(self):
        """global batch -> this rank's indices, for the current shares.
        Bounds depend only on the batch length, so they are computed once per length."""
        bounds = {}
        shares, rank = list(self.shares), self.rank

        def local(global_batch):
            n = len(global_batch)
            if n not in bounds:
                bounds[n] = GlobalBatches.local_bounds(n, shares, rank)
            return global_batch[bounds[n][0]:bounds[n][1]]
        return local

    def _loader(self, batch_sampler):
        # Its own generator: creating a loader must not draw from the global RNG,
        # or resuming mid-epoch (a new loader) would shift the dropout stream.
        generator = torch.Generator().manual_seed(self.batches.seed * 1_000_003 + self.epoch)
        return DataLoader(self.dataset, batch_sampler=batch_sampler, generator=generator,
                          collate_fn=self.collate_fn, num_workers=self.num_workers,
                          pin_memory=self.pin_memory)

    def state_dict(self):
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
                "global_batch_size": self.batches.global_batch_size}

    def state_kind(self):
        """What a checkpoint's data position must be here (hetseq/checkpoints/state.py):
        an epoch from 1, and the samples of it done, at most this dataset's
        (before HetSeq 0.2: global batches done)."""
        return Fields({"epoch": Count(1)},
                      {"samples_in_epoch": Count(0, self.batches.dataset_size),
                       "iterations_in_epoch": Count(), "global_batch_size": Count(1)},
                      extra=ANYTHING, one_of=("samples_in_epoch", "iterations_in_epoch"))

    def load_state_dict(self, state):
        """Continue at the saved sample, whatever the global batch is now.
        (Checkpoints before HetSeq 0.2 counted global batches of the same B.)"""
        self.epoch = state["epoch"]
        self.samples_in_epoch = state.get("samples_in_epoch")
        if self.samples_in_epoch is None:
            done = state["iterations_in_epoch"] * self.batches.global_batch_size
            self.samples_in_epoch = min(self.batches.dataset_size, done)


def move_to(sample, device):
    """Move every tensor in a (nested) dict/list/tuple to ``device``."""
    if torch.is_tensor(sample):
        return sample.to(device, non_blocking=True)
    if isinstance(sample, dict):
        return {key: move_to(value, device) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(move_to(value, device) for value in sample)
    return sample
