"""BERT: preprocessing round trip, NVIDIA-format reading, model, training.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/bert/test_bert.py."""

import json
import re

import h5py
import numpy as np
import pytest
import torch

from machinery.commands import assert_ok, run_job, run_train
from machinery.settings import require_module
from hetseq.bert import BertConfig, BertForPreTraining, load_hf_weights
from hetseq.bert.preprocess import create_pretraining_data
from hetseq.bert.pretraining_data import BertH5Dataset, find_shards
from machinery.bert_files import TINY
from unit.bert.test_bert import shards  # noqa: F401,F811  (fixtures)
from machinery.bert_files import write_nvidia_shard


def test_same_seed_gives_identical_files(shards, tmp_path):
    # Vocab trained again from scratch, two worker processes: still byte-identical.
    again = tmp_path / "again"
    create_pretraining_data([shards["root"] / "a.txt", shards["root"] / "b.txt"], again,
                            vocab_size=120, settings=shards["settings"], num_workers=2,
                            progress=False)
    for name in ("vocab.txt", "corpus_train_0.hdf5", "corpus_test_1.hdf5"):
        assert (shards["dir"] / name).read_bytes() == (again / name).read_bytes()


def test_hand_made_nvidia_shard_trains(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_nvidia_shard(data / "books_wiki_en_corpus_training_0.hdf5", 40)
    write_nvidia_shard(data / "books_wiki_en_corpus_test_0.hdf5", 10, seed=1)
    (tmp_path / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(50)) + "\n")
    config = tmp_path / "bert_config.json"
    BertConfig(vocab_size=50, **TINY).to_json(config)
    result = run_train("--task", "bert", "--data", data, "--dict", tmp_path / "vocab.txt",
                       "--config_file", config, "--max-sentences", 8, "--max-update", 4,
                       "--valid-subset", "test", "--lr", 0.001, "--save-dir", tmp_path / "ck")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "valid on 'test'" in result.stderr and "mlm_accuracy=" in result.stderr


def test_two_ranks_with_different_batches_train_bert_and_export_under_zero3(shards, tmp_path):
    """Sharded parameters (--zero 3) are gathered for the export: the folder
    loads back here and in transformers, with the trained model's logits."""
    common = ["--task", "bert", "--data", shards["dir"], "--config_file", shards["config"],
              "--dict", shards["vocab"], "--max-update", 3, "--lr", 0.001, "--zero", 3,
              "--save-dir", tmp_path, "--export-hf", tmp_path / "hf"]   # rank 0 writes it
    results = run_job(common, [["--max-sentences", 6], ["--max-sentences", 2]])
    assert_ok(results)
    assert "global batch 8" in results[0][1]
    # --export-hf: a Hugging Face BertForPreTraining folder our loader reads back.
    config = BertConfig.from_json(str(tmp_path / "hf" / "config.json"))
    exported = BertForPreTraining(config)
    missing, unexpected = load_hf_weights(exported, str(tmp_path / "hf"))
    assert missing == [] and unexpected == []
    trained = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["controller"]["model"]
    assert all(torch.equal(v, trained[k]) for k, v in exported.state_dict().items())
    transformers = require_module("transformers")
    hf_model = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    sample = BertH5Dataset(find_shards(str(shards["dir"]), "train"), 5).collater(list(range(4)))
    with torch.no_grad():
        mlm, nsp = exported.eval()(sample["input_ids"], sample["segment_ids"],
                                   sample["input_mask"], sample["masked_lm_positions"])
        out = hf_model(input_ids=sample["input_ids"], token_type_ids=sample["segment_ids"],
                       attention_mask=sample["input_mask"])
    positions = sample["masked_lm_positions"][..., None].expand(-1, -1, config.vocab_size)
    # Float rounding only (our fused qkv GEMM).
    assert torch.allclose(torch.gather(out.prediction_logits, 1, positions), mlm, rtol=1e-5,
                          atol=1e-4)
    assert torch.allclose(out.seq_relationship_logits, nsp, rtol=1e-5, atol=1e-4)
    assert (tmp_path / "hf" / "vocab.txt").read_text() == open(shards["vocab"]).read()
    assert "rank 0 cpu" in results[0][1] and "batch 6 in 1 micro-batch" in results[0][1]
    assert "batch 2 in 1 micro-batch" in results[0][1]
    assert "valid on 'valid'" in results[0][1]   # 'valid' falls back to the test shards


def test_bert_alone_trains_the_demo_with_a_falling_loss(tmp_path):
    """`python train.py --task bert` with the task's own defaults (batch 32,
    lr 1e-4, ...); only the length is cut short here."""
    result = run_train("--task", "bert", "--max-update", 16, "--disable-validation", "--no-save",
                       env={"HETSEQ_CACHE": str(tmp_path)}, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no --data: pretraining on the built-in demo corpus" in result.stderr
    losses = [float(x) for x in re.findall(r"\| loss=([0-9.]+) \| mlm_loss", result.stderr)]
    assert len(losses) == 16
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    root = tmp_path / "bert-default-v2"
    config = json.loads((root / "bert_config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 256
    assert (root / "python_docs.txt").stat().st_size > 1_000_000
    assert find_shards(str(root / "shards"), "train") and find_shards(str(root / "shards"), "test")


def bert_job(tmp_path, damage):
    """A one-shard BERT run after ``damage(path)`` changed the training shard."""
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "wiki_training_0.hdf5"
    write_nvidia_shard(shard, 40)
    damage(shard)
    config = tmp_path / "bert_config.json"
    BertConfig(vocab_size=50, **TINY).to_json(config)
    return shard, run_train("--task", "bert", "--data", data, "--config_file", config,
                            "--max-sentences", 8, "--max-update", 2, "--disable-validation",
                            "--no-save")


def corrupt_chunk(key, which):
    """Store ``key`` in chunks of 8 rows, then overwrite the bytes of one
    compressed chunk (0: the first, read at start-up; -1: the last)."""
    def damage(path):
        with h5py.File(path, "r+") as f:
            data, dtype = f[key][()], f[key].dtype
            del f[key]
            f.create_dataset(key, data=data, dtype=dtype, compression="gzip",
                             chunks=(8,) + data.shape[1:])
        with h5py.File(path, "r") as f:
            dataset = f[key]
            assert dataset.id.get_num_chunks() == 5
            info = dataset.id.get_chunk_info(which % dataset.id.get_num_chunks())
        with open(path, "r+b") as raw:
            raw.seek(info.byte_offset + 2)
            raw.write(b"\xff" * max(1, info.size - 4))
    return damage


@pytest.mark.parametrize("key, which, when", [
    ("masked_lm_ids", 0, "start-up"),          # the first chunk is read at start-up
    ("input_ids", -1, "first read"),           # a later one when the shard is loaded
])
def test_corrupt_hdf5_chunk_names_shard_and_dataset(tmp_path, key, which, when):
    shard, result = bert_job(tmp_path, corrupt_chunk(key, which))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{shard}: dataset '{key}' cannot be read" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # Caught at start-up, or only once training began (the plan is logged first).
    assert ("capacity plan" in result.stderr) == (when == "first read"), result.stderr[-3000:]


def test_token_ids_outside_the_vocab_name_the_shard(tmp_path):
    def big_ids(path):
        with h5py.File(path, "r+") as f:
            ids = f["input_ids"][()]
            ids[3, 2] = 77
            f["input_ids"][...] = ids
    shard, result = bert_job(tmp_path, big_ids)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{shard}: dataset 'input_ids' holds token id 77, outside the vocab of 50" \
        in result.stderr, result.stderr[-3000:]
