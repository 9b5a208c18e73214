"""torch.load of bytes from outside this process (a checkpoint file, a
peer's message, a weights file), once the archive is what torch.save
writes: every zip record stored, together no larger than the archive.
"""

# ``weights_only=True`` runs no code, but it still believes the archive:
# torch.load inflates a DEFLATE-compressed record (195 KB of file gave a
# 190 MiB tensor, issue 58), and a record listed twice is read twice.
# torch.save writes stored records only (compression method 0), so anything
# else is refused from the zip's central directory (what torch's reader also
# goes by). What a load then allocates is bounded by the bytes given, which
# callers bound themselves (collectives.MAX_OBJECT_BYTES).

import io
import os
import zipfile

import torch


class Unsafe(ValueError):
    """Bytes that are not an archive as torch.save writes it; the message
    says what is wrong with them."""


def check_archive(source):
    """Raise Unsafe unless ``source`` (a path, bytes, or a binary file open
    at its start) is a zip archive of stored records that fit in it."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            return check_archive(file)
    if isinstance(source, (bytes, bytearray)):
        size, source = len(source), io.BytesIO(source)
    else:
        size = source.seek(0, os.SEEK_END)
        source.seek(0)
    try:
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as err:
        # The legacy (pre-zip) format is refused too: its pickle declares
        # storage sizes that torch allocates before reading them.
        raise Unsafe(f"not a zip archive as torch.save writes ({err})") from None
    total = 0
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise Unsafe(f"its record {record.filename[:80]} is compressed (method "
                         f"{record.compress_type}); torch.save stores every record as it is, "
                         "and torch.load would inflate this one")
        if record.compress_size != record.file_size:
            raise Unsafe(f"its record {record.filename[:80]} is stored in {record.compress_size} "
                         f"bytes but declares {record.file_size}")
        total += record.file_size
    if total > size:
        raise Unsafe(f"its records declare {total} bytes in an archive of {size}: records that "
                     "overlap, read more than once")


def load(source):
    """``torch.load(source, weights_only=True)`` on the host, once
    ``check_archive`` accepts it. A path is opened once, and the file
    checked is the one loaded (another file renamed onto the path in
    between is not read). Raises Unsafe, or whatever torch.load raises on
    a damaged archive."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            return _load(file)
    return _load(io.BytesIO(source))


def _load(file):
    check_archive(file)
    file.seek(0)
    return torch.load(file, map_location="cpu", weights_only=True)
