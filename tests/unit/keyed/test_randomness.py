"""Randomness keyed by the sample (hetseq/keyed/randomness.py): the draws a sample
gets depend on (seed, epoch, its index, the call site) and nothing else."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetseq.keyed import randomness
from hetseq.keyed.kernels import philox, words
from hetseq.keyed.nn import Dropout


def reference_byte(key, site, call, coordinates):
    """One element's byte, on Python integers: Philox4x32-7 keyed by (the
    sample's key, the site's word for this call), counter (column // 16,
    row, the index before rows, a hash of the ones before), byte column % 16."""
    *lead, row, col = (0,) * (2 - len(coordinates)) + tuple(coordinates)
    rest = 0
    for index in lead[:-1]:
        rest = words.absorb32(rest, index)
    counter = (col // 16, row, lead[-1] if lead else 0, rest if len(lead) > 1 else 0)
    out = philox.philox(counter, (key % 2**32, philox.site_word(randomness._site_word(site),
                                                                  call)))
    return (out[col % 16 // 4] >> 8 * (col % 4)) & 0xFF


def test_philox_is_random123s_on_python_integers_and_on_tensors():
    """Random123's known answers (kat_vectors, philox4x32) at 7 and 10
    rounds, on Python integers and on int64 tensors, whose products wrap
    past 2**63 as the draw relies on."""
    known = {(7, (0,) * 6): (0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48),
             (7, (2**32 - 1,) * 6): (0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662),
             (10, (0,) * 6): (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8),
             (10, (2**32 - 1,) * 6): (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd),
             (10, (0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0)):
             (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)}
    for (rounds, words_in), expected in known.items():
        counter, key = words_in[:4], words_in[4:]
        assert philox.philox(counter, key, rounds) == expected
        tensors = philox.philox([torch.tensor([c]) for c in counter],
                                (torch.tensor([key[0]]), key[1]), rounds)
        assert tuple(int(t) for t in tensors) == expected


def test_the_draw_on_tensors_equals_the_draw_on_python_integers():
    """int32 and int64 tensors wrap on overflow and shift arithmetically:
    the modules mask what they must; this pins that they compute the
    functions they document, on every element of 1- to 4-D tensors."""
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
    site = philox.site_word(randomness._site_word("layer.dropout"), 2)
    for shape in [(40,), (3, 37), (2, 3, 20), (2, 2, 3, 17)]:
        drawn = philox.draw_bytes(keys, site, shape)
        for row, key in enumerate(keys.tolist()):
            for index in itertools.product(*map(range, shape)):
                assert drawn[(row,) + index].item() == \
                    reference_byte(key, "layer.dropout", 2, index), (shape, index)


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


@pytest.mark.parametrize("p", [0.1, 0.5, 0.7])
def test_masks_keep_one_minus_p_and_look_independent(p):
    """The keep probability drawn is 1 - round(256 p) / 256 (philox.cut);
    samples, positions, features and the bytes of one call (neighbours
    within 16 columns) show no correlation beyond chance."""
    kept = masks(list(range(64)), (128, 32), p=p).float()
    keep = 1 - philox.cut(p) / 256
    variance = keep * (1 - keep)
    assert abs(kept.mean().item() - keep) < 5 * (variance / kept.numel()) ** 0.5
    flat = kept.view(64, -1) - keep
    between_samples = (flat[:-1] * flat[1:]).mean().item() / variance
    between_features = (kept[..., :-1] - keep).mul(kept[..., 1:] - keep).mean().item() / variance
    between_calls = (kept[..., :16] - keep).mul(kept[..., 16:] - keep).mean().item() / variance
    assert max(abs(between_samples), abs(between_features), abs(between_calls)) < 0.01


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
