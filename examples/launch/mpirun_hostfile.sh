#!/usr/bin/env bash
# CPU clusters started with mpirun and a hostfile (the Intel oneCCL workflow).
# HetSeq reads its rank from the MPI environment (OMPI_COMM_WORLD_* or PMI_*)
# and meets the other ranks at MASTER_ADDR:MASTER_PORT, the first host.
#
#   printf 'node1\nnode2\nnode3\nnode4\n' > hostfile
#   HOSTFILE=hostfile PPN=1 bash examples/launch/mpirun_hostfile.sh
#
# which runs, with Intel MPI or MPICH (as in Intel's recipes):
#   mpirun -f hostfile -n 4 -ppn 1 -genv MASTER_ADDR node1 -genv MASTER_PORT 29500 \
#     python train.py $HETSEQ_ARGS
# and with Open MPI:
#   mpirun --hostfile hostfile -np 4 --map-by ppr:1:node -x MASTER_ADDR -x MASTER_PORT \
#     python train.py $HETSEQ_ARGS
# Add --distributed-backend ccl to HETSEQ_ARGS once Intel's oneCCL bindings
# are installed (the error message without them says where they come from).
set -euo pipefail
: "${HOSTFILE:=hostfile}" "${PPN:=1}" "${MASTER_PORT:=29500}" "${PYTHON:=python}"
: "${HETSEQ_ARGS:=--task bert --cpu --max-sentences 16 --max-update 1000 --lr 0.0005 --warmup-updates 100 --total-num-update 1000 --save-dir checkpoints/bert-mpi}"
hosts=$(awk 'NF && $1 !~ /^#/ {print $1}' "$HOSTFILE")
: "${NP:=$(( $(echo "$hosts" | wc -l) * PPN ))}"
MASTER_ADDR=${MASTER_ADDR:-$(echo "$hosts" | head -n 1)}
export MASTER_ADDR MASTER_PORT OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / PPN ))}"
cd "$(dirname "$0")/../.."
# shellcheck disable=SC2086  # HETSEQ_ARGS is a list of flags
if mpirun --version 2>&1 | grep -q "Open MPI"; then
  exec mpirun --hostfile "$HOSTFILE" -np "$NP" --map-by "ppr:$PPN:node" \
    -x MASTER_ADDR -x MASTER_PORT -x OMP_NUM_THREADS "$PYTHON" train.py $HETSEQ_ARGS
else
  exec mpirun -f "$HOSTFILE" -n "$NP" -ppn "$PPN" -genv MASTER_ADDR "$MASTER_ADDR" \
    -genv MASTER_PORT "$MASTER_PORT" -genv OMP_NUM_THREADS "$OMP_NUM_THREADS" \
    "$PYTHON" train.py $HETSEQ_ARGS
fi
