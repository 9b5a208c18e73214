"""Controller behaviour that needs no second process."""

import pytest
import torch
from torch import nn

from hetseq.app import cli
from hetseq.distributed.spawn import DistContext
from hetseq.base.errors import UserError
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


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_clipping_on_the_device_is_the_mean_loss_gradient_clipped(clip):
    """The norm and the clipping factor stay on the device (no host read
    before the step); the step is p - lr * min(1, clip / ||g||) g."""
    ctrl, task = controller(ModeTask, "--clip-norm", str(clip))
    ctrl._mode = lambda training: None
    ctrl.model.eval()
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(2)) * 10
    model = task.build_model().eval()
    (model(batch).sum() / 5).backward()
    grads = [q.grad for q in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
    factor = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
    expected = [p.detach() - 0.1 * factor * g for p, g in zip(ctrl.params, grads)]
    result = ctrl.train_step([batch], batch)
    assert result.grad_norm == pytest.approx(norm, rel=1e-6)
    for p, e in zip(ctrl.params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """torch's fused optimizers run on CPUs too: the CUDA path's logic, here."""
    from hetseq import optim
    monkeypatch.setattr(optim, "FUSED_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("clip", ["0", "0.5"])
def test_a_fused_optimizer_skips_a_non_finite_update_on_the_device(fused_on_cpu, optimizer, clip):
    """The flag goes to the optimizer, which skips on the device; the host
    counts the update as skipped, as without fusion."""
    ctrl, _ = controller(ModeTask, "--optimizer", optimizer, "--clip-norm", clip,
                         "--momentum", "0.9" if optimizer == "sgd" else "0")
    assert ctrl._fused
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    ctrl.train_step([batch], batch)
    before = ([p.detach().clone() for p in ctrl.params],
              {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
               for i, s in ctrl.optimizer.state_dict()["state"].items()})
    poisoned = batch.clone()
    poisoned[0, 0] = float("nan")
    result = ctrl.train_step([poisoned], poisoned)
    assert not result.updated and ctrl.num_updates == 1 and ctrl.failed_updates == 1
    assert all(torch.equal(p, q) for p, q in zip(ctrl.params, before[0]))
    state = ctrl.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], v) for i, s in before[1].items() for k, v in s.items())
    assert ctrl.train_step([batch], batch).updated and ctrl.num_updates == 2


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_non_finite_first_update_leaves_a_fused_optimizer_fresh(fused_on_cpu, optimizer):
    """Skipped before any step, the optimizer has no state yet: the next
    update is the first step of a fresh one (fused SGD, handed the flag on
    its first step, kept an uninitialised momentum buffer)."""
    flags = ["--optimizer", optimizer, "--momentum", "0.9" if optimizer == "sgd" else "0"]
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    poisoned = batch.clone()
    poisoned[1, 2] = float("inf")
    skipped, _ = controller(ModeTask, *flags)
    fresh, _ = controller(ModeTask, *flags)
    for ctrl in (skipped, fresh):
        ctrl._mode = lambda training: None
        ctrl.model.eval()
    assert not skipped.train_step([poisoned], poisoned).updated
    for ctrl in (skipped, fresh):
        assert ctrl.train_step([batch], batch).updated
    for ctrl in (skipped, fresh):
        assert ctrl.train_step([batch], batch).updated
    assert all(torch.equal(p, q) for p, q in zip(skipped.params, fresh.params))


@pytest.mark.parametrize("saver_fused", [False, True])
def test_a_loaded_state_keeps_this_ranks_own_kernels(monkeypatch, saver_fused):
    """A checkpoint of a GPU rank (fused) resumed on a CPU rank and back:
    the loader keeps the kernels built for its own parameters (and a fused
    one its step counts as float32 on their device)."""
    from hetseq import optim

    def build(fused):
        monkeypatch.setattr(optim, "FUSED_DEVICES", ("cpu",) if fused else ())
        return controller(ModeTask, "--optimizer", "adamw")[0]
    saver, loader = build(saver_fused), build(not saver_fused)
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))
    saver.train_step([batch], batch)
    loader.load_state_dict(saver.state_dict())
    group = loader.optimizer.param_groups[0]
    assert bool(group["fused"]) is (not saver_fused)
    for state in loader.optimizer.state.values():
        assert state["step"].dtype == torch.float32
    assert loader.train_step([batch], batch).updated


def test_a_fused_step_is_queued_before_the_host_reads_its_flag(fused_on_cpu):
    """On a GPU a host read waits for every kernel queued before it: the
    fused step goes first, so the one read of the update comes after it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ctrl, _ = controller(ModeTask, "--optimizer", "adamw", "--clip-norm", "1")
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    ctrl.train_step([batch], batch)       # the first step makes the optimizer's state
    apply = ctrl.apply_update
    ops = Ops()

    def watched(sample_size):
        with ops:
            return apply(sample_size)
    ctrl.apply_update = watched
    ctrl.train_step([batch], batch)
    reads = [i for i, name in enumerate(ops.names) if name.startswith("_local_scalar_dense")]
    steps = [i for i, name in enumerate(ops.names) if name.startswith("_fused_adamw")]
    assert len(reads) == 1 and steps and steps[0] < reads[0], ops.names
