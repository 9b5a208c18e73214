"""Load BERT weights saved by Hugging Face (``model.safetensors`` or
``pytorch_model.bin``) into ``BertForPreTraining`` by name mapping.

Handled differences: an optional ``bert.`` prefix (a bare ``BertModel``
checkpoint has none), TF-era ``gamma``/``beta`` LayerNorm names, separate
query/key/value matrices (fused here into ``qkv``), the tied MLM decoder and
buffers such as ``position_ids``. Missing and unexpected keys are reported.
"""

import logging
import os
import re

import torch

from hetseq.errors import UserError

logger = logging.getLogger(__name__)

_QKV = re.compile(r"^(bert\.encoder\.layer\.\d+\.attention)\.self\.(query|key|value)\.(weight|bias)$")
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
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if not key.startswith(("bert.", "cls.")):
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
                            f"from --config_file expects {tuple(own[key].shape)}; use the config "
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
