"""Hugging Face BERT folders in and out: ``config.json``, weights
(``model.safetensors`` or ``pytorch_model.bin``) mapped by name onto our
models (``BertForPreTraining``, ``BertForSequenceClassification``), and the
same mapping backwards to export a folder ``transformers`` loads.

Handled differences: an optional ``bert.`` prefix (a bare ``BertModel``
checkpoint has none), TF-era ``gamma``/``beta`` LayerNorm names, separate
query/key/value matrices (fused here into ``qkv``), the tied MLM decoder and
buffers such as ``position_ids``. Missing and unexpected keys are reported.
"""

import dataclasses
import json
import logging
import os
import re

import torch

from hetseq.bert.model import BertConfig
from hetseq.base.errors import UserError

logger = logging.getLogger(__name__)

_QKV = re.compile(r"^(bert\.encoder\.layer\.\d+\.attention)\.self\."
                  r"(query|key|value)\.(weight|bias)$")
_DROPPED = ("position_ids", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def read_state_dict(path):
    """A state dict from a file or a Hugging Face model folder."""
    if os.path.isdir(path):
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.exists(os.path.join(path, name)):
                return read_state_dict(os.path.join(path, name))
        raise UserError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"reading {path} needs the safetensors package: "
                            "pip install safetensors") from None
        return load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"cannot read weights from {path}: {str(err).splitlines()[0][:200]}")


def _canonical(key):
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight")
    key = key.replace("LayerNorm.beta", "LayerNorm.bias")
    if not key.startswith(("bert.", "cls.", "classifier.")):
        key = "bert." + key
    return key


def hf_to_hetseq(state):
    """Map Hugging Face BERT names to ours; fuses q/k/v into qkv."""
    mapped, parts = {}, {}
    for key, value in state.items():
        key = _canonical(key)
        if key.endswith(_DROPPED):
            continue
        match = _QKV.match(key)
        if match:
            prefix, which, kind = match.groups()
            parts.setdefault((prefix, kind), {})[which] = value
        else:
            mapped[key] = value
    for (prefix, kind), qkv in parts.items():
        if set(qkv) != {"query", "key", "value"}:
            raise UserError(f"incomplete attention weights for {prefix} ({kind}): "
                            f"found only {sorted(qkv)}")
        mapped[f"{prefix}.qkv.{kind}"] = torch.cat([qkv["query"], qkv["key"], qkv["value"]])
    return mapped


def load_hf_weights(model, path):
    """Load weights into ``model``; returns (missing, unexpected) key lists."""
    mapped = hf_to_hetseq(read_state_dict(path))
    own = model.state_dict()
    for key, value in mapped.items():
        if key in own and own[key].shape != value.shape:
            raise UserError(f"{path}: {key} has shape {tuple(value.shape)} but the model built "
                            f"from its config expects {tuple(own[key].shape)}; use the config "
                            "that came with these weights")
    result = model.load_state_dict(mapped, strict=False)
    if result.missing_keys:
        logger.warning("weights from %s lack %d tensors (kept at initialization): %s", path,
                       len(result.missing_keys), ", ".join(result.missing_keys[:8]))
    if result.unexpected_keys:
        logger.warning("weights from %s have %d tensors the model does not use: %s", path,
                       len(result.unexpected_keys), ", ".join(result.unexpected_keys[:8]))
    logger.info("loaded %d tensors from %s", len(mapped) - len(result.unexpected_keys), path)
    return result.missing_keys, result.unexpected_keys


def read_hf_config(folder, flag="--load-hf-weights"):
    """(BertConfig, the raw dict) of a Hugging Face model folder; only BERT."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder) or not os.path.isfile(path):
        raise UserError(f"{flag} {folder}: expected a Hugging Face model folder with "
                        "config.json and model.safetensors (or pytorch_model.bin)")
    config = BertConfig.from_json(path, flag=f"{flag} folder's")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    model_type = raw.get("model_type", "bert")
    if model_type != "bert":
        raise UserError(f"{path}: model_type '{model_type}' is not BERT; {flag} takes BERT "
                        "models (model_type 'bert', e.g. bert-base-cased or MiniLM)")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{path}: position_embedding_type '{raw['position_embedding_type']}' "
                        "is not supported; HetSeq's BERT has absolute position embeddings")
    return config, raw


def hetseq_to_hf(state):
    """Our names back to Hugging Face's: ``qkv`` split into query/key/value.
    The tied MLM decoder is left out, as ``transformers`` itself saves it."""
    out = {}
    for key, value in state.items():
        if key.endswith(".qkv.weight") or key.endswith(".qkv.bias"):
            prefix, kind = key.rsplit(".qkv.", 1)
            for which, part in zip(("query", "key", "value"), value.chunk(3)):
                out[f"{prefix}.self.{which}.{kind}"] = part.contiguous()
        else:
            out[key] = value.contiguous()
    return out


def export_hf(model, folder, architecture, tokenizer=None, config_extra=None):
    """Write ``model`` as a Hugging Face folder: config.json, model.safetensors
    (pytorch_model.bin without safetensors) and the tokenizer files."""
    os.makedirs(folder, exist_ok=True)
    config = {**dataclasses.asdict(model.config), "model_type": "bert",
              "architectures": [architecture], "pad_token_id": 0,
              "position_embedding_type": "absolute", "torch_dtype": "float32",
              **(config_extra or {})}
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    state = hetseq_to_hf({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    try:
        from safetensors.torch import save_file
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    except ImportError:
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    if tokenizer is not None:
        tokenizer.save(folder, model.config.max_position_embeddings)
    logger.info("exported %s (%d tensors) to %s", architecture, len(state), folder)
