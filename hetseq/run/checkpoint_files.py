"""Checkpoint files: written atomically and durably, read safely, kept or
pruned by number (checkpoint.py decides when and what).

A checkpoint is a dict of plain data and tensors, so it loads with
``torch.load(weights_only=True)``: no code runs from a checkpoint file. It
is written to a temporary file in the same folder, flushed to disk, renamed
over the old one and the folder synced, so a crash or a power loss while
saving never damages the previous checkpoint.
"""

import errno
import os
import re
import shutil
import tempfile

import torch

from hetseq.errors import UserError

FORMAT = "hetseq-checkpoint-1"


def _umask():
    mask = os.umask(0)   # the only way to read it; set straight back
    os.umask(mask)
    return mask


# mkstemp creates files 0600; checkpoints get the mode the user's umask gives
# any new file, so colleagues on a shared cluster can read them.
FILE_MODE = 0o666 & ~_umask()


def _disk_full(err):
    """True when ``err`` or an exception it was raised from is ENOSPC (torch.save
    reports it as an 'unexpected pos' RuntimeError caused by the OSError)."""
    while err is not None:
        if getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _atomic_write(dst, write):
    """``write(file)`` into a temporary file beside ``dst``, then rename it onto
    ``dst``: a crash or a full disk leaves the previous ``dst`` as it was. The
    file's data reach the disk before the rename, and the folder's entry
    after it: a power loss then keeps the new file, not only its data."""
    folder = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        _sync_folder(folder)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not _disk_full(err):
            raise
        kept = f"the previous checkpoint {dst} is intact" if os.path.exists(dst) else \
            "there was no earlier checkpoint of that name"
        raise UserError(f"no space left on device while writing {dst}; {kept}. Free space in "
                        f"{folder} or pass --save-dir on a larger disk, then run the same "
                        "command again to resume") from None


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
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, foreign or unsafe files all land here
        raise UserError(f"checkpoint {path} cannot be read ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200]}); it may be truncated or not a HetSeq "
                        "checkpoint: pass another --restore-file or remove it") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a HetSeq checkpoint (no '{FORMAT}' marker); pass another "
                        "--restore-file or remove it")
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
