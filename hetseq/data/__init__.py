"""Data: global batches cut per rank by capacity, micro-batches, keyed samples.
Layer 7: imports keyed, checkpoints.
Tests: tests/unit/data/."""

from hetseq.data.iterators import GlobalBatches, GlobalBatchIterator, split_sizes

__all__ = ["GlobalBatches", "GlobalBatchIterator", "split_sizes"]
