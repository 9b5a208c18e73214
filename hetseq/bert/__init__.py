"""Everything BERT, in one place, so that the framework itself knows nothing
of it: the model and its heads, Hugging Face folders in and out, tokenizers,
pretraining and GLUE data, and the built-in demos. The tasks that train these
models are thin (tasks/bert_pretraining.py, tasks/glue.py); docs/bert.md.
Layer 11: imports base, keyed, checkpoints. Tests: tests/unit/bert/, tests/system/."""

from hetseq.bert.hf import export_hf, hetseq_to_hf, hf_to_hetseq, load_hf_weights, read_hf_config
from hetseq.bert.model import (BertConfig, BertForPreTraining, BertForSequenceClassification,
                               BertModel)

__all__ = ["BertConfig", "BertForPreTraining", "BertForSequenceClassification", "BertModel",
           "export_hf", "hf_to_hetseq", "hetseq_to_hf", "load_hf_weights", "read_hf_config"]
