"""BERT pretraining (masked LM + next sentence) on NVIDIA-format HDF5 shards,
or, without ``--data``, on the built-in demo corpus (hetseq/bert/demo.py).
Each sequence's loss averages its masked-LM loss over its own masked
positions, so the batch loss is a sum of per-sequence losses and the update
is exact whatever the split (docs/bert.md says how this differs from
NVIDIA's recipe)."""

import dataclasses
import logging
import os

import torch.nn.functional as F

from hetseq.bert import demo
from hetseq.bert.hf import export_hf, load_hf_weights
from hetseq.bert.model import BertConfig, BertForPreTraining
from hetseq.bert.pretraining_data import BertH5Dataset, find_shards
from hetseq.bert.tokenizer import WordPiece
from hetseq.base.errors import UserError
from hetseq.tasks.api import Task, register_task

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BertInputs:
    data: str
    config: str
    vocab: str | None = None

    @classmethod
    def from_flags(cls, args):
        if args.data is None or not args.config_file:
            raise UserError("--task bert needs --config_file (a bert_config.json) with --data; "
                            "without both it trains the built-in demo")
        return cls(args.data, args.config_file, args.dict)


@register_task("bert")
class BertTask(Task):
    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--dict", metavar="FILE",
                            help="WordPiece vocab.txt of the data (checked against the config)")
        parser.add_argument("--config_file", "--config-file", metavar="FILE",
                            help="BERT config JSON (Google/NVIDIA bert_config.json)")
        parser.add_argument("--max_pred_length", "--max-pred-length", type=int, default=512,
                            help="use at most this many masked positions per sequence")
        parser.add_argument("--num_file", "--num-file", type=int, default=0,
                            help="use only the first N shards of a split (0: all)")
        parser.add_argument("--load-hf-weights", "--transformers_state_dict", metavar="PATH",
                            help="start from Hugging Face BERT weights (a folder with "
                                 "model.safetensors or pytorch_model.bin, or the file)")

    # BERT's recipe (Adam, linear decay, 1% warm-up, clipping at 1) at a rate
    # that suits a batch of 32 per rank.
    defaults = {"max_sentences": 32, "optimizer": "adam", "lr": [1e-4], "warmup_ratio": 0.01,
                "lr_scheduler": "polynomial_decay", "total_num_update": 0, "weight_decay": 0.01,
                "clip_norm": 1.0, "max_epoch": 1, "keep_last_epochs": 0}

    @classmethod
    def resolve_inputs(cls, args):
        if args.data is not None:
            return BertInputs.from_flags(args)
        default = demo.pretraining_data()
        logger.info("no --data: pretraining on the built-in demo corpus %s (vocab %s, config %s)",
                    default.data, args.dict or default.vocab, args.config_file or default.config)
        return BertInputs(default.data, args.config_file or default.config,
                          args.dict or default.vocab)

    def __init__(self, args, inputs=None):
        super().__init__(args, inputs or BertInputs.from_flags(args))
        self.config = BertConfig.from_json(self.inputs.config)
        if self.inputs.vocab:
            check_vocab(self.inputs.vocab, self.config, self.inputs.config)

    def load_dataset(self, split):
        # NVIDIA's recipe names its held-out shards "test": "valid" falls back to them.
        name = split
        if split == "valid" and not any("valid" in f for f in _shard_names(self.inputs.data)):
            name = "test"
        return BertH5Dataset(find_shards(self.inputs.data, name, self.args.num_file),
                             self.args.max_pred_length, vocab_size=self.config.vocab_size)

    def build_model(self):
        model = BertForPreTraining(self.config)
        if self.args.load_hf_weights:
            load_hf_weights(model, self.args.load_hf_weights)
        return model

    def loss(self, model, sample):
        mlm_logits, nsp_logits = model(sample["input_ids"], sample["segment_ids"],
                                       sample["input_mask"], sample["masked_lm_positions"])
        target, valid = sample["masked_lm_ids"], sample["masked_lm_positions"] > 0
        token_loss = F.cross_entropy(mlm_logits.flatten(0, 1).float(), target.flatten(),
                                     reduction="none").view_as(target) * valid
        per_sequence = token_loss.sum(1) / valid.sum(1).clamp(min=1)
        labels = sample["next_sentence_labels"]
        nsp_loss = F.cross_entropy(nsp_logits.float(), labels, reduction="none")
        loss = (per_sequence + nsp_loss).sum()
        logs = {
            "mlm_loss_sum": token_loss.sum().detach(),
            "mlm_tokens": valid.sum(),
            "mlm_correct": ((mlm_logits.argmax(-1) == target) & valid).sum(),
            "nsp_loss_sum": nsp_loss.sum().detach(),
            "nsp_correct": (nsp_logits.argmax(-1) == labels).sum(),
        }
        return loss, labels.numel(), logs

    def export_hf(self, model, folder):
        # The vocab's casing is unknown here; BERT's vocab.txt default (lower case) applies.
        tokenizer = WordPiece.from_vocab(self.inputs.vocab) if self.inputs.vocab else None
        export_hf(model, folder, "BertForPreTraining", tokenizer)

    def reduce_metrics(self, totals):
        n, tokens = max(totals["sample_size"], 1e-12), max(totals["mlm_tokens"], 1e-12)
        return {"loss": totals["loss"] / n,
                "mlm_loss": totals["mlm_loss_sum"] / tokens,
                "mlm_accuracy": totals["mlm_correct"] / tokens,
                "nsp_loss": totals["nsp_loss_sum"] / n,
                "nsp_accuracy": totals["nsp_correct"] / n}


def _shard_names(folder):
    return os.listdir(folder) if folder and os.path.isdir(folder) else []


def check_vocab(path, config, config_path):
    try:
        with open(path, encoding="utf-8") as f:
            size = sum(1 for _ in f)
    except OSError as err:
        raise UserError(f"--dict {path}: cannot read it ({err.strerror})") from None
    # A config may round vocab_size up (NVIDIA pads 30522 to 30528); fewer is an error.
    if size > config.vocab_size:
        raise UserError(f"--dict {path} has {size} tokens but --config_file {config_path} says "
                        f"vocab_size {config.vocab_size}; use the vocab and config that belong "
                        "together")
