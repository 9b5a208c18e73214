"""Checkpoints: bit-exact resume, safe writes, retention; and failure handling."""

import os

import pytest
import torch

from machinery.settings import ROOT, TOY
from hetseq.base.errors import UserError
from hetseq.run import checkpoint
from hetseq.checkpoints import files as checkpoint_files


class Counter:
    """A minimal checkpoint component (torchtitan's Stateful protocol)."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_checkpointer_takes_named_components_not_the_run(tmp_path):
    from hetseq.app import cli
    from hetseq.distributed.spawn import DistContext
    _, job, node = cli.parse([*TOY, "--save-dir", str(tmp_path)])
    ctx = DistContext(0, 1, 0, torch.device("cpu"))

    def checkpointer(components, skip=()):
        return checkpoint.Checkpointer(job.checkpoint, node.save, ctx, components, skip)
    saver = checkpointer({"model": Counter(7), "data": Counter(3)})
    saver.save(updates=5, data_epoch=1, epoch=1, metric=0.5)
    state = checkpoint_files.load(str(tmp_path / "checkpoint_last.pt"))
    assert state["model"] == {"value": 7} and state["data"] == {"value": 3}
    assert state["best"] == 0.5 and (tmp_path / "checkpoint1.pt").exists()
    model, data = Counter(), Counter()
    resumer = checkpointer({"model": model, "data": data}, skip={"data"})
    assert resumer.restore() == str(tmp_path / "checkpoint_last.pt")
    assert (model.value, data.value, resumer.best) == (7, 0, 0.5)   # "data" skipped (a reset)
    other = checkpointer({"model": Counter(), "optimizer": Counter()})
    with pytest.raises(UserError, match="does not fit this run"):
        other.restore()


def test_an_elastic_state_keeps_its_lineage_and_another_line_is_refused(tmp_path):
    """--elastic: a checkpoint keeps the lineage of its generation; a state
    received as a generation's source must carry the lineage the round
    agreed on, or every rank refuses it."""
    from hetseq.app import cli
    from hetseq.distributed.spawn import DistContext
    from hetseq.elastic.hooks import on_line
    _, job, node = cli.parse([*TOY, "--save-dir", str(tmp_path)])
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    line = {"lineage": ["1-aa", "2-bb"], "members": [{"addr": "10.0.0.1", "port": 29500}]}
    saver = checkpoint.Checkpointer(job.checkpoint, node.save, ctx, {"model": Counter(7)},
                                    entries={"elastic": line})
    saver.save(updates=5, data_epoch=1)
    state = checkpoint_files.load(str(tmp_path / "checkpoint_last.pt"))
    assert state["elastic"] == line and saver.local_state()["elastic"] == line
    model = Counter()
    taker = checkpoint.Checkpointer(job.checkpoint, node.save, ctx, {"model": model})
    assert taker.restore((0, lambda: state, on_line(["1-aa", "2-bb"]))) == "the state of rank 0"
    assert model.value == 7
    with pytest.raises(UserError, match="not on this job's line"):
        taker.restore((0, lambda: state, on_line(["1-aa", "2-xx"])))


# Checkpoints written by release 0.2.0 (commit da2b095): the toy on 2 ranks of
# 7 + 3 samples, seed 3, 4 updates. Made once and committed, never rewritten:
# a checkpoint key renamed or moved fails here, not at a user's resume.
PREVIOUS = ROOT / "tests" / "data" / "previous_release"


PREVIOUS_FLAGS = {
    "sync_adamw_clip.pt": ["--optimizer", "adamw", "--clip-norm", "0.5"],
    # 0.2.0's default outer rate was DiLoCo's 0.7.
    "local_steps.pt": ["--local-steps", "2", "--outer-lr", "0.7", "--outer-momentum", "0.5",
                       "--momentum", "0.9"],
}


def test_every_key_of_a_checkpoint_is_declared_once():
    """The keys of the previous release's checkpoints are all declared
    (hetseq/checkpoints/state.py's Component), by the modules that write them, and --reset-*
    leave out what their help says."""
    import hetseq.run.loop  # noqa: F401
    import hetseq.update.modes.local_steps  # noqa: F401  (declares its keys)
    from hetseq.run.checkpoint import CheckpointConfig
    from hetseq.checkpoints.state import Component
    from hetseq.checkpoints.keys import CONTROLLER
    for name in PREVIOUS_FLAGS:
        state = torch.load(PREVIOUS / name, weights_only=True)
        keys = set(state) | {f"{CONTROLLER.name}.{key}" for key in state[CONTROLLER.name]}
        assert keys <= set(Component.declared), (name, keys - set(Component.declared))
    resets = {flag: False for flag in ("reset_optimizer", "reset_lr_scheduler",
                                       "reset_dataloader", "reset_meters")}
    fields = {f: None for f in CheckpointConfig.__dataclass_fields__}
    cfg = CheckpointConfig(**{**fields, **resets, "reset_optimizer": True})
    assert Component.left_out(cfg) == {"controller.optimizer", "controller.optimizers",
                                       "controller.local_steps", "controller.loss_scaler"}
    cfg = CheckpointConfig(**{**fields, **resets, "reset_dataloader": True})
    assert Component.left_out(cfg) == {"train_iterator", "rng"}


def test_a_save_reaches_the_disk_file_first_then_its_folder(tmp_path, monkeypatch):
    """fsync of the file's data before the rename, of the folder after it:
    without the folder's, a power loss right after a save can lose the
    rename (the data are on the disk, the name is not)."""
    import stat
    done = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        done.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(src, dst):
        done.append("rename")
        real_replace(src, dst)
    monkeypatch.setattr(checkpoint_files.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint_files.os, "replace", replace)
    checkpoint_files.save(str(tmp_path / "c.pt"), {"format": checkpoint_files.FORMAT})
    assert done == ["file", "rename", "folder"], done
