"""--zero 0/1/2/3 and --cpu-offload: how the model, its gradients and its
optimizer state are spread over the ranks (DDP, ZeroRedundancyOptimizer,
FSDP2, and HetSeq's own shares by memory). Part of update/ (layer 8): it
imports the layers below and update's core (stats, precision), never the
Controller or the modes. Tests: tests/unit/update/, tests/system/test_sharding.py
and test_uneven.py."""
