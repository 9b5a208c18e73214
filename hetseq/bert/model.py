"""BERT encoder with masked-LM and next-sentence heads (pretraining) or a
classification head (fine-tuning), from a Google/NVIDIA ``bert_config.json``
or a Hugging Face ``config.json``. Attention runs through ``hetseq.keyed.nn.attention``:
torch's fused attention, except while training with attention dropout under
HetSeq, where each sample's mask is drawn from its own stream
(hetseq/keyed/randomness.py): inside a flash-style kernel on CUDA, explicitly on CPU.

Parameter names follow Hugging Face's ``BertForPreTraining`` except that the
query/key/value projections are fused into one ``qkv`` matrix (one GEMM
instead of three); ``hf_to_hetseq`` maps a Hugging Face state dict by name.
"""

import dataclasses
import json

import torch
import torch.nn.functional as F
from torch import nn

from hetseq.base.errors import UserError
from hetseq.keyed.nn import Dropout, attention

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclasses.dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path, flag="--config_file"):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as err:
            raise UserError(f"{flag} {path}: cannot read it ({err.strerror}); pass a "
                            "BERT config such as bert_config.json") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{flag} {path} is not valid JSON ({err.msg}, line {err.lineno})")
        if not isinstance(raw, dict):
            raise UserError(f"{flag} {path}: expected a JSON object of BERT settings")
        return cls.from_dict(raw, f"{flag} {path}")

    @classmethod
    def from_dict(cls, raw, where):
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            config = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError:
            raise UserError(f"{where} has no 'vocab_size'; a BERT config needs at "
                            "least vocab_size (see bert_config.json of Google's BERT)") from None
        config.check(where)
        return config

    def check(self, path="config"):
        if self.hidden_size % self.num_attention_heads:
            raise UserError(f"{path}: hidden_size {self.hidden_size} is not a multiple of "
                            f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise UserError(f"{path}: hidden_act '{self.hidden_act}' is not one of "
                            f"{', '.join(sorted(ACTIVATIONS))}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{path}: {name} must be a positive integer, got "
                                f"{getattr(self, name)!r}")

    def to_json(self, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)


class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(x))


class DenseLayerNorm(nn.Module):
    """Projection, dropout, residual add and LayerNorm (HF's BertSelfOutput/BertOutput)."""

    def __init__(self, d_in, c):
        super().__init__()
        self.dense = nn.Linear(d_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout_prob)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.num_attention_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.probs_dropout = Dropout(c.attention_probs_dropout_prob)
        self.output = DenseLayerNorm(c.hidden_size, c)

    def forward(self, x, key_mask):
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        # A padded key's probability is 0 and a real position's draw does not
        # depend on the padded length: a sample's result does not depend on
        # what it was batched with.
        context = attention(q, k, v, key_mask, self.probs_dropout)
        return self.output(context.transpose(1, 2).reshape(B, L, H), x)


class Intermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseLayerNorm(c.intermediate_size, c)

    def forward(self, x, key_mask):
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x, key_mask):
        for layer in self.layer:
            x = layer(x, key_mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c)

    def forward(self, input_ids, token_type_ids, attention_mask):
        # Boolean mask, True where a key may be attended: [B, L].
        key_mask = attention_mask.bool()
        hidden = self.encoder(self.embeddings(input_ids, token_type_ids), key_mask)
        return hidden, self.pooler(hidden)


class MaskedLMHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.transform = nn.Module()
        self.transform.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.transform.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.act = ACTIVATIONS[c.hidden_act]
        self.word_embeddings = [word_embeddings]   # tied decoder; a list keeps it out of state_dict
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))

    def forward(self, hidden):
        x = self.transform.LayerNorm(self.act(self.transform.dense(hidden)))
        return F.linear(x, self.word_embeddings[0].weight, self.bias)


class BertHeads(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.predictions = MaskedLMHead(c, word_embeddings)
        self.seq_relationship = nn.Linear(c.hidden_size, 2)


def init_weights(module, std):
    """BERT's initialisation: normal(0, std) weights, zero biases and padding row."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        with torch.no_grad():
            module.weight[module.padding_idx].zero_()


class BertForPreTraining(nn.Module):
    """``forward`` returns masked-LM logits at ``masked_lm_positions`` only
    ([B, P, vocab]; all L positions would be much slower, docs/bert.md) and
    next-sentence logits ([B, 2])."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertHeads(config, self.bert.embeddings.word_embeddings)
        self.apply(lambda module: init_weights(module, config.initializer_range))

    def forward(self, input_ids, segment_ids, input_mask, masked_lm_positions):
        hidden, pooled = self.bert(input_ids, segment_ids, input_mask)
        index = masked_lm_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        mlm_logits = self.cls.predictions(torch.gather(hidden, 1, index))
        return mlm_logits, self.cls.seq_relationship(pooled)


class BertForSequenceClassification(nn.Module):
    """The pooled [CLS] vector, dropout, one linear layer: ``num_labels``
    logits (1 for regression, STS-B). Names as Hugging Face's model of the
    same name, so its weights load and export by the same mapping."""

    def __init__(self, config, num_labels):
        super().__init__()
        self.config = config
        self.num_labels = num_labels
        self.bert = BertModel(config)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.apply(lambda module: init_weights(module, config.initializer_range))

    def forward(self, input_ids, token_type_ids, attention_mask):
        _, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        return self.classifier(self.dropout(pooled))
