import math

import pytest
import torch

from hetseq.app import cli
from hetseq.base.errors import UserError
from hetseq.optim import build_lr_scheduler

from machinery.settings import TOY


def scheduler(*flags):
    _, job, _ = cli.parse([*TOY, *map(str, flags)])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=job.schedule.lr[0])
    return build_lr_scheduler(job.schedule, opt, job.training.max_update), opt


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
    with pytest.raises(UserError, match="--total-num-update 10 must exceed the 10 warm-up updates"):
        scheduler("--warmup-updates", 10, "--total-num-update", 10)


def test_decay_ends_with_the_planned_run_and_warmup_ratio_follows_it():
    from hetseq.optim.lr_scheduler import planned_updates
    # --total-num-update 0 (the default of tasks bert and glue): the planned updates.
    s, _ = scheduler("--lr", 1.0, "--max-update", 100, "--warmup-ratio", 0.1,
                     "--total-num-update", 0)
    assert s.warmup == 10 and s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(100) > 0 and s.lr_at(101) == 0.0   # the last update still learns
    # --max-epoch: the Run tells the schedule the run's length once the data is known.
    _, job, _ = cli.parse([*TOY, "--max-epoch", "3", "--update-freq", "2,1"])
    assert planned_updates(job.training, steps_per_epoch=9) == 5 + 9 + 9
    s, _ = scheduler("--lr", 1.0, "--max-epoch", 3, "--warmup-ratio", 0.1, "--total-num-update", 0)
    s.set_horizon(200)
    assert (s.warmup, s.total) == (20, 201)
    # Other tasks keep fairseq's fixed horizon, so a resumed run with a larger
    # --max-update keeps its schedule.
    s, _ = scheduler("--lr", 1.0, "--max-update", 100)
    assert s.total == 1000000
    # An explicit --warmup-updates wins over a (task's default) ratio; so does --total-num-update.
    s, _ = scheduler("--lr", 1.0, "--max-update", 100, "--warmup-ratio", 0.1,
                     "--warmup-updates", 3, "--total-num-update", 50)
    assert (s.warmup, s.total) == (3, 50)


def test_bad_warmup_ratio():
    with pytest.raises(UserError, match="--warmup-ratio 1.5: expected a fraction"):
        scheduler("--warmup-ratio", 1.5)
