"""Digests of what every node must agree on before it joins (the job's
identity, JobConfig.identity()): HetSeq's own code, and the content of a
file a job flag names (each node may keep its copy elsewhere)."""

import hashlib
import os

import hetseq

_DIGESTS: dict[str, str] = {}


def file_digest(path):
    """A file's content, so that nodes keeping their own copy still agree."""
    if path not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[path] = "sha256:" + digest.hexdigest()[:16]
    return _DIGESTS[path]


_CODE: list[str] = []
# What does not decide the update, so two nodes may differ in it: the plot
# and the status view, the flags' docs page. (The test machinery lives
# outside hetseq/, in tests/machinery/.)
NOT_HASHED = ("reporting/plot.py", "reporting/status.py", "app/flagdoc.py")


def code_digest():
    """HetSeq's own source, so nodes on different code are told so at rendezvous
    (not later by DDP as 'expects same model')."""
    if not _CODE:
        _CODE.append(source_digest(os.path.dirname(hetseq.__file__)))
    return _CODE[0]


def source_digest(root, every_file=False):
    """A digest of the .py files under ``root`` that decide the update
    (all but NOT_HASHED; ``every_file``: all), by relative path and content."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root).replace(os.sep, "/")
            if not every_file and relative.startswith(NOT_HASHED):
                continue
            digest.update(relative.encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()[:16]
