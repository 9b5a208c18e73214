#!/usr/bin/env bash
# torchrun on several nodes. Run this on every node, each with its own NPROC
# (processes: the node's GPUs, or CPU processes with --cpu) and BATCH (samples
# per process per step: bigger on faster devices). The node named in RDZV
# serves the rendezvous; ranks are given out by torchrun.
#
#   nodeA (4 GPUs):  NPROC=4 BATCH=64 RDZV=nodeA:29400 bash examples/launch/torchrun.sh
#   nodeB (2 GPUs):  NPROC=2 BATCH=24 RDZV=nodeA:29400 bash examples/launch/torchrun.sh
#
# which runs, on nodeA:
#   torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \
#     --rdzv-endpoint nodeA:29400 --rdzv-id hetseq train.py $HETSEQ_ARGS --max-sentences 64
set -euo pipefail
: "${RDZV:?set RDZV=HOST:PORT: the first node and a port free there}"
: "${NNODES:=2}" "${NPROC:=1}" "${BATCH:=32}" "${JOB_ID:=hetseq}" "${PYTHON:=python}"
: "${HETSEQ_ARGS:=--task bert --max-update 1000 --lr 0.0005 --warmup-updates 100 --total-num-update 1000 --save-dir checkpoints/bert-torchrun}"
cd "$(dirname "$0")/../.."
# python -m torch.distributed.run is torchrun, from whichever python runs HetSeq.
# shellcheck disable=SC2086  # HETSEQ_ARGS is a list of flags
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "$JOB_ID" \
  train.py $HETSEQ_ARGS --max-sentences "$BATCH"
