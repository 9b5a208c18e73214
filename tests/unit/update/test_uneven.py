"""State shares by memory (--state-shares memory, hetseq/update/zero/uneven.py):
units gathered and freed as --zero 2/3 promise, a model whose even share
does not fit the small rank trains with shares by memory, the refusals.
Parity with one process in every mode: tests/system/test_parity.py; checkpoints
across shares and worlds: tests/system/test_sharding.py."""


import torch

from machinery.in_process import build_controller
from machinery.settings import EXACT_SGD


BLOCKS = [*EXACT_SGD, "--toy-blocks", 3]


def test_units_are_the_innermost_list_members_and_ties_go_to_the_root():
    from torch import nn
    from hetseq.update.zero.flat_units import units

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(2, 2)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ModuleList(
                [nn.Linear(2, 2)])) for _ in range(2))
            self.head = nn.Linear(2, 2)
            self.head.weight = self.blocks[0][0].weight      # a member's weight, and the root's
    model = Tied()
    names = {id(p): name for name, p in model.named_parameters()}
    found = [(type(unit).__name__, sorted(names[id(p)] for p in params))
             for unit, params in units(model)]
    assert found == [("Sequential", ["blocks.0.0.bias"]),
                     ("Sequential", ["blocks.1.0.bias", "blocks.1.0.weight"]),
                     ("Linear", ["blocks.0.1.0.bias", "blocks.0.1.0.weight"]),
                     ("Linear", ["blocks.1.1.0.bias", "blocks.1.1.0.weight"]),
                     ("Tied", ["blocks.0.0.weight", "emb.bias", "emb.weight", "head.bias"])]


def test_a_lone_process_trains_as_zero_0_whatever_its_shares():
    """One process: the whole state is its own; the flag changes nothing."""
    from hetseq.distributed.spawn import DistContext
    controller, _ = build_controller([*BLOCKS, "--zero", 3, "--state-shares", "memory"],
                                     DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
    assert controller.state_shares() == [None]
    assert controller.describe_sharding().startswith("--zero 0")
