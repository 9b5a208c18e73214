"""The Task API: what a user implements to train anything with HetSeq. A task
turns a split name into a dataset, builds the model and computes one batch's
``loss, sample_size, logs``: the SUM of the per-sample losses and the count
it covers, so the Controller's division by the global count gives the mean
loss's gradient exactly. docs/tasks.md gives the set-up order (defaults,
resolve_inputs, __init__) and an example."""

import torch
from torch.utils.data import default_collate

from hetseq.base.registry import Registry
from hetseq.update.zero import sharding


class Task:
    # This task's flags that may differ from node to node (every other flag
    # must agree across nodes: hetseq/distributed/identity.py).
    per_node_flags: frozenset[str] = frozenset()
    # Defaults of general flags for this task, by argparse dest (see above).
    defaults: dict = {}

    def __init__(self, args, inputs=None):
        self.args = args
        self.inputs = inputs

    @classmethod
    def resolve_inputs(cls, args):
        """Choose (and build once) what the task reads when the flags leave it
        open; log the choice. Runs once per node; must not modify ``args``."""
        return None

    @classmethod
    def save_name(cls, args):
        """The default --save-dir's name under checkpoints/ (the task's name; a
        task whose runs differ by a flag, as fine-tuning by its model, adds it)."""
        return args.task

    @classmethod
    def add_args(cls, parser):
        """Add task-specific flags to ``parser`` (an argparse group)."""

    def load_dataset(self, split):
        """Return a ``torch.utils.data.Dataset`` for ``split`` ("train", "valid", ...)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_dataset(split)")

    def build_model(self):
        """Return the ``torch.nn.Module`` to train."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def loss(self, model, sample):
        """Return ``(loss summed over the sample, sample_size, logging dict)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss(model, sample)")

    # ---- provided; override when a task needs something else ----

    def full_weights(self, model):
        """Context: ``{name: whole weight}`` of ``model`` (what ``loss`` is
        handed), in any ``--zero`` mode and state shares, like FSDP's
        ``summon_full_params``: a regulariser's or an EMA's weights. Writes
        to them are kept (each rank writes back its own shard: write the same
        on every rank). Under ``--zero 2/3`` it is a collective: every rank
        must enter it as often, and the model must not run inside it.
        Outside forward a sharded parameter is only this rank's shard
        (docs/tasks.md, 'Reading the weights in `loss`')."""
        return sharding.full_weights(model)

    def train_step(self, model, sample, backward=None):
        """Forward with ``loss``, then backward. The Controller has already put
        the model in training mode (``valid_step``: evaluation mode).

        ``backward`` comes from the Controller: call it instead of
        ``loss.backward()`` when overriding (it may scale the loss for mixed
        precision or zero it for a padding batch). Passing the stats too,
        ``backward(loss, sample_size, logs)``, lets the Controller start the
        stats all-reduce during backward; ``backward(loss)`` also works.
        """
        loss, sample_size, logs = self.loss(model, sample)
        if backward is None:
            loss.backward()
        else:
            backward(loss, sample_size, logs)
        return loss.detach(), sample_size, logs

    @torch.no_grad()
    def valid_step(self, model, sample):
        loss, sample_size, logs = self.loss(model, sample)
        return loss.detach(), sample_size, logs

    def collater(self, dataset):
        """The collate function for ``dataset``: its own ``collater`` if it has one."""
        return getattr(dataset, "collater", None) or default_collate

    def export_hf(self, model, folder):
        """Write ``model`` as a Hugging Face folder (``--export-hf``)."""
        raise NotImplementedError

    def reduce_metrics(self, totals):
        """Turn summed logs (over micro-batches and ranks) into reported metrics.

        ``totals`` always holds "loss" (summed) and "sample_size". The default
        reports the mean loss and, when the task logs "correct", the accuracy.
        """
        n = max(totals["sample_size"], 1e-12)
        metrics = {"loss": totals["loss"] / n}
        if "correct" in totals:
            metrics["accuracy"] = totals["correct"] / n
        return metrics


# The registry lives beside the base class, not in the package: a built-in
# task imports it from here, so the package importing its tasks imports
# nothing that imports it back.
TASKS = Registry("task", base=Task, hint="; tasks of your own load with --user-dir DIR")
register_task = TASKS.register
