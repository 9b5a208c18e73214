"""A regression task: tiny MLP with dropout, fixed synthetic data.

Parity tests need a task whose result depends only on which samples form each
global batch, never on how they were split across ranks. The hidden layer's
dropout (--toy-dropout, 0.2 by default) draws each sample's mask from its own
stream (hetseq/keyed/randomness.py), so every exactness test is one with dropout.
"""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from hetseq.base.errors import UserError
from hetseq.keyed.nn import Dropout
from hetseq.tasks import Task, register_task


class TanhDropout(nn.Module):
    """tanh, then dropout: one module, so the parameter names stay 0.* and 2.*."""

    def __init__(self, p):
        super().__init__()
        self.drop = Dropout(p)

    def forward(self, x):
        return self.drop(torch.tanh(x))


class Block(nn.Module):
    """A residual block's body: Linear, tanh, dropout; with ``spare_above``
    another Linear that only batches of more samples use (its parameters
    then get no gradient in some updates)."""

    def __init__(self, width, p, spare_above=None, nest=False):
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), TanhDropout(p)
        self.spare_above = spare_above
        self.spare = nn.Linear(width, width) if spare_above is not None else None
        # --toy-nest: a list inside the block, whose member is a unit of its own
        self.inner = nn.ModuleList([nn.Linear(width, width)] if nest else [])

    def forward(self, x):
        out = self.act(self.lin(x))
        if self.spare is not None and x.shape[0] > self.spare_above:
            out = out + self.spare(x)
        for layer in self.inner:
            out = out + torch.tanh(layer(out))
        return out


class Blocks(nn.Module):
    """--toy-blocks N: a Linear, N residual blocks in an nn.ModuleList (each a
    unit of its own under --zero 2/3, gathered and freed by itself), a Linear.
    --toy-tie: the root also runs a head whose weight is the first block's."""

    def __init__(self, width, blocks, p, spare_above=None, nest=False, tie=False):
        super().__init__()
        self.inp, self.act = nn.Linear(8, width), TanhDropout(p)
        self.blocks = nn.ModuleList(Block(width, p, spare_above, nest) for _ in range(blocks))
        self.head = nn.Linear(width, width) if tie else None
        if tie:
            self.head.weight = self.blocks[0].lin.weight
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        hidden = self.act(self.inp(x))
        for block in self.blocks:
            hidden = hidden + block(hidden)
        if self.head is not None:
            hidden = hidden + torch.tanh(self.head(hidden))
        return self.out(hidden)


class ToyData(Dataset):
    def __init__(self, size, seed, dtype=torch.float64):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 1, generator=g, dtype=torch.float64)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(size, 1, generator=g, dtype=torch.float64)
        self.x, self.y = self.x.to(dtype), self.y.to(dtype)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index], "index": index}


@register_task("toy")
class ToyTask(Task):
    # Each simulates something about one node (a slow device, a bug on one rank).
    per_node_flags = frozenset({"toy_slow_rank", "toy_slow_ms", "toy_slow_after",
                                "toy_perturb_after", "toy_nan_grad_after", "toy_log_indices",
                                "toy_nan_bias_grad_after", "toy_drift_rank", "toy_drift",
                                "toy_fail_after", "toy_dump_params", "toy_sample_ms",
                                "toy_slow_state_ms", "toy_hold_until", "toy_hold_from",
                                "toy_slow_while", "toy_log_forwards"})
    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--toy-size", type=int, default=100, help="samples in the train split")
        parser.add_argument("--toy-width", type=int, default=16, help="hidden units")
        parser.add_argument("--toy-blocks", type=int, default=0,
                            help="N residual hidden blocks in an nn.ModuleList (units of "
                                 "their own under --zero 2/3); 0: the plain MLP")
        parser.add_argument("--toy-spare-above", type=int, default=None, metavar="N",
                            help="with --toy-blocks: each block has a spare Linear that only "
                                 "micro-batches of more than N samples use")
        parser.add_argument("--toy-nest", action="store_true",
                            help="with --toy-blocks: each block holds an nn.ModuleList of one "
                                 "Linear (a unit inside a unit)")
        parser.add_argument("--toy-tie", action="store_true",
                            help="with --toy-blocks: a head in the root whose weight is the "
                                 "first block's (a weight tied between a unit and the root)")
        parser.add_argument("--toy-dtype", choices=["float64", "float32"], default="float64",
                            help="float64: only the order of summation differs between runs "
                                 "(exact comparisons); float32: what autocast acts on")
        parser.add_argument("--toy-dropout", type=float, default=0.2,
                            help="dropout on the hidden layer while training")
        parser.add_argument("--toy-mean-loss", action="store_true",
                            help="return the per-rank MEAN loss with sample_size 1: the "
                                 "controller then averages ranks with equal weights (plain DDP)")
        parser.add_argument("--toy-slow-rank", type=int, default=-1,
                            help="this rank sleeps --toy-slow-ms per sample in training")
        parser.add_argument("--toy-slow-ms", type=float, default=4.0)
        parser.add_argument("--toy-sample-ms", type=float, default=0.0,
                            help="every rank of this node sleeps this long per training sample "
                                 "(a device of that speed whatever its rank: elastic tests)")
        parser.add_argument("--toy-slow-state-ms", type=float, default=0.0,
                            help="the model's state_dict (a checkpoint save) prints 'toy: state "
                                 "of N updates' and then takes this long (a slow disk)")
        parser.add_argument("--toy-hold-until", metavar="PATH",
                            help="this node's training steps wait until PATH exists (a test "
                                 "holds a job at its first update while something happens)")
        parser.add_argument("--toy-hold-from", type=int, default=1, metavar="N",
                            help="--toy-hold-until holds from this node's train_step call N on "
                                 "(a job held after a few updates); a held rank prints 'toy: "
                                 "rank R holds at call N'")
        parser.add_argument("--toy-slow-while", metavar="PATH",
                            help="while PATH exists, each of this node's training steps takes "
                                 "1 s more (a test keeps a job updating, slowly, until "
                                 "something has happened)")
        parser.add_argument("--toy-slow-after", type=int, default=0,
                            help="start sleeping after this many train_step calls")
        parser.add_argument("--toy-perturb-after", type=int, default=0,
                            help="after N train_step calls, nudge a parameter on this rank only")
        parser.add_argument("--toy-drift-rank", type=int, default=-1,
                            help="this rank's parameters move by --toy-drift (relative) at "
                                 "every train_step, as a device that rounds differently")
        parser.add_argument("--toy-drift", type=float, default=1e-7)
        parser.add_argument("--toy-nan-after", type=int, default=0,
                            help="after N train_step calls, every loss is NaN")
        parser.add_argument("--toy-nan-grad-after", type=int, default=0,
                            help="after N train_step calls, rank 1's gradients are NaN while "
                                 "its loss stays finite")
        parser.add_argument("--toy-nan-bias-grad-after", type=int, default=0,
                            help="after N train_step calls, this node's rank 1 gets a NaN "
                                 "gradient in the output bias only (one shard under --zero 3)")
        parser.add_argument("--toy-fail-after", type=int, default=0,
                            help="after N train_step calls, this node stops with a user error "
                                 "(as on data only this node holds)")
        parser.add_argument("--toy-log-indices", metavar="PATH",
                            help="append the indices each rank trains to PATH.<rank>")
        parser.add_argument("--toy-log-forwards", metavar="PATH",
                            help="append a line per training forward (its samples and weight, "
                                 "padding included) to PATH.<rank>")
        parser.add_argument("--toy-dump-params", metavar="PATH",
                            help="each training forward writes this rank's parameters to "
                                 "PATH.<rank> (the last write: before the last update)")
        parser.add_argument("--toy-plain-backward", action="store_true",
                            help="override train_step and call backward(loss) without stats")

    def load_dataset(self, split):
        return ToyData(self.args.toy_size if split == "train" else 30,
                       seed=1 if split == "train" else 2, dtype=getattr(torch, self.args.toy_dtype))

    def build_model(self):
        torch.manual_seed(0)
        width = self.args.toy_width
        model = Blocks(width, self.args.toy_blocks, self.args.toy_dropout,
                       self.args.toy_spare_above, self.args.toy_nest, self.args.toy_tie) \
            if self.args.toy_blocks else \
            nn.Sequential(nn.Linear(8, width), TanhDropout(self.args.toy_dropout),
                          nn.Linear(width, 1))
        model = model.to(getattr(torch, self.args.toy_dtype))
        if self.args.toy_nan_bias_grad_after:
            model[2].register_forward_hook(self._nan_bias_grad)
        if self.args.toy_slow_state_ms:
            model._register_state_dict_hook(self._slow_state)
        return model

    def _slow_state(self, module, state, prefix, local_metadata):
        print(f"toy: state after {getattr(self, 'calls', 0)} train steps", file=sys.stderr,
              flush=True)
        time.sleep(self.args.toy_slow_state_ms / 1000)

    def _nan_bias_grad(self, module, inputs, output):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 1 and torch.is_grad_enabled() and \
                getattr(self, "calls", 0) > self.args.toy_nan_bias_grad_after:
            # module.bias is the parameter the forward used (FSDP: the gathered one).
            module.bias.register_hook(lambda grad: grad * float("nan"))

    def loss(self, model, sample):
        if self.args.toy_dump_params and torch.is_grad_enabled():
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            torch.save([p.detach().clone() for p in model.parameters()],
                       f"{self.args.toy_dump_params}.{rank}")
        err = model(sample["x"]) - sample["y"]
        calls = getattr(self, "calls", 0)
        if self.args.toy_nan_after and calls > self.args.toy_nan_after:
            err = err * float("nan")
        if self.args.toy_nan_grad_after and calls > self.args.toy_nan_grad_after and \
                torch.distributed.is_initialized() and torch.distributed.get_rank() == 1 and \
                torch.is_grad_enabled():
            err.register_hook(lambda grad: grad * float("nan"))
        if self.args.toy_mean_loss:
            return (err ** 2).mean(), 1, {"seen": len(err)}
        return (err ** 2).sum(), len(err), {"seen": len(err)}

    def train_step(self, model, sample, backward=None):
        self.calls = getattr(self, "calls", 0) + 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if (self.args.toy_hold_until and self.calls >= self.args.toy_hold_from
                and not os.path.exists(self.args.toy_hold_until)):
            print(f"toy: rank {rank} holds at call {self.calls}", file=sys.stderr, flush=True)
        while (self.args.toy_hold_until and self.calls >= self.args.toy_hold_from
               and not os.path.exists(self.args.toy_hold_until)):
            time.sleep(0.02)
        if self.args.toy_slow_while and os.path.exists(self.args.toy_slow_while):
            time.sleep(1.0)
        if self.args.toy_sample_ms:
            time.sleep(self.args.toy_sample_ms / 1000 * len(sample["x"]))
        if rank == self.args.toy_slow_rank and self.calls > self.args.toy_slow_after:
            time.sleep(self.args.toy_slow_ms / 1000 * len(sample["x"]))   # a slower device
        if self.args.toy_fail_after and self.calls > self.args.toy_fail_after:
            raise UserError(f"toy: this node's data ends at call {self.calls}")
        if self.args.toy_log_forwards:
            with open(f"{self.args.toy_log_forwards}.{rank}", "a") as log:
                log.write(f"{len(sample['x'])} {getattr(backward, 'weight', 1)}\n")
        if self.args.toy_log_indices and getattr(backward, "weight", 1):   # not padding
            with open(f"{self.args.toy_log_indices}.{rank}", "a") as log:
                log.write(" ".join(map(str, sample["index"].tolist())) + "\n")
        if rank == self.args.toy_drift_rank:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1 + self.args.toy_drift)
        if self.args.toy_perturb_after and self.calls == self.args.toy_perturb_after:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1.0   # outside the Controller
        if not self.args.toy_plain_backward:
            return super().train_step(model, sample, backward)
        loss, sample_size, logs = self.loss(model, sample)
        backward(loss)
        return loss.detach(), sample_size, logs
