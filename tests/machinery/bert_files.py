"""Tiny BERT files for tests: a corpus of words, an NVIDIA-format shard
written by hand, GLUE task folders in each of their formats, and the
tiny model's sizes."""

import h5py
import numpy as np

from hetseq.bert.glue_data import SPECS

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be had it not but they have one all their new first two been its who after "
         "also more has other into time would when most over can only some these may").split()


def write_corpus(path, docs=60, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            for _ in range(rng.integers(3, 8)):
                words = rng.choice(WORDS, rng.integers(5, 15))
                f.write(" ".join(words).capitalize() + ".\n")
            f.write("\n")


def write_nvidia_shard(path, n, seq=24, preds=4, vocab=50, seed=0):
    """A shard as NVIDIA's recipe writes it: its own dtypes, gzip, default chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, seq + 1, n)
    ids = np.zeros((n, seq), np.int64)
    mask = np.zeros((n, seq), np.int64)
    for i, L in enumerate(lengths):
        ids[i, :L] = rng.integers(5, vocab, L)
        mask[i, :L] = 1
    positions = np.sort(rng.integers(1, 9, (n, preds)), 1)
    with h5py.File(path, "w") as f:
        for key, data, dtype in (("input_ids", ids, "i4"), ("input_mask", mask, "i1"),
                                 ("segment_ids", mask * (np.arange(seq) > 5), "i1"),
                                 ("masked_lm_positions", positions, "i4"),
                                 ("masked_lm_ids", rng.integers(5, vocab, (n, preds)), "i4"),
                                 ("next_sentence_labels", rng.integers(0, 2, n), "i1")):
            f.create_dataset(key, data=data, dtype=dtype, compression="gzip")


SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# Each GLUE task's header (None: CoLA has none) and how a row is made from
# (i, sentence 1, sentence 2, label): the columns exactly as GLUE ships them.
FORMATS = {
    "cola": (None, lambda i, a, b, y: ["gj04", y, "", a]),
    "sst2": (["sentence", "label"], lambda i, a, b, y: [a, y]),
    "mrpc": (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
             lambda i, a, b, y: [y, 100 + i, 200 + i, a, b]),
    "stsb": (["index", "genre", "filename", "year", "old_index", "source1", "source2",
              "sentence1", "sentence2", "score"],
             lambda i, a, b, y: [i, "main-captions", "MSRvid", "2012test", i, "none", "none",
                                 a, b, y]),
    "qqp": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            lambda i, a, b, y: [i, 2 * i, 2 * i + 1, a, b, y]),
    "mnli": (["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
              "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
              "sentence2", "label1", "gold_label"],
             lambda i, a, b, y: [i, 31193, f"{i}n", "government", "( x )", "( y )", "(ROOT x)",
                                 "(ROOT y)", a, b, y, y]),
    "qnli": (["index", "question", "sentence", "label"], lambda i, a, b, y: [i, a, b, y]),
    "rte": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [i, a, b, y]),
    "wnli": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [i, a, b, y]),
}


def sentence(rng):
    return " ".join(rng.choice(WORDS, rng.integers(3, 12))).capitalize() + "."


def label_text(spec, rng, first, second):
    """A label that depends on the text a little, so training can learn it."""
    if spec.labels is None:
        return f"{5 * len(set(first.split()) & set(second.split())) / 8:.3f}"
    return spec.labels[(len(first) + len(second)) % len(spec.labels)]


def write_glue(folder, task, sizes=(("train", 24), ("dev", 21)), bom=False, seed=0):
    spec, (header, row) = SPECS[task], FORMATS[task]
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in sizes:
        lines = [] if header is None else ["\t".join(header)]
        for i in range(count):
            a, b = sentence(rng), sentence(rng)
            lines.append("\t".join(map(str, row(i, a, b, label_text(spec, rng, a, b)))))
        name = {"dev": spec.stem("valid")}.get(split, split)
        text = ("\ufeff" if bom else "") + "\n".join(lines) + "\n"
        (folder / f"{name}.tsv").write_text(text, encoding="utf-8")
    return folder
