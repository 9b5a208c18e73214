"""A checkpoint is checked before it is used (issue 58, item 5): every part a
run loads against what the run builds (hetseq/checkpoints/state.py's kinds), and the
archive against what torch.save writes (hetseq/base/safe_load.py).

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/checkpoints/test_checkpoint_checks.py."""


import torch

from machinery.commands import run_job, run_train
from unit.checkpoints.test_checkpoint_checks import ADAM, _deflated
from unit.checkpoints.test_checkpoint_checks import trained  # noqa: F401,F811  (fixtures)


def _one_line_exit_2(code, output, words):
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert words in output.strip().splitlines()[-1], output[-3000:]


def test_a_crafted_model_value_ends_every_rank_of_a_split_state_with_one_line(trained, tmp_path):
    """Issue 58: under --zero 2 --state-shares memory a model value that is
    not a tensor gave AttributeError on both ranks. Now both refuse it
    before loading, in one line, exit 2 (a node each: the same check)."""
    state = torch.load(trained[2], weights_only=True)
    state["controller"]["model"]["2.bias"] = "not a tensor"
    torch.save(state, tmp_path / "checkpoint_last.pt")
    results = run_job([*ADAM, "--zero", 2, "--state-shares", "memory", "--save-dir", tmp_path],
                      [["--max-sentences", 4], ["--max-sentences", 4]])
    for code, output in results:
        _one_line_exit_2(code, output, "controller.model.2.bias is the string 'not a tensor', "
                                       "expected a tensor of shape [1] (float64)")


def test_a_compressed_checkpoint_ends_the_run_with_one_line(trained, tmp_path):
    (tmp_path / "checkpoint_last.pt").write_bytes(_deflated(trained[2].read_bytes()))
    result = run_train(*ADAM, "--max-sentences", 10, "--save-dir", tmp_path)
    _one_line_exit_2(result.returncode, result.stderr, "is compressed")
