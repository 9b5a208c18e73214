"""Raw text -> WordPiece -> NSP pairs and masking -> NVIDIA-format HDF5 shards,
with instances made as Google's ``create_pretraining_data.py`` makes them, so
that ``--task bert`` trains on them as on NVIDIA's own shards. Seeded per
input file: the same seed writes identical shards.
preprocessing/README.md gives the input format and the instances' rules.
"""

import collections
import dataclasses
import os
import random
import re

import h5py
import numpy as np

from hetseq.bert.tokenizer import load_tokenizer
from hetseq.base.errors import UserError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# NVIDIA's key names and dtypes.
DTYPES = {"input_ids": "i4", "input_mask": "i1", "segment_ids": "i1",
          "masked_lm_positions": "i4", "masked_lm_ids": "i4", "next_sentence_labels": "i1"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclasses.dataclass
class Settings:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    seed: int = 12345
    test_fraction: float = 0.02
    lowercase: bool = True


def read_documents(path):
    """Documents (lists of sentences) of one text file."""
    docs, current = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                if current:
                    docs.append(current)
                current = []
                continue
            current.extend(s for s in _SENTENCE_END.split(line) if s)
    if current:
        docs.append(current)
    return docs


def train_vocab(files, out_dir, vocab_size, lowercase=True):
    """Build a WordPiece vocab from ``files``; returns the path of vocab.txt.

    Deterministic on purpose (Hugging Face's WordPiece trainer breaks ties
    differently from run to run, and nodes that build the same default data
    independently must get the same vocab): every character (word-initial and
    ``##`` continuation), then the most frequent whole words, word stems and
    ``##`` endings, ties broken by the token itself. Words are split exactly
    as the BERT tokenizer splits them.
    """
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    normalizer, splitter = BertNormalizer(lowercase=lowercase), BertPreTokenizer()
    words = collections.Counter()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                text = normalizer.normalize_str(line)
                words.update(w for w, _ in splitter.pre_tokenize_str(text))
    vocab = wordpiece_vocab(words, vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    return path


def wordpiece_vocab(words, size):
    """Special tokens, all characters, then frequent words and pieces (see train_vocab)."""
    chars, pieces = collections.Counter(), collections.Counter()
    for word, count in words.items():
        chars[word[0]] += count
        for ch in word[1:]:
            chars["##" + ch] += count
        pieces[word] += count
        for n in range(2, min(len(word) - 1, 5) + 1):
            pieces[word[:n + 1]] += count          # stems of 3..6 characters
            pieces["##" + word[-n:]] += count       # endings of 2..5 characters
    ranked = lambda counter: sorted(counter, key=lambda t: (-counter[t], t))  # noqa: E731
    vocab = SPECIAL_TOKENS + ranked(chars)
    chosen = set(vocab)
    for token in ranked(pieces):
        if len(vocab) >= size:
            break
        if token not in chosen:
            vocab.append(token)
            chosen.add(token)
    return vocab


def _truncate_pair(a, b, max_tokens, rng):
    # Trim the longer segment, from the front or the back at random (as Google).
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]


def _random_segment(docs, doc_index, target, rng):
    for _ in range(10):
        other = rng.randint(0, len(docs) - 1)
        if other != doc_index:
            break
    doc = docs[other]
    tokens = []
    for sentence in doc[rng.randint(0, len(doc) - 1):]:
        tokens.extend(sentence)
        if len(tokens) >= target:
            break
    return tokens


def _pair_from_chunk(chunk, docs, doc_index, target, rng):
    """(tokens_a, tokens_b, is_random_next, sentences of chunk left unused)."""
    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
    tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
    if len(chunk) == 1 or rng.random() < 0.5:
        tokens_b = _random_segment(docs, doc_index, target - len(tokens_a), rng)
        return tokens_a, tokens_b, True, len(chunk) - a_end
    return tokens_a, [t for sentence in chunk[a_end:] for t in sentence], False, 0


def instances_from_document(docs, doc_index, settings, rng):
    """Sentence-pair instances (tokens_a, tokens_b, is_random_next) of one document."""
    doc, max_tokens = docs[doc_index], settings.max_seq_length - 3
    target = max_tokens if rng.random() >= settings.short_seq_prob else rng.randint(2, max_tokens)
    instances, chunk, length, i = [], [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a, b, random_next, unused = _pair_from_chunk(chunk, docs, doc_index, target, rng)
            i -= unused     # sentences not used for tokens_a go into the next chunk
            _truncate_pair(a, b, max_tokens, rng)
            if a and b:
                instances.append((a, b, random_next))
            chunk, length = [], 0
        i += 1
    return instances


class Masker:
    """Chooses the positions to predict and corrupts them (80/10/10)."""

    def __init__(self, settings, vocab_size, cls_id, sep_id, mask_id, rng):
        self.s, self.vocab_size, self.rng = settings, vocab_size, rng
        self.cls_id, self.sep_id, self.mask_id = cls_id, sep_id, mask_id

    def __call__(self, tokens_a, tokens_b):
        tokens = np.array([self.cls_id, *tokens_a, self.sep_id, *tokens_b, self.sep_id], np.int64)
        segments = np.zeros(len(tokens), np.int64)
        segments[len(tokens_a) + 2:] = 1
        candidates = np.nonzero((tokens != self.cls_id) & (tokens != self.sep_id))[0]
        count = min(self.s.max_predictions_per_seq,
                    max(1, int(round(len(tokens) * self.s.masked_lm_prob))), len(candidates))
        positions = np.sort(self.rng.choice(candidates, size=count, replace=False))
        labels = tokens[positions].copy()
        draw = self.rng.random(count)
        tokens[positions[draw < 0.8]] = self.mask_id
        random_positions = positions[(draw >= 0.8) & (draw < 0.9)]
        tokens[random_positions] = self.rng.integers(0, self.vocab_size, len(random_positions))
        return tokens, segments, positions, labels


def to_arrays(instances, settings):
    """Masked instances -> the six NVIDIA arrays (zero padded)."""
    n, L, P = len(instances), settings.max_seq_length, settings.max_predictions_per_seq
    arrays = {key: np.zeros((n, L) if key in ("input_ids", "input_mask", "segment_ids") else
                            (n,) if key == "next_sentence_labels" else (n, P), np.int64)
              for key in DTYPES}
    for row, (tokens, segments, positions, labels, random_next) in enumerate(instances):
        arrays["input_ids"][row, :len(tokens)] = tokens
        arrays["input_mask"][row, :len(tokens)] = 1
        arrays["segment_ids"][row, :len(tokens)] = segments
        arrays["masked_lm_positions"][row, :len(positions)] = positions
        arrays["masked_lm_ids"][row, :len(labels)] = labels
        arrays["next_sentence_labels"][row] = int(random_next)
    return arrays


def write_shard(path, arrays):
    """Write atomically, with NVIDIA's names and dtypes, gzip and small row chunks
    (random access reads one chunk per row), without timestamps (reproducible)."""
    tmp = f"{path}.tmp"
    with h5py.File(tmp, "w") as f:
        for key, dtype in DTYPES.items():
            data = arrays[key].astype(dtype)
            chunks = (min(64, len(data)),) + data.shape[1:] if len(data) else None
            f.create_dataset(key, data=data, dtype=dtype, compression="gzip", chunks=chunks,
                             track_times=False)
    os.replace(tmp, path)


def _tokenize_documents(tokenizer, docs):
    sentences = [s for doc in docs for s in doc]
    encoded = iter(e.ids for e in tokenizer.encode_batch(sentences, add_special_tokens=False))
    token_docs = [[ids for ids in (next(encoded) for _ in doc) if ids] for doc in docs]
    return [doc for doc in token_docs if doc]


def process_file(job):
    """One input file -> ``{prefix}_train_{index}.hdf5`` and ``..._test_...``.
    Runs in a worker process; returns {split: number of sequences}."""
    path, index, vocab_path, out_dir, prefix, settings = job
    tokenizer = load_tokenizer(vocab_path, settings.lowercase)
    docs = _tokenize_documents(tokenizer, read_documents(path))
    rng = random.Random(settings.seed * 1_000_003 + index)
    masker = Masker(settings, tokenizer.get_vocab_size(), *(tokenizer.token_to_id(t) for t in
                                                            ("[CLS]", "[SEP]", "[MASK]")),
                    np.random.default_rng([settings.seed, index]))
    splits = {"train": [], "test": []}
    for doc in docs:
        splits["test" if rng.random() < settings.test_fraction else "train"].append(doc)
    counts = {}
    for split, split_docs in splits.items():
        pairs = [pair for _ in range(settings.dupe_factor) for d in range(len(split_docs))
                 for pair in instances_from_document(split_docs, d, settings, rng)]
        if not pairs:
            continue
        rng.shuffle(pairs)
        masked = [(*masker(a, b), random_next) for a, b, random_next in pairs]
        write_shard(os.path.join(out_dir, f"{prefix}_{split}_{index}.hdf5"),
                    to_arrays(masked, settings))
        counts[split] = len(masked)
    return counts


def create_pretraining_data(inputs, out_dir, vocab=None, vocab_size=30522, settings=None,
                            num_workers=1, prefix="corpus", progress=True):
    """Shards for every input file (in parallel). Trains a vocab when ``vocab``
    is None. Returns (vocab path, {split: sequences})."""
    from multiprocessing import get_context

    from tqdm import tqdm

    settings = settings or Settings()
    inputs = [str(path) for path in inputs]
    missing = [path for path in inputs if not os.path.isfile(path)]
    if not inputs or missing:
        named = ": missing " + ", ".join(missing) if missing else ""
        raise UserError(f"no input text files{named}")
    os.makedirs(out_dir, exist_ok=True)
    vocab = vocab or train_vocab(inputs, out_dir, vocab_size, settings.lowercase)
    jobs = [(path, i, vocab, out_dir, prefix, settings) for i, path in enumerate(inputs)]
    totals = {}
    bar = tqdm(total=len(jobs), desc="shards", disable=not progress)
    if num_workers > 1 and len(jobs) > 1:
        # The Rust tokenizer's own threads do not survive a fork; one per process.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        with get_context("spawn").Pool(min(num_workers, len(jobs))) as pool:
            results = pool.imap_unordered(process_file, jobs)
            for counts in results:
                _add_counts(totals, counts, bar)
    else:
        for job in jobs:
            _add_counts(totals, process_file(job), bar)
    bar.close()
    return vocab, totals


def _add_counts(totals, counts, bar):
    for split, n in counts.items():
        totals[split] = totals.get(split, 0) + n
    bar.update(1)
