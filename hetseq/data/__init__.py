"""Data: global batches sharded by capacity, and dataset helpers."""

from hetseq.data.iterators import GlobalBatches, GlobalBatchIterator, split_sizes

__all__ = ["GlobalBatches", "GlobalBatchIterator", "split_sizes"]
