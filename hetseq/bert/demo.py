"""The built-in demos, made offline from the text that ships with Python
(``corpus.py``) and built once per machine:

- pretraining: a WordPiece vocab, a 4-layer BERT config and NVIDIA-format
  HDF5 shards (``python train.py --task bert``);
- fine-tuning: sentence pairs in MRPC's own TSV format, a paraphrase task
  as MRPC is: label 1 when the second sentence is the first reworded (a few
  words left out, two neighbours swapped), 0 when it is another sentence of
  the same text reworded alike, so that the topic and the edits give nothing
  away (``python train.py --task glue``).
"""

import csv
import dataclasses
import os
import random
import re

from hetseq.bert.corpus import cached, documents, paragraphs, write_python_docs_corpus
from hetseq.bert.model import BertConfig
from hetseq.bert.preprocess import Settings, create_pretraining_data

PRETRAINING = "bert-default-v2"
VOCAB_SIZE = 8192
SETTINGS = Settings(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=5, seed=12345,
                    test_fraction=0.03)
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
             max_position_embeddings=128)

PAIRS = "glue-demo-v5"
PAIR_SPLITS = (("train", 800), ("dev", 408), ("test", 400))   # MRPC's dev set has 408 pairs
MRPC_HEADER = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")
# Where `python train.py --task bert` saves (its --save-dir default).
PRETRAINING_SAVE_DIR = os.path.join("checkpoints", "bert")


@dataclasses.dataclass(frozen=True)
class PretrainingData:
    data: str
    vocab: str
    config: str


def pretraining_data():
    """Build (once) and return the default BERT data, vocab and config."""
    root = cached(PRETRAINING, _build_pretraining, "the default BERT corpus")
    return PretrainingData(os.path.join(root, "shards"), os.path.join(root, "shards", "vocab.txt"),
                           os.path.join(root, "bert_config.json"))


def _build_pretraining(root):
    corpus = os.path.join(root, "python_docs.txt")
    write_python_docs_corpus(corpus)
    vocab, _ = create_pretraining_data([corpus], os.path.join(root, "shards"),
                                       vocab_size=VOCAB_SIZE, settings=SETTINGS, prefix="pydocs",
                                       progress=False)
    with open(vocab, encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)
    BertConfig(vocab_size=vocab_size, **MODEL).to_json(os.path.join(root, "bert_config.json"))


# ---- fine-tuning demo ----

def sentence_pairs():
    """The folder of the MRPC-format demo pairs (train.tsv, dev.tsv, test.tsv)."""
    return cached(PAIRS, _build_pairs, "the demo sentence pairs (MRPC format)")


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _document_sentences(limit=3000):
    """Documents as lists of prose sentences of 5-24 words (MRPC's are about 22);
    those with at least 3."""
    out = []
    for text in documents():
        sentences = [s for p in paragraphs(text) for s in _SENTENCE.split(p)
                     if 5 <= len(s.split()) <= 24]
        if len(sentences) >= 3:
            out.append(sentences)
            if len(out) >= limit:
                break
    return out


def _build_pairs(root):
    docs = _document_sentences()
    rng = random.Random(20201024)
    rng.shuffle(docs)
    # Disjoint documents per split, so dev measures pairs never seen in training.
    cut1, cut2 = int(0.7 * len(docs)), int(0.85 * len(docs))
    parts = {"train": docs[:cut1], "dev": docs[cut1:cut2], "test": docs[cut2:]}
    next_id = 1
    for split, count in PAIR_SPLITS:
        pool = parts[split]
        with open(os.path.join(root, f"{split}.tsv"), "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\",
                                lineterminator="\n")
            writer.writerow(MRPC_HEADER if split != "test" else ("index",) + MRPC_HEADER[1:])
            for i in range(count):
                label, first, second = _pair(pool, rng, positive=i % 2 == 0)
                head = label if split != "test" else i
                writer.writerow((head, next_id, next_id + 1, first, second))
                next_id += 2


def _pair(pool, rng, positive):
    doc = rng.randrange(len(pool))
    first, other = rng.sample(range(len(pool[doc])), 2)
    second = pool[doc][first if positive else other]
    return int(positive), _clean(pool[doc][first]), _clean(_reword(second, rng))


def _reword(sentence, rng):
    """The sentence with about 15% of its words left out and two neighbours swapped."""
    words = sentence.split()
    drop = set(rng.sample(range(len(words)), max(1, round(0.15 * len(words)))))
    words = [w for i, w in enumerate(words) if i not in drop]
    if len(words) > 2:
        at = rng.randrange(len(words) - 1)
        words[at], words[at + 1] = words[at + 1], words[at]
    return " ".join(words)


def _clean(text):
    return " ".join(text.replace("\\", "/").split())
