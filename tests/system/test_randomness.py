"""Randomness keyed by the sample (hetseq/keyed/randomness.py): the draws a sample
gets depend on (seed, epoch, its index, the call site) and nothing else.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/keyed/test_randomness.py."""


import pytest
import torch

from machinery.settings import require_module
from unit.keyed.test_randomness import alone


FP32_EXACT = 1e-5     # float32 sums in another order, after a few updates


SGD = ["--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed", "--clip-norm", "0",
       "--weight-decay", "0", "--disable-validation", "--no-save", "--seed", "7"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small BERT with dropout 0.1 (hidden and attention) on NVIDIA-format
    shards, and a GLUE pair task from a Hugging Face folder of it (classifier
    dropout too; batches padded to their own longest pair)."""
    from machinery.bert_files import TINY, write_corpus
    from machinery.bert_files import SPECIAL, WORDS, write_glue
    from hetseq.bert import BertConfig, BertForPreTraining, export_hf
    from hetseq.bert.preprocess import Settings, create_pretraining_data
    from hetseq.bert.tokenizer import WordPiece
    root = tmp_path_factory.mktemp("dropout-models")
    write_corpus(root / "a.txt", seed=3)
    vocab, _ = create_pretraining_data([root / "a.txt"], root / "shards", vocab_size=100,
                                       settings=Settings(max_seq_length=32,
                                                         max_predictions_per_seq=5,
                                                         dupe_factor=2, test_fraction=0.2),
                                       progress=False)
    with open(vocab) as f:
        vocab_size = sum(1 for _ in f)
    hf_vocab = root / "vocab.txt"
    hf_vocab.write_text("\n".join(SPECIAL + WORDS + [".", ","]) + "\n")
    write_glue(root / "glue", "mrpc", sizes=(("train", 40), ("dev", 8)))
    runs = {}
    for suffix, p in (("", 0.1), (" without dropout", 0.0)):
        dims = {**TINY, "hidden_dropout_prob": p, "attention_probs_dropout_prob": p}
        config, hf = root / f"bert{p}.json", root / f"hf{p}"
        BertConfig(vocab_size=vocab_size, **dims).to_json(config)
        torch.manual_seed(0)    # the same weights with and without dropout
        export_hf(BertForPreTraining(BertConfig(vocab_size=len(SPECIAL) + len(WORDS) + 2,
                                                **dims)),
                  str(hf), "BertForPreTraining", WordPiece.from_vocab(str(hf_vocab)))
        runs["bert" + suffix] = ["--task", "bert", "--data", root / "shards", "--config_file",
                                 config, "--dict", vocab, *SGD, "--max-update", 6]
        runs["glue" + suffix] = ["--task", "glue", "--data", root / "glue", "--glue-task",
                                 "mrpc", "--load-hf-weights", hf, "--max-seq-length", 32, *SGD,
                                 "--max-update", 4]
    return runs


@pytest.fixture(scope="module")
def split_runs(models, tmp_path_factory):
    from machinery.jobs import run_jobs
    jobs = [(f"{task} {a}+{b}", [[*models[task], "--max-sentences", a],
                                 [*models[task], "--max-sentences", b]])
            for task, a, b in (("bert", 6, 2), ("bert", 4, 4), ("glue", 6, 2))]
    # The state split 1:3 by memory (update/zero/uneven.py): BERT's layers are
    # units of their own, gathered and freed one at a time under --zero 3.
    jobs += [(f"bert 6+2 zero{zero} by memory", [
        [*models["bert"], "--zero", zero, "--max-sentences", batch, "--max-memory-gb", memory]
        for batch, memory in ((6, 0.1), (2, 0.3))]) for zero in (1, 3)]
    return run_jobs(2, jobs, tmp_path_factory.mktemp("dropout-jobs"))


# One update through the kernels (seconds a step in the interpreter): its
# weights hold the whole forward and backward of both ranks, dropout included.
KERNEL_UPDATES = ["--max-update", 1]


@pytest.fixture(scope="module")
def kernel_split_runs(models, tmp_path_factory):
    """The 6+2 splits with every draw made inside the Triton kernels (on a
    CPU in Triton's interpreter: conftest sets TRITON_INTERPRET=1)."""
    require_module("triton")
    from machinery.jobs import run_jobs
    jobs = [(f"{task} 6+2", [[*models[task], *KERNEL_UPDATES, "--max-sentences", 6],
                             [*models[task], *KERNEL_UPDATES, "--max-sentences", 2]])
            for task in ("bert", "glue")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HETSEQ_KERNELS", "triton")
        patch.setenv("TRITON_INTERPRET", "1")      # CPU ranks, on a GPU machine too
        return run_jobs(2, jobs, tmp_path_factory.mktemp("dropout-kernel-jobs"))


def largest_difference(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["bert 6+2", "bert 4+4", "glue 6+2", "bert 6+2 zero1 by memory",
                                  "bert 6+2 zero3 by memory"])
def test_dropout_models_split_over_ranks_match_one_process(models, split_runs, name):
    """BERT pretraining (hidden and attention dropout) and GLUE fine-tuning
    (classifier dropout, batches padded to their own longest pair) on two
    ranks of uneven or even shares: the weights of one process of 8, to
    float32's summation order. With masks drawn per rank (torch's dropout)
    they were 6e-3 apart after 6 updates."""
    task = name.split()[0]
    reference = alone(models[task])
    assert largest_difference(reference, split_runs[name].state["model"]) < FP32_EXACT
    if "zero3 by memory" in name:      # rank 1 held three times rank 0's share
        small, big = split_runs[name].state_bytes
        assert 2.9 < big / small < 3.1, (small, big)
    # The dropout took part: without it the same run lands elsewhere.
    without = alone(models[f"{task} without dropout"])
    assert largest_difference(reference, without) > 100 * FP32_EXACT


@pytest.mark.parametrize("name", ["bert 6+2", "glue 6+2"])
def test_dropout_models_split_over_ranks_through_the_kernels_match_one_process(
        models, kernel_split_runs, name):
    """The same through the kernels that draw inside (attention flash-style,
    elementwise dropout in one pass): the weights of one process of 8
    trained through the torch path, so the two paths draw the same masks
    and a CPU node and a GPU node of one job train one model."""
    reference = alone([*models[name.split()[0]], *KERNEL_UPDATES])
    assert largest_difference(reference, kernel_split_runs[name].state["model"]) < FP32_EXACT
