"""Bytes from a file or a peer are data, never code: a checkpoint or a
collective's payload that carries a pickled call is refused (exit 2 for a
checkpoint), and the call never runs.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/checkpoints/test_untrusted.py."""


import torch

from machinery.commands import run_train
from machinery.settings import TOY
from hetseq.checkpoints import files as checkpoint_files
from unit.checkpoints.test_untrusted import Planted


def test_a_checkpoint_carrying_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "the-code-ran"
    save = tmp_path / "ckpt"
    save.mkdir()
    torch.save({"format": checkpoint_files.FORMAT, "controller": Planted(marker)},
               save / "checkpoint_last.pt")
    result = run_train(*TOY, "--max-sentences", 8, "--max-update", 1, "--save-dir", save)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "cannot be read" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()
