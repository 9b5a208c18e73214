"""GLUE data, read exactly as GLUE distributes it, and plain files of your own.

A GLUE folder holds ``train.tsv``, ``dev.tsv`` and ``test.tsv`` (MNLI:
``dev_matched.tsv`` and ``dev_mismatched.tsv``), tab-separated, no quoting.
Columns are found by the header's names; CoLA has no header and is read by
position. Plain data: ``train.csv`` / ``train.jsonl`` (and ``dev.*``) with
``sentence1``, optional ``sentence2`` and ``label``.

Sentences are tokenized once, when the split loads; batches are padded to
their own longest sequence, not to a fixed length.
"""

import csv
import dataclasses
import json
import os

import torch

from hetseq.base.errors import UserError

PLAIN_COLUMNS = ("sentence1", "sentence2", "label")
PLAIN_FORMATS = (".csv", ".jsonl")


@dataclasses.dataclass(frozen=True)
class GlueSpec:
    """What a GLUE task reads and reports. ``columns``: header names (or
    positions when ``header`` is False) of sentence 1, sentence 2 (None for
    single sentences) and the label. ``labels`` None: a regression."""

    name: str
    columns: tuple
    labels: tuple | None = None
    metrics: tuple = ("accuracy",)
    header: bool = True
    splits: tuple = (("valid", "dev"),)

    @property
    def num_labels(self):
        return 1 if self.labels is None else len(self.labels)

    def stem(self, split):
        """The file name (without extension) of ``split``."""
        return dict(self.splits).get(split, split)


_NLI = ("entailment", "not_entailment")
SPECS = {spec.name: spec for spec in (
    GlueSpec("cola", (3, None, 1), ("0", "1"), ("matthews_correlation", "accuracy"), header=False),
    GlueSpec("sst2", ("sentence", None, "label"), ("0", "1")),
    GlueSpec("mrpc", ("#1 String", "#2 String", "Quality"), ("0", "1"), ("accuracy", "f1")),
    GlueSpec("stsb", ("sentence1", "sentence2", "score"), None, ("pearson", "spearman")),
    GlueSpec("qqp", ("question1", "question2", "is_duplicate"), ("0", "1"), ("accuracy", "f1")),
    GlueSpec("mnli", ("sentence1", "sentence2", "gold_label"),
             ("contradiction", "entailment", "neutral"),
             splits=(("valid", "dev_matched"), ("valid_matched", "dev_matched"),
                     ("valid_mismatched", "dev_mismatched"))),
    GlueSpec("qnli", ("question", "sentence", "label"), _NLI),
    GlueSpec("rte", ("sentence1", "sentence2", "label"), _NLI),
    GlueSpec("wnli", ("sentence1", "sentence2", "label"), ("0", "1")),
)}
ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-mm": "mnli", "mnli_mismatched": "mnli"}


PLAIN = GlueSpec("custom", PLAIN_COLUMNS)


def spec_for(name):
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SPECS:
        raise UserError(f"--glue-task {name}: unknown GLUE task; expected one of "
                        f"{', '.join(SPECS)} (or leave it out for CSV/JSONL data of your own)")
    return SPECS[key]


def split_file(folder, spec, split):
    """The file of ``split`` in ``folder``: GLUE's TSV, else a plain CSV/JSONL."""
    stem = (spec or PLAIN).stem(split)
    candidates = [f"{stem}.tsv"] if spec and spec.name in SPECS else []
    candidates += [stem + ext for ext in PLAIN_FORMATS]
    for name in candidates:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    what = spec.name.upper() if spec and spec.name in SPECS else "plain"
    raise UserError(f"--data {folder}: no {' or '.join(candidates)} for split '{split}' "
                    f"({what} data); expected GLUE's files as distributed (train.tsv, dev.tsv, "
                    "test.tsv) or train/dev .csv/.jsonl with sentence1, sentence2, label")


def read_examples(path, spec):
    """[(sentence1, sentence2 or None, label text)] of a GLUE TSV or plain file."""
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".csv"):
        with open(path, encoding="utf-8-sig", newline="") as f:
            return _plain_rows(path, list(csv.reader(f)), PLAIN_COLUMNS, line=1)
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not spec.header:
        return [_pick(path, row, spec.columns, number) for number, row in enumerate(rows, 1)]
    return _plain_rows(path, rows, spec.columns, line=1, task=spec.name.upper())


def _plain_rows(path, rows, names, line, task="plain data"):
    if not rows:
        raise UserError(f"{path} is empty; expected a header line and examples")
    header = [name.strip() for name in rows[0]]
    required = [name for name in names if name is not None and name != "sentence2"]
    missing = [name for name in required if name not in header]
    if missing:
        raise UserError(f"{path}: columns {header} lack {missing}; {task} files need the "
                        f"columns {[n for n in names if n is not None]} in their header")
    positions = tuple(header.index(n) if n in header else None for n in names)
    return [_pick(path, row, positions, number)
            for number, row in enumerate(rows[1:], line + 1) if row]


def _pick(path, row, positions, line):
    needed = max(p for p in positions if p is not None)
    if len(row) <= needed:
        raise UserError(f"{path} line {line}: {len(row)} columns, expected at least "
                        f"{needed + 1}; is this the right file for the task?")
    first, second, label = (None if p is None else row[p] for p in positions)
    return first, second, label


def _read_jsonl(path):
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                examples.append((item["sentence1"], item.get("sentence2"), str(item["label"])))
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{path} line {number}: expected a JSON object with "
                                f"sentence1, optional sentence2 and label ({err})") from None
    return examples


def plain_spec(path):
    """A task spec for plain data: its labels are the sorted label values of
    ``path`` (the training file); numbers that are not all integers make it a
    regression. Two labels report accuracy and F1."""
    labels = sorted({label for _, _, label in read_examples(path, None)})
    try:
        numbers = [float(label) for label in labels]
        if not all(number.is_integer() for number in numbers):
            return dataclasses.replace(PLAIN, metrics=("pearson", "spearman"))
        labels = [label for _, label in sorted(zip(numbers, labels))]
    except ValueError:
        pass
    metrics = ("accuracy", "f1") if len(labels) == 2 else ("accuracy",)
    return dataclasses.replace(PLAIN, labels=tuple(labels), metrics=metrics)


class GlueDataset(torch.utils.data.Dataset):
    """Tokenized examples of one split; items are indices, the collater pads."""

    def __init__(self, path, spec, tokenizer, max_length):
        examples = read_examples(path, spec)
        if not examples:
            raise UserError(f"{path} holds no examples")
        self.targets = [_target(path, spec, label, i) for i, (_, _, label) in enumerate(examples)]
        firsts = [first for first, _, _ in examples]
        seconds = None if examples[0][1] is None else [s or "" for _, s, _ in examples]
        self.encoded = tokenizer.encode_pairs(firsts, seconds, max_length)
        self.regression = spec.labels is None

    def __len__(self):
        return len(self.encoded)

    def __getitem__(self, index):
        return index

    def collater(self, indices):
        length = max(len(self.encoded[i][0]) for i in indices)
        ids = torch.zeros(len(indices), length, dtype=torch.long)
        types = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(indices):
            tokens, token_types = self.encoded[i]
            ids[row, :len(tokens)] = torch.tensor(tokens)
            types[row, :len(tokens)] = torch.tensor(token_types)
            mask[row, :len(tokens)] = 1
        dtype = torch.float32 if self.regression else torch.long
        labels = torch.tensor([self.targets[i] for i in indices], dtype=dtype)
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
                "labels": labels}


def _target(path, spec, label, index):
    if label is None or label == "":
        raise UserError(f"{path}: example {index + 1} has no label (GLUE's test.tsv hides its "
                        "labels; train and validate on train and dev)")
    if spec.labels is None:
        try:
            return float(label)
        except ValueError:
            raise UserError(f"{path}: example {index + 1} has label '{label}'; "
                            f"{spec.name.upper()} expects a number") from None
    if label not in spec.labels:
        raise UserError(f"{path}: example {index + 1} has label '{label}', which is not one of "
                        f"{spec.name.upper()}'s labels {', '.join(spec.labels)}")
    return spec.labels.index(label)
