"""Real English text that ships with Python itself, for the demos: the
documentation topics of ``pydoc_data`` and the docstrings of the standard
library's modules, classes and functions (read with ``ast``; nothing is
imported or executed), a few MB in all. ``cached`` builds a demo's files once
per machine; concurrent processes wait on a file lock for one build.
"""

import ast
import contextlib
import fcntl
import logging
import os
import re
import sysconfig

logger = logging.getLogger(__name__)

MAX_CORPUS_BYTES = 8_000_000
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def cache_root():
    return os.environ.get("HETSEQ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hetseq")


def cached(name, build, what):
    """The folder ``cache_root()/name``, made once by ``build(folder)``."""
    root = os.path.join(cache_root(), name)
    done = os.path.join(root, "DONE")
    if os.path.exists(done):
        return root
    os.makedirs(root, exist_ok=True)
    with _locked(os.path.join(root, ".lock")):
        if not os.path.exists(done):
            logger.info("building %s from Python's own documentation in %s (once)", what, root)
            build(root)
            open(done, "w").close()
    return root


@contextlib.contextmanager
def _locked(path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_python_docs_corpus(path, max_bytes=MAX_CORPUS_BYTES):
    """One document per topic or docstring, one paragraph per line."""
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for text in documents():
            paras = paragraphs(text)
            if sum(map(len, paras)) < 100:
                continue
            block = "\n".join(paras) + "\n\n"
            out.write(block)
            written += len(block)
            if written >= max_bytes:
                break
    return written


def documents():
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


def paragraphs(text):
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
