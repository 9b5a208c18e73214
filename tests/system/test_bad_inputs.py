"""Every bad input ends with one clear message and a non-zero exit, never a hang."""

import json

import pytest
import torch

from hetseq.bert import BertConfig

from machinery.commands import run_train
from machinery.settings import TOY
from machinery.bert_files import TINY, write_nvidia_shard


@pytest.fixture
def bert(tmp_path):
    """A valid BERT set-up; each case breaks one part of it."""
    data = tmp_path / "data"
    data.mkdir()
    write_nvidia_shard(data / "x_training_0.hdf5", 20)
    (tmp_path / "vocab.txt").write_text("\n".join(f"t{i}" for i in range(50)) + "\n")
    BertConfig(vocab_size=50, **TINY).to_json(tmp_path / "config.json")
    return tmp_path


def bert_flags(root, data=None, config=None, vocab=None):
    return ["--task", "bert", "--data", data or root / "data", "--config_file",
            config or root / "config.json", "--dict", vocab or root / "vocab.txt",
            "--max-sentences", 4, "--max-update", 1, "--disable-validation"]


def _missing_data(root):
    return bert_flags(root, data=root / "nowhere"), "not a directory"


def _empty_data(root):
    (root / "empty").mkdir()
    return bert_flags(root, data=root / "empty"), "holds no .hdf5 shards"


def _corrupt_shard(root):
    (root / "data" / "x_training_1.hdf5").write_bytes(b"\x89HDF garbage" * 100)
    return bert_flags(root), "is not a readable HDF5 file"


def _foreign_shard(root):
    import h5py
    with h5py.File(root / "data" / "x_training_1.hdf5", "w") as f:
        f["images"] = [1, 2, 3]
    return bert_flags(root), "lacks datasets"


def _config_not_json(root):
    (root / "bad.json").write_text("{hidden_size: 12,")
    return bert_flags(root, config=root / "bad.json"), "is not valid JSON"


def _config_missing(root):
    return bert_flags(root, config=root / "none.json"), "cannot read it"


def _config_inconsistent(root):
    (root / "odd.json").write_text(json.dumps({"vocab_size": 50, "hidden_size": 30,
                                               "num_attention_heads": 4}))
    return bert_flags(root, config=root / "odd.json"), "not a multiple of num_attention_heads"


def _vocab_mismatch(root):
    (root / "big.txt").write_text("\n".join(f"t{i}" for i in range(80)) + "\n")
    return bert_flags(root, vocab=root / "big.txt"), "has 80 tokens but"


def _save_dir_not_writable(root):
    (root / "a_file").write_text("x")
    return [*bert_flags(root), "--save-dir", root / "a_file" / "ckpt"], "cannot be created"


def _truncated_checkpoint(root):
    (root / "ck").mkdir()
    torch.save({"format": "hetseq-checkpoint-1", "w": torch.zeros(1000)}, root / "ck" / "c.pt")
    data = (root / "ck" / "c.pt").read_bytes()
    (root / "ck" / "checkpoint_last.pt").write_bytes(data[:len(data) // 2])
    return [*bert_flags(root), "--save-dir", root / "ck"], "cannot be read"


def _foreign_checkpoint(root):
    (root / "ck").mkdir()
    torch.save({"state_dict": {}}, root / "ck" / "checkpoint_last.pt")
    return [*bert_flags(root), "--save-dir", root / "ck"], "is not a HetSeq checkpoint"


def _checkpoint_of_another_model(root):
    assert run_train(*TOY, "--max-sentences", 8, "--max-update", 1, "--save-dir",
                     root / "ck").returncode == 0
    return [*bert_flags(root), "--save-dir", root / "ck"], "does not fit this run"


def _checkpoint_of_another_size(root):
    """The message counts what differs and names one tensor of each kind, on one line."""
    assert run_train(*bert_flags(root), "--save-dir", root / "ck").returncode == 0
    (root / "wide.json").write_text(json.dumps({**json.loads((root / "config.json").read_text()),
                                                "intermediate_size": 40}))
    return [*bert_flags(root, config=root / "wide.json"), "--save-dir", root / "ck"], \
        "tensor(s) of another shape, e.g. "


def _checkpoint_of_another_optimizer(root):
    """Adam's state loads into Adadelta without complaint and failed at the
    first step (KeyError: 'rho'); it is refused before training, with the fix."""
    assert run_train(*bert_flags(root), "--save-dir", root / "ck").returncode == 0
    return [*bert_flags(root), "--max-update", 2, "--optimizer", "adadelta", "--save-dir",
            root / "ck"], "saved by another optimizer than --optimizer adadelta (it has no 'rho')"


def _misspelt_flag(root):
    return [*bert_flags(root), "--max-sentence", 4], "did you mean --max-sentences?"


def _unknown_scheduler(root):
    return [*bert_flags(root), "--lr-scheduler", "warmup_magic"], "unknown LR scheduler"


CASES = [_missing_data, _empty_data, _corrupt_shard, _foreign_shard, _config_not_json,
         _config_missing, _config_inconsistent, _vocab_mismatch, _save_dir_not_writable,
         _truncated_checkpoint, _foreign_checkpoint, _checkpoint_of_another_model,
         _checkpoint_of_another_size, _checkpoint_of_another_optimizer, _misspelt_flag,
         _unknown_scheduler]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_input_gives_one_clear_message(bert, case):
    flags, words = case(bert)
    result = run_train(*flags, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert words in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert words in result.stderr.strip().splitlines()[-1], "not on the last line"


def test_valid_setup_of_these_cases_trains(bert):
    result = run_train(*bert_flags(bert), "--no-save")
    assert result.returncode == 0, result.stderr[-3000:]
