#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) in one run of about 8 minutes
# on a machine with one CUDA GPU and torch already installed (nothing is
# installed here). Every step has its own time limit and its own log under
# $OUT (default ./gpu-out), so one step that fails or hangs costs only itself.
#   bash bench/gpu_checklist.sh          # HETSEQ_CACHE: a prebuilt demo corpus, if any
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# A step that hangs is ended with SIGABRT: faulthandler prints every thread's stack.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.log"; }

log "machine"
{ nvidia-smi -L; $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } \
  >>"$OUT/summary.log" 2>&1
# Build the demo corpus once, before steps that would all wait on its lock.
timeout -s ABRT 60 $PY -c "from hetseq.bert import demo; print(demo.pretraining_data())" \
  >>"$OUT/summary.log" 2>&1

# 1. The CUDA tests. The memory-probe test fills the card on purpose, so it
#    runs alone; the rest run in 4 workers beside steps 3 and 4 (functional
#    runs that time nothing).
log "1a. memory-probe test alone"
timeout -s ABRT 90 $PY -m pytest -p no:cacheprovider -o addopts="" -rA tests/test_cuda.py \
  -k memory_probe >"$OUT/pytest.log" 2>&1; echo "rc=$?" >>"$OUT/pytest.log"

log "1b. every CUDA test, beside 3 (GPU + CPU ranks, 300 updates) and 4 (a tenth of the card)"
timeout -s ABRT 170 $PY -m pytest -p no:cacheprovider -o addopts="" -rA -n 4 --dist load tests/ \
  -k "cuda and not memory_probe" >>"$OUT/pytest.log" 2>&1 &
TESTS=$!

# 3. One GPU rank and one CPU rank, --capacity auto, the default BERT for 300
#    updates: the plan chosen, and how often the checksum found the ranks
#    apart (they round differently) and resynced.
PORT=29517
COMMON=(train.py --task bert --max-update 300 --capacity auto --global-batch-size 64
        --lr 5e-4 --warmup-updates 10 --distributed-backend gloo --distributed-world-size 2
        --distributed-init-method tcp://127.0.0.1:$PORT --no-progress-bar --log-interval 50
        --no-save --disable-validation --divergence-check-interval 10)
(timeout -s ABRT 160 $PY "${COMMON[@]}" --distributed-rank 0 >"$OUT/drift.log" 2>&1;
 echo "rank0 rc=$?" >>"$OUT/drift.log") &
DRIFT=$!
(OMP_NUM_THREADS=8 timeout -s ABRT 160 $PY "${COMMON[@]}" --distributed-rank 1 --cpu \
  >"$OUT/drift_cpu.log" 2>&1; echo "rank1 rc=$?" >>"$OUT/drift_cpu.log") &
DRIFT_CPU=$!

# 4. --capacity auto under set_per_process_memory_fraction(0.1) (a card of
#    a tenth of the memory): BERT-base on the demo corpus must not run out.
$PY - <<'EOF' >>"$OUT/summary.log" 2>&1
import json
from hetseq.bert import demo
config = json.load(open(demo.pretraining_data().config))
config.update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
              intermediate_size=3072)
json.dump(config, open("/tmp/bert_base_demo_vocab.json", "w"))
EOF
log "4. BERT-base, --capacity auto, a tenth of the card"
timeout -s ABRT 120 $PY -c "
import runpy, sys, torch
torch.cuda.set_per_process_memory_fraction(0.1, 0)
sys.argv = ['train.py', '--task', 'bert', '--config_file', '/tmp/bert_base_demo_vocab.json',
            '--capacity', 'auto', '--global-batch-size', '1024', '--max-update', '4', '--bf16',
            '--distributed-world-size', '1', '--no-save', '--disable-validation',
            '--no-progress-bar', '--log-interval', '1']
runpy.run_path('train.py', run_name='__main__')
print('peak GiB', torch.cuda.max_memory_allocated(0) / 2**30)
" >"$OUT/memfrac.log" 2>&1; echo "rc=$?" >>"$OUT/memfrac.log"
wait $DRIFT $DRIFT_CPU $TESTS

# 2. Timings, one at a time: the bench, then the main job (fp32, bf16, fp16).
log "2. bench/gpu.py (speed, MFU, the memory probe, --compile)"
timeout -s ABRT 200 $PY bench/gpu.py --out "$OUT/gpu.json" >"$OUT/gpu.err" 2>&1
echo "rc=$?" >>"$OUT/gpu.err"
for precision in "" --bf16 --fp16; do
  log "2. main job ${precision:-fp32}"
  timeout -s ABRT 60 $PY train.py --task bert --max-update 60 --max-sentences 16 --lr 5e-4 \
    --warmup-updates 10 --distributed-world-size 1 --no-progress-bar --log-interval 10 \
    --no-save $precision >>"$OUT/main.log" 2>&1; echo "rc=$?" >>"$OUT/main.log"
done
log "5. bench/dropout.py on the GPU"
timeout -s ABRT 60 $PY bench/dropout.py --device cuda --batch 128 \
  >>"$OUT/gpu.err" 2>&1
log "done"
