"""Models shipped with HetSeq."""

from hetseq.models.bert import BertConfig, BertForPreTraining, BertModel
from hetseq.models.hf_weights import hf_to_hetseq, load_hf_weights

__all__ = ["BertConfig", "BertForPreTraining", "BertModel", "hf_to_hetseq", "load_hf_weights"]
