"""The update must equal large-batch single-process training, whatever the split.

Tolerances. The toy model is float64 and the optimizer SGD, whose update is
linear in the gradient (Adam's is not: it would hide a wrong scale). Two runs
on the same samples then differ only in the order in which sums are taken:
about 1e-16 relative per operation, ~1e-14 on the parameters after 7
updates. ``EXACT`` (1e-10) leaves room for that and for nothing else: a wrong
scale (1/W, or W/N rounded in float32: 7.6e-9 after 6 updates, the bug #13
fixed), a sample counted twice or missed, all lie far above it.
"""

import torch


from machinery.in_process import build_controller
from machinery.parity import COMMON


def test_compile_traces_the_forward_and_keeps_the_parameter_names():
    """The parity above would also pass if --compile compiled nothing."""
    from torch._dynamo.utils import counters
    from hetseq.distributed.spawn import DistContext
    counters.clear()
    controller, task = build_controller([*COMMON, "--compile"],
                                        DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
    data = task.load_dataset("train")
    batch = {"x": data.x[:4], "y": data.y[:4]}
    controller.train_step([batch], batch)
    assert counters["stats"]["unique_graphs"] >= 1
    assert set(controller.state_dict()["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
