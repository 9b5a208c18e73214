"""Controller behaviour that needs no second process."""

import pytest
import torch
from torch import nn

from hetseq import cli
from hetseq.distributed import DistContext
from hetseq.errors import UserError
from hetseq.tasks import Task
from hetseq.update.controller import Controller

CTX = DistContext(0, 1, 0, torch.device("cpu"))


class ModeTask(Task):
    """Records the model's mode at every loss; optionally skips backward."""

    skip_backward = False

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1))

    def loss(self, model, sample):
        self.modes.append(model.training)
        return model(sample).sum(), len(sample), {}

    def train_step(self, model, sample, backward=None):
        if not self.skip_backward:
            return super().train_step(model, sample, backward)
        loss, n, logs = self.loss(model, sample)
        loss.backward()
        return loss.detach(), n, logs


def controller(task_class=ModeTask, *flags):
    args, job, _ = cli.parse(["--task", "toy", "--user-dir", "tests/tasks", "--optimizer", "sgd",
                              "--lr", "0.1", "--lr-scheduler", "fixed", "--clip-norm", "0", *flags])
    task = task_class(args)
    task.modes = []
    return Controller(job, task, task.build_model(), CTX), task


def test_training_mode_returns_after_validation():
    ctrl, task = controller()
    batch = torch.ones(3, 4)
    ctrl.train_step([batch], batch)
    ctrl.valid_step(batch, type("Stats", (), {"add": lambda *a: None})())
    ctrl.train_step([batch], batch)
    assert task.modes == [True, False, True]
    assert all(m.training for m in ctrl.model.modules())


def test_task_that_bypasses_backward_gets_a_clear_error():
    ctrl, task = controller()
    task.skip_backward = True
    batch = torch.ones(3, 4)
    with pytest.raises(UserError, match="did not call the backward it was given"):
        ctrl.train_step([batch], batch)


@pytest.mark.parametrize("want_norm", [True, False])
def test_update_is_the_mean_loss_gradient_step(want_norm):
    # One process: the update must be p - lr * grad(mean loss), whether or not
    # the norm is read (it is measured after the update, on demand).
    ctrl, task = controller()
    ctrl.model.eval()                       # no dropout in the reference
    reference = [p.detach().clone() for p in ctrl.params]
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model = task.build_model().eval()
    (model(batch).sum() / 5).backward()
    expected = [p - 0.1 * q.grad for p, q in zip(reference, model.parameters())]
    ctrl._mode = lambda training: None      # keep eval mode through train_step
    result = ctrl.train_step([batch], batch)
    if want_norm:
        norm = torch.linalg.vector_norm(torch.cat([q.grad.reshape(-1)
                                                   for q in model.parameters()]))
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-6)
    for p, e in zip(ctrl.params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    ctrl.train_step([batch], batch)
    assert result.grad_norm is None        # an earlier update's gradient is gone
