"""Everything BERT, in one place (the framework itself knows nothing of it):

    model.py             encoder, pretraining heads, sequence-classification head
    hf.py                Hugging Face folders in (config, weights) and out (export)
    tokenizer.py         WordPiece tokenizers from vocab.txt / tokenizer.json, and back
    pretraining_data.py  NVIDIA-format HDF5 shards
    preprocess.py        raw text -> WordPiece -> HDF5 shards
    glue.py              GLUE's TSV files and plain CSV/JSONL sentence pairs
    corpus.py, demo.py   the built-in demos, made from Python's own documentation

The tasks that train these models are thin: ``hetseq/tasks/bert_pretraining.py`` and
``hetseq/tasks/glue.py``.
"""

from hetseq.bert.hf import export_hf, hetseq_to_hf, hf_to_hetseq, load_hf_weights, read_hf_config
from hetseq.bert.model import (BertConfig, BertForPreTraining, BertForSequenceClassification,
                               BertModel)

__all__ = ["BertConfig", "BertForPreTraining", "BertForSequenceClassification", "BertModel",
           "export_hf", "hf_to_hetseq", "hetseq_to_hf", "load_hf_weights", "read_hf_config"]
