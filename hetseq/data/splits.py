"""A task's splits as one rank reads them: loaded, checked, cut into global batches."""

from hetseq.data.iterators import GlobalBatches, GlobalBatchIterator
from hetseq.distributed.collectives import all_gather_object
from hetseq.errors import UserError


class Splits:
    """``task``'s datasets for this rank (``ctx``), with the run's ``seed``,
    this node's ``num_workers`` and its ``--data`` (named in errors)."""

    def __init__(self, task, ctx, seed, num_workers, data=None):
        self.task, self.ctx, self.seed = task, ctx, seed
        self.num_workers, self.data = num_workers, data

    def load(self, split):
        """The task's dataset for ``split``, checked to be the same size on every rank."""
        dataset = self.task.load_dataset(split)
        sizes = all_gather_object(len(dataset), self.ctx)
        if len(set(sizes)) > 1 or not sizes[0]:
            raise UserError(f"split '{split}' of --data {self.data} is empty or differs "
                            f"between ranks (sizes {sizes}); every node needs the same data")
        return dataset

    def iterator(self, dataset, shares, shuffle, micro_cap=0, min_micro_batches=1):
        """Global batches of ``dataset`` (B = sum of ``shares``), this rank's
        slice of each in micro-batches of at most ``micro_cap`` samples."""
        batches = GlobalBatches.for_dataset(dataset, sum(shares), self.seed, shuffle)
        return GlobalBatchIterator(dataset, self.task.collater(dataset), batches, shares,
                                   self.ctx.rank, self.num_workers, micro_cap, min_micro_batches,
                                   pin_memory=self.ctx.device.type == "cuda")
