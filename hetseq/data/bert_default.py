"""The embedded default for ``--task bert`` without ``--data``: real English
text that ships with Python itself, turned once into a vocab, a small BERT
config and NVIDIA-format shards, cached for later runs.

Text: the documentation topics of ``pydoc_data`` and the docstrings of the
standard library's modules, classes and functions (read with ``ast``; nothing
is imported or executed), a few MB in all. Building takes well under a
minute on 2 cores; concurrent processes wait on a file lock for one build.
"""

import ast
import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import sysconfig

from hetseq.data.bert_preprocess import Settings, create_pretraining_data
from hetseq.models.bert import BertConfig

logger = logging.getLogger(__name__)

VERSION = "bert-default-v2"
MAX_CORPUS_BYTES = 8_000_000
VOCAB_SIZE = 8192
SETTINGS = Settings(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=5, seed=12345,
                    test_fraction=0.03)
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
             max_position_embeddings=128)
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class DefaultData:
    data: str
    vocab: str
    config: str


def cache_root():
    root = os.environ.get("HETSEQ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hetseq")
    return os.path.join(root, VERSION)


def ensure_default_data(root=None):
    """Build (once) and return the default BERT data, vocab and config."""
    root = root or cache_root()
    paths = DefaultData(os.path.join(root, "shards"), os.path.join(root, "shards", "vocab.txt"),
                        os.path.join(root, "bert_config.json"))
    done = os.path.join(root, "DONE")
    if os.path.exists(done):
        return paths
    os.makedirs(root, exist_ok=True)
    with _locked(os.path.join(root, ".lock")):
        if not os.path.exists(done):
            logger.info("building the default BERT corpus from Python's own documentation in "
                        "%s (once)", root)
            _build(root, paths)
            open(done, "w").close()
    return paths


@contextlib.contextmanager
def _locked(path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(root, paths):
    corpus = os.path.join(root, "python_docs.txt")
    write_python_docs_corpus(corpus)
    vocab, counts = create_pretraining_data([corpus], paths.data, vocab_size=VOCAB_SIZE,
                                            settings=SETTINGS, prefix="pydocs", progress=False)
    with open(vocab, encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)
    BertConfig(vocab_size=vocab_size, **MODEL).to_json(paths.config)
    logger.info("default BERT data: %s sequences, vocab %d", counts, vocab_size)


def write_python_docs_corpus(path, max_bytes=MAX_CORPUS_BYTES):
    """One document per topic or docstring, one paragraph per line."""
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for text in _documents():
            paragraphs = _paragraphs(text)
            if sum(map(len, paragraphs)) < 100:
                continue
            block = "\n".join(paragraphs) + "\n\n"
            out.write(block)
            written += len(block)
            if written >= max_bytes:
                break
    return written


def _documents():
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield topics[name]
    yield from _stdlib_docstrings()


def _stdlib_docstrings():
    stdlib = sysconfig.get_paths()["stdlib"]
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield from _docstrings(os.path.join(folder, name))


def _docstrings(path):
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 60:
                yield doc


_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|[$%#]|[-=*~^]{4,})")


def _paragraphs(text):
    """Prose paragraphs of a text, each on one line; code and tables dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(_CODE_LINE.match(line) for line in lines):
            continue
        if lines[0].startswith((" ", "\t")) and len(lines) > 1:
            continue    # indented blocks are mostly code or option tables
        words = " ".join(" ".join(lines).split())
        if len(words) > 20 and sum(c.isalpha() or c == " " for c in words) > 0.75 * len(words):
            out.append(words)
    return out
