"""Randomness keyed by the sample (hetseq/randomness.py): the draws a sample
gets depend on (seed, epoch, its index, the call site) and nothing else."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import require_module
from hetseq import randomness
from hetseq.kernels import words
from hetseq.nn import Dropout


def reference_bits(key, site, call, coordinates):
    """One element's 32 bits, on Python integers: what the tensors must give."""
    site_key = words.absorb32(words.absorb32(key % 2**32, randomness._site_word(site)), call)
    word = 0
    for index in coordinates:
        word = words.absorb32(word, index)
    return words.signed(words.absorb32(word, site_key))


def test_the_hash_on_tensors_equals_the_hash_on_python_integers():
    """int32 tensors wrap on overflow and shift arithmetically: the module
    masks the shifts; this pins that it computes the function it documents."""
    values = torch.tensor([0, 1, -1, 2**31 - 1, -2**31, 123456789, -987654321], dtype=torch.int32)
    mixed = words.mix_(values.clone()).tolist()
    assert mixed == [words.signed(words.mix32(v)) for v in values.tolist()]
    indices = [0, 7, 2**32 + 5, 10**12]
    expected = []
    for index in indices:
        state = 0
        for word in (123, 0, 4, index % 2**32, index >> 32):
            state = words.absorb32(state, word)
        expected.append(words.signed(state))
    assert randomness.sample_keys(123, 4, indices).tolist() == expected
    keys = randomness.sample_keys(1, 1, [3, 8])
    bits = randomness._bits(keys, "layer.dropout", 2, (3, 5), torch.device("cpu"))
    for row, key in enumerate(keys.tolist()):
        for i in range(3):
            for j in range(5):
                assert bits[row, i, j].item() == reference_bits(key, "layer.dropout", 2, (i, j))


def masks(indices, shape, site="s", call=0, seed=1, epoch=1, p=0.5):
    keys = randomness.sample_keys(seed, epoch, indices)
    with randomness.using(keys):
        for _ in range(call):
            randomness.dropout(torch.ones(len(indices), *shape), p, site)
        return randomness.dropout(torch.ones(len(indices), *shape), p, site) != 0


def test_a_samples_mask_does_not_depend_on_its_batch_or_its_padding():
    alone = masks([9], (4, 6, 6))[0]
    batched = masks([3, 9, 4], (4, 6, 6))[1]
    padded = masks([4, 9], (4, 11, 11))[1]     # the same sample padded to 11 positions
    assert torch.equal(alone, batched)
    assert torch.equal(alone, padded[:, :6, :6])
    assert not torch.equal(masks([3], (4, 6, 6))[0], alone)


def test_every_key_part_changes_the_draw():
    base = masks([5], (64,))
    for other in (masks([6], (64,)), masks([5], (64,), seed=2), masks([5], (64,), epoch=2),
                  masks([5], (64,), site="t"), masks([5], (64,), call=1)):
        assert not torch.equal(base, other)


def test_masks_keep_one_minus_p_and_look_independent():
    kept = masks(list(range(64)), (128, 32), p=0.1).float()
    n = kept.numel()
    assert abs(kept.mean().item() - 0.9) < 5 * (0.09 / n) ** 0.5
    # Samples, positions and features: no correlation beyond chance.
    flat = kept.view(64, -1) - 0.9
    between_samples = (flat[:-1] * flat[1:]).mean().item() / 0.09
    between_features = (kept[..., :-1] - 0.9).mul(kept[..., 1:] - 0.9).mean().item() / 0.09
    assert abs(between_samples) < 0.01 and abs(between_features) < 0.01


def test_the_gradient_flows_through_the_kept_elements_only():
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    with randomness.using(randomness.sample_keys(0, 1, [0, 1, 2])):
        y = randomness.dropout(x, 0.25, "s")
    keep = y != 0
    assert torch.allclose(y[keep], x[keep] / 0.75)
    y.sum().backward()
    assert torch.equal(x.grad, keep.double() / 0.75)


def test_the_mask_is_the_same_for_every_dtype():
    keys = randomness.sample_keys(0, 1, [0, 1])
    outs = []
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        with randomness.using(keys):
            outs.append(randomness.dropout(torch.ones(2, 50, dtype=dtype), 0.3, "s") != 0)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_outside_a_training_step_dropout_is_torchs():
    x = torch.ones(4, 100)
    torch.manual_seed(3)
    ours = Dropout(0.3, site="s")(x)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(x, 0.3, training=True))
    assert torch.equal(Dropout(0.3, site="s").eval()(x), x)


def test_helpers_for_a_tasks_own_draws_are_per_sample():
    def draws(indices):
        with randomness.using(randomness.sample_keys(2, 1, indices)):
            u = randomness.uniform("crop", (3,))
            g = randomness.generators("flip")
            return u, [torch.randint(0, 1000, (2,), generator=gen).tolist() for gen in g]
    (u1, g1), (u2, g2) = draws([4, 7]), draws([7])
    assert u1.shape == (2, 3) and 0 <= u1.min() and u1.max() < 1
    assert torch.equal(u1[1], u2[0]) and g1[1] == g2[0] and g1[0] != g1[1]
    with pytest.raises(RuntimeError, match="inside a training step"):
        randomness.uniform("crop", (3,))


def test_sites_are_named_after_the_modules_path_and_a_nameless_one_is_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(Dropout(0.5)), Dropout(0.5, site="mine"))
    randomness.name_sites(model)
    assert model[1][0].site == "1.0" and model[2].site == "mine"
    with randomness.using(randomness.sample_keys(0, 1, [0])):
        with pytest.raises(RuntimeError, match="without a site"):
            Dropout(0.5)(torch.ones(1, 3))
        with pytest.raises(ValueError, match="first dimension"):
            randomness.dropout(torch.ones(2, 3), 0.5, "s")


def test_a_checkpointed_forward_draws_again_what_it_drew_or_is_refused():
    """Activation checkpointing recomputes the forward inside backward: with
    checkpoint_context the recompute draws the forward's masks (the
    gradient of the plain forward); without it the draw is refused, never
    a different mask silently."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    layer, drop = nn.Linear(8, 8).double(), Dropout(0.5, site="block.drop")
    x = torch.randn(4, 8, dtype=torch.float64)

    def block(v):
        return drop(torch.tanh(layer(drop(v))))      # one module called twice

    def gradient(run):
        layer.zero_grad()
        with randomness.using(randomness.sample_keys(7, 1, [0, 1, 2, 3])):
            run(x).pow(2).sum().backward()
        return layer.weight.grad.clone()
    plain = gradient(block)
    replayed = gradient(lambda v: checkpoint(block, v, use_reentrant=False,
                                             context_fn=randomness.checkpoint_context))
    assert torch.equal(plain, replayed)
    with pytest.raises(RuntimeError, match="checkpoint_context"):
        gradient(lambda v: checkpoint(block, v, use_reentrant=False))


def test_dropout_is_a_drop_in_for_torchs():
    drop = Dropout(0.1, True)                 # torch's positional inplace
    assert isinstance(drop, nn.Dropout) and drop.inplace and drop.site is None
    with randomness.using(randomness.sample_keys(0, 1, [0, 1])):
        assert torch.equal(randomness.dropout(torch.ones(2, 9), 1 - 2 ** -40, "s"),
                           torch.zeros(2, 9))   # beyond 32 bits of p: nothing is kept


def test_evaluation_draws_nothing():
    from hetseq.bert import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=16,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=32), 2).eval()
    ids = torch.randint(1, 30, (3, 9))
    args = (ids, torch.zeros_like(ids), torch.ones_like(ids))
    with randomness.using(randomness.sample_keys(0, 1, [0, 1, 2])):
        first = model(*args)
    assert torch.equal(first, model(*args))


# ---- the built-in models: the same update whatever the split, dropout included ----

FP32_EXACT = 1e-5     # float32 sums in another order, after a few updates
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "fixed", "--clip-norm", "0",
       "--weight-decay", "0", "--disable-validation", "--no-save", "--seed", "7"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small BERT with dropout 0.1 (hidden and attention) on NVIDIA-format
    shards, and a GLUE pair task from a Hugging Face folder of it (classifier
    dropout too; batches padded to their own longest pair)."""
    from test_bert import TINY, write_corpus
    from test_glue import SPECIAL, WORDS, write_glue
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
    # The state split 1:3 by memory (update/uneven.py): BERT's layers are
    # units of their own, gathered and freed one at a time under --zero 3.
    jobs += [(f"bert 6+2 zero{zero} by memory", [
        [*models["bert"], "--zero", zero, "--max-sentences", batch, "--max-memory-gb", memory]
        for batch, memory in ((6, 0.1), (2, 0.3))]) for zero in (1, 3)]
    return run_jobs(2, jobs, tmp_path_factory.mktemp("dropout-jobs"))


@pytest.fixture(scope="module")
def kernel_split_runs(models, tmp_path_factory):
    """The 6+2 splits with every draw made inside the Triton kernels (on a
    CPU in Triton's interpreter: conftest sets TRITON_INTERPRET=1)."""
    require_module("triton")
    from machinery.jobs import run_jobs
    jobs = [(f"{task} 6+2", [[*models[task], "--max-sentences", 6],
                             [*models[task], "--max-sentences", 2]]) for task in ("bert", "glue")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HETSEQ_KERNELS", "triton")
        patch.setenv("TRITON_INTERPRET", "1")      # CPU ranks, on a GPU machine too
        return run_jobs(2, jobs, tmp_path_factory.mktemp("dropout-kernel-jobs"))


_ALONE = {}


def alone(argv):
    """One process of 8 through the torch path (the reference), once per argv."""
    from machinery.jobs import run_alone
    key = tuple(map(str, argv))
    if key not in _ALONE:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HETSEQ_KERNELS", "torch")
            _ALONE[key] = run_alone([*argv, "--max-sentences", 8])["model"]
    return _ALONE[key]


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
    reference = alone(models[name.split()[0]])
    assert largest_difference(reference, kernel_split_runs[name].state["model"]) < FP32_EXACT
