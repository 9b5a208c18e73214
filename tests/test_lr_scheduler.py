import math

import pytest
import torch

from hetseq import cli
from hetseq.errors import UserError
from hetseq.optim import build_lr_scheduler

from conftest import TOY


def scheduler(*flags):
    args = cli.parse_args([*TOY, *map(str, flags)])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr[0])
    return build_lr_scheduler(args, opt), opt


def test_polynomial_decay_warmup_then_linear_to_end():
    s, opt = scheduler("--lr", 1.0, "--warmup-updates", 10, "--total-num-update", 110,
                       "--end-learning-rate", 0.1)
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.55)
    assert s.lr_at(500) == pytest.approx(0.1)
    s.step_update(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_polynomial_power():
    s, _ = scheduler("--lr", 1.0, "--total-num-update", 100, "--power", 2)
    assert s.lr_at(50) == pytest.approx(0.25)


def test_inverse_sqrt_and_cosine():
    s, _ = scheduler("--lr-scheduler", "inverse_sqrt", "--lr", 1.0, "--warmup-updates", 4)
    assert s.lr_at(2) == pytest.approx(0.5) and s.lr_at(16) == pytest.approx(0.5)
    c, _ = scheduler("--lr-scheduler", "cosine", "--lr", 1.0, "--total-num-update", 100)
    assert c.lr_at(50) == pytest.approx(0.5) and c.lr_at(100) == pytest.approx(0.0)
    assert c.lr_at(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_fixed_per_epoch_and_annealing():
    s, _ = scheduler("--lr-scheduler", "fixed", "--lr", "0.5,0.2", "--force-anneal", 2)
    lrs = []
    for epoch in (1, 2, 3):
        s.set_epoch(epoch)
        lrs.append(s.lr_at(100))
    assert lrs == pytest.approx([0.5, 0.2, 0.02])


def test_warmup_longer_than_schedule_is_rejected():
    with pytest.raises(UserError, match="--total-num-update 10 must exceed --warmup-updates 10"):
        scheduler("--warmup-updates", 10, "--total-num-update", 10)
