"""What people see: progress, meters, TensorBoard, balance.jsonl, the plot
and hetseq-status. The logging basics that start-up needs too are in
base/logs.py, in the bottom layer.
Layer 10: imports base, checkpoints, store, distributed.
Tests: tests/unit/reporting/, tests/system/."""
