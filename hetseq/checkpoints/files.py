"""Checkpoint files: written atomically and durably, read safely, kept or
pruned by number (checkpoint.py decides when and what).

A checkpoint is a dict of plain data and tensors, so it loads with
``torch.load(weights_only=True)``: no code runs from a checkpoint file, and
only an archive of stored records as torch.save writes is read
(safe_load.py: torch.load would inflate a compressed one). It
is written to a temporary file in the same folder, flushed to disk, renamed
over the old one and the folder synced, so a crash or a power loss while
saving never damages the previous checkpoint.
"""

import os
import re
import shutil
import tempfile

import torch

from hetseq.base import safe_load
from hetseq.base.errors import UserError
from hetseq.base.logs import disk_full, disk_of, os_error, why_not_written
from hetseq.checkpoints.state import Component, StateMismatch

FORMAT = "hetseq-checkpoint-1"


def _umask():
    mask = os.umask(0)   # the only way to read it; set straight back
    os.umask(mask)
    return mask


# mkstemp creates files 0600; checkpoints get the mode the user's umask gives
# any new file, so colleagues on a shared cluster can read them.
FILE_MODE = 0o666 & ~_umask()


class SaveFailed(UserError):
    """A checkpoint file could not be written (``path``); the previous file
    of that name is as it was (``kept``: whether there was one). ``full``:
    for want of space or quota. checkpoint.py says which checkpoint
    resumes; the message alone says what a save of one file knows."""

    def __init__(self, path: str, kept: bool, full: bool, reason: str) -> None:
        self.path, self.kept, self.full, self.reason = path, kept, full, reason
        self.folder = os.path.dirname(path)
        self.gone = not os.path.isdir(self.folder)
        self.disk = disk_of(path)
        super().__init__(f"{self.what()}; {self.previous()}. {self.fix()}, then run the same "
                         "command again to resume")

    def what(self) -> str:
        if self.full:
            return f"no space left on device while writing {self.path}"
        if self.gone:
            return f"cannot write checkpoint {self.path}: its folder is gone (deleted or unmounted)"
        return f"cannot write checkpoint {self.path} ({self.reason})"

    def previous(self) -> str:
        if self.gone:
            return "the checkpoints it held went with it"
        return f"the previous checkpoint {self.path} is intact" if self.kept else \
            "there was no earlier checkpoint of that name"

    def fix(self) -> str:
        if self.full:
            return f"Free space on {self.disk} or pass --save-dir on a larger disk"
        if self.gone:
            return f"Make {self.folder} again or pass another --save-dir"
        return f"Make {self.folder} writable again ({self.disk}) or pass another --save-dir"


def _atomic_write(dst, write):
    """``write(file)`` into a temporary file beside ``dst``, then rename it onto
    ``dst``: a crash or a full disk leaves the previous ``dst`` as it was. The
    file's data reach the disk before the rename, and the folder's entry
    after it: a power loss then keeps the new file, not only its data. A
    write the disk refuses (full, a quota, the folder gone) is SaveFailed."""
    folder = os.path.dirname(os.path.abspath(dst))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        _sync_folder(folder)
    except BaseException as err:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        full = disk_full(err)
        # torch.save reports the OS's refusal as a RuntimeError caused by it.
        if not (full or isinstance(err, OSError) or os_error(err) is not None):
            raise
        raise SaveFailed(os.path.abspath(dst), os.path.exists(dst), full,
                         why_not_written(err)) from None


def _sync_folder(folder):
    """fsync a folder: a rename is durable once its folder is on the disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path, state):
    """Write ``state`` to ``path`` atomically."""
    _atomic_write(path, lambda f: torch.save(state, f))


def copy(src, dst):
    """Atomic copy (an epoch checkpoint from checkpoint_last.pt)."""
    def write(f):
        with open(src, "rb") as source:
            shutil.copyfileobj(source, f)
    _atomic_write(dst, write)


def load(path):
    """The checkpoint at ``path``, its archive checked before torch.load
    (safe_load.py) and the parts every reader relies on checked after
    (state.py's declared kinds: the run checks the rest against itself)."""
    try:
        state = safe_load.load(path)
    except Exception as err:  # truncated, foreign, compressed or unsafe files all land here
        what = "" if isinstance(err, safe_load.Unsafe) else f"{type(err).__name__}: "
        raise UserError(f"checkpoint {path} cannot be read ({what}"
                        f"{(str(err).splitlines() or [''])[0][:200]}); it may be truncated or not "
                        "a HetSeq checkpoint: pass another --restore-file or remove it") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a HetSeq checkpoint (no '{FORMAT}' marker); pass another "
                        "--restore-file or remove it")
    try:
        Component.check_declared(state)
    except StateMismatch as err:
        raise UserError(f"checkpoint {path} cannot be used: {err}; it was damaged or not written "
                        "by HetSeq: pass another --restore-file or remove it") from None
    return state


def restore_path(save):
    """The checkpoint to resume from (``save``: the node's SaveConfig)."""
    if os.path.isabs(save.restore_file):
        return save.restore_file
    return os.path.join(save.save_dir, save.restore_file)


def check_save_dir(save_dir):
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        raise UserError(f"--save-dir {save_dir} cannot be created: {err.strerror}") from None
    if not os.access(save_dir, os.W_OK):
        raise UserError(f"--save-dir {save_dir} is not writable; pick another folder or --no-save")


def remove_stale_temporaries(save_dir):
    """Temporary files of a save that was killed midway."""
    for name in os.listdir(save_dir):
        if name.startswith(".tmp-") and name.endswith(".pt"):
            os.remove(os.path.join(save_dir, name))


def _numbered(save_dir, pattern):
    """(number, path) of checkpoints whose name matches ``pattern``, oldest first."""
    found = []
    for name in os.listdir(save_dir):
        match = re.fullmatch(pattern, name)
        if match:
            found.append((tuple(int(g) for g in match.groups()), os.path.join(save_dir, name)))
    return sorted(found)


def prune(save_dir, pattern, keep):
    if keep < 0:
        return
    for _, path in _numbered(save_dir, pattern)[:-keep or None]:
        os.remove(path)
