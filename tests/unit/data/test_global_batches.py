"""Global batches: independent of the split, every sample exactly once per epoch."""

import collections

import numpy as np
import pytest
import torch

from hetseq.data import GlobalBatches, GlobalBatchIterator, split_sizes
from hetseq.keyed.randomness import sample_keys


class Indices(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def collate(items):
    return list(items)


def flat(step):
    """A step's micro-batches joined (None when the rank had nothing)."""
    return None if step == [None] else sum((micro.sample for micro in step), [])


def run_epoch(size, batch, shares, seed=3, epoch=1, cap=0):
    """Each rank's per-step batches for one epoch (None where it had nothing)."""
    batches = GlobalBatches(size, batch, seed)
    per_rank = []
    for rank in range(len(shares)):
        it = GlobalBatchIterator(Indices(size), collate, batches, shares, rank, micro_cap=cap)
        it.epoch = epoch
        per_rank.append([flat(step) for step in it.next_epoch_itr()])
    return per_rank


def test_split_sizes_sum_exactly_and_follow_weights():
    assert split_sizes(32, [24, 8]) == [24, 8]
    assert split_sizes(4, [20, 8, 4]) == [3, 1, 0]
    assert sum(split_sizes(97, [3, 1, 1])) == 97
    assert split_sizes(10, [1, 1, 1]) == [4, 3, 3]
    with pytest.raises(ValueError):
        split_sizes(5, [0, 0])


@pytest.mark.parametrize("shares", [[32], [24, 8], [20, 8, 4], [1, 1, 30]])
def test_every_index_once_per_epoch_with_uneven_splits(shares):
    size = 103   # not a multiple of the global batch
    per_rank = run_epoch(size, sum(shares), shares)
    seen = collections.Counter(i for steps in per_rank for b in steps if b for i in b)
    assert sorted(seen) == list(range(size))
    assert set(seen.values()) == {1}
    assert len({len(steps) for steps in per_rank}) == 1   # all ranks take the same steps


def test_global_batches_do_not_depend_on_the_split():
    one = run_epoch(103, 32, [32])[0]
    for shares in ([24, 8], [20, 8, 4]):
        ranks = run_epoch(103, 32, shares)
        joined = [sum((steps[t] or [] for steps in ranks), []) for t in range(len(one))]
        assert joined == one


def test_empty_slice_yields_none():
    # 100 = 3 * 32 + 4: the last batch of 4 splits 3 + 1 + 0.
    last = [steps[-1] for steps in run_epoch(100, 32, [20, 8, 4])]
    assert [len(b) if b else 0 for b in last] == [3, 1, 0] and last[2] is None


def test_epochs_are_reshuffled_deterministically():
    a1, a2 = run_epoch(64, 16, [16], epoch=1)[0], run_epoch(64, 16, [16], epoch=2)[0]
    assert a1 != a2 and a1 == run_epoch(64, 16, [16], epoch=1)[0]


def test_shares_change_mid_epoch_keeps_coverage():
    size, shares = 200, [16, 16]
    batches = GlobalBatches(size, 32, seed=0)
    iters = [GlobalBatchIterator(Indices(size), collate, batches, shares, r) for r in range(2)]
    gens = [it.next_epoch_itr() for it in iters]
    seen = []
    for step in range(len(batches)):
        if step == 3:
            for it in iters:
                it.set_shares([24, 8])
        for g in gens:
            seen += flat(next(g)) or []
    assert sorted(seen) == list(range(size))


def test_resume_mid_epoch_continues_where_it_stopped():
    batches = GlobalBatches(100, 10, seed=1)
    it = GlobalBatchIterator(Indices(100), collate, batches, [10], 0)
    gen = it.next_epoch_itr()
    first = [flat(next(gen)) for _ in range(4)]
    state = it.state_dict()
    resumed = GlobalBatchIterator(Indices(100), collate, batches, [10], 0)
    resumed.load_state_dict(state)
    rest = [flat(step) for step in resumed.next_epoch_itr()]
    assert sorted(np.concatenate(first + rest).tolist()) == list(range(100))
    assert resumed.epoch == 2


def test_micro_batches_respect_the_cap_and_keep_order():
    batches = GlobalBatches(100, 32, seed=0)
    it = GlobalBatchIterator(Indices(100), collate, batches, [24, 8], 0, micro_cap=10)
    steps = list(it.next_epoch_itr())
    assert [len(m.sample) for m in steps[0]] == [8, 8, 8]    # 24 in three near-equal parts
    assert all(len(m.sample) <= 10 for step in steps for m in step if m)
    assert [flat(s) for s in steps] == run_epoch(100, 32, [24, 8], seed=0)[0]


def test_grouped_order_visits_one_shard_at_a_time():
    batches = GlobalBatches(60, 10, seed=0, groups=[20, 30, 10])
    order = np.concatenate(batches.epoch(1))
    assert sorted(order.tolist()) == list(range(60))
    shard = np.searchsorted([20, 50, 60], order, side="right")
    assert (np.diff(shard) != 0).sum() == 2                  # three runs, one per shard


def test_position_is_kept_in_samples_and_old_checkpoints_still_load():
    batches = GlobalBatches(100, 10, seed=1)
    it = GlobalBatchIterator(Indices(100), collate, batches, [10], 0)
    gen = it.next_epoch_itr()
    first = [flat(next(gen)) for _ in range(3)]
    assert it.state_dict() == {"epoch": 1, "samples_in_epoch": 30, "global_batch_size": 10}
    # Resumed with a global batch of 7: the epoch goes on from sample 30.
    other = GlobalBatchIterator(Indices(100), collate, GlobalBatches(100, 7, seed=1), [7], 0)
    other.load_state_dict(it.state_dict())
    assert other.remaining_steps == 10                     # ceil(70 / 7)
    rest = [flat(step) for step in other.next_epoch_itr()]
    assert sorted(np.concatenate(first + rest).tolist()) == list(range(100))
    # A checkpoint that counted global batches (same B) resumes where it was.
    old = GlobalBatchIterator(Indices(100), collate, batches, [10], 0)
    old.load_state_dict({"epoch": 1, "iterations_in_epoch": 3})
    assert old.samples_in_epoch == 30


@pytest.mark.parametrize("shares,cap", [([32], 0), ([24, 8], 5), ([20, 8, 4], 3)])
def test_each_micro_batch_carries_the_keys_of_its_own_samples(shares, cap):
    """A sample's key is made from (seed, epoch, its index) alone: whichever
    rank and micro-batch holds it (hetseq/keyed/randomness.py draws from it)."""
    batches = GlobalBatches(70, 32, seed=5)
    keys = {}
    for rank in range(len(shares)):
        it = GlobalBatchIterator(Indices(70), collate, batches, shares, rank, micro_cap=cap)
        it.epoch = 2
        for step in it.next_epoch_itr():
            for micro in step:
                if micro is not None:
                    assert len(micro.keys) == len(micro.sample)
                    keys.update(zip(micro.sample, micro.keys.tolist()))
    assert sorted(keys) == list(range(70))
    assert [keys[i] for i in range(70)] == sample_keys(5, 2, range(70)).tolist()
    assert sample_keys(5, 3, range(70)).tolist() != sample_keys(5, 2, range(70)).tolist()
