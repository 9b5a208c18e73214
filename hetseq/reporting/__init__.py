"""What people see: progress, meters, TensorBoard, balance.jsonl, the plot
and hetseq-status. The logging basics that start-up needs too are in
hetseq/base/logs.py, below every layer."""
