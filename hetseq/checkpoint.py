"""Checkpoints: atomic writes by rank 0, safe loading, resume of a run.

A checkpoint is a dict of plain data and tensors, so it loads with
``torch.load(weights_only=True)``: no code runs from a checkpoint file.
It is written to a temporary file in the same folder, flushed to disk and
renamed over the old one, so a crash while saving never damages the
previous checkpoint.
"""

import logging
import os
import shutil
import tempfile

import torch

from hetseq.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = "hetseq-checkpoint-1"


def add_args(group):
    group.add_argument("--save-dir", default="checkpoints", metavar="DIR",
                       help="where checkpoints go (default: checkpoints)")
    group.add_argument("--restore-file", default="checkpoint_last.pt", metavar="FILE",
                       help="checkpoint to resume from, relative to --save-dir unless absolute "
                            "(default: checkpoint_last.pt; a missing file starts afresh)")
    group.add_argument("--save-interval", type=int, default=1, metavar="N",
                       help="save every N epochs (default: 1)")
    group.add_argument("--no-save", action="store_true", help="do not write checkpoints")
    group.add_argument("--no-epoch-checkpoints", action="store_true",
                       help="keep only checkpoint_last.pt, not checkpoint<EPOCH>.pt")


def plain_args(args):
    """The flags as plain data (what a checkpoint may hold)."""
    return {k: v for k, v in vars(args).items()
            if v is None or isinstance(v, (bool, int, float, str, list, tuple))}


def save(path, state):
    """Write ``state`` to ``path`` atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def copy(src, dst):
    """Atomic copy (an epoch checkpoint from checkpoint_last.pt)."""
    folder = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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


def restore_path(args):
    if os.path.isabs(args.restore_file):
        return args.restore_file
    return os.path.join(args.save_dir, args.restore_file)


def check_save_dir(save_dir):
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        raise UserError(f"--save-dir {save_dir} cannot be created: {err.strerror}") from None
    if not os.access(save_dir, os.W_OK):
        raise UserError(f"--save-dir {save_dir} is not writable; pick another folder or --no-save")
