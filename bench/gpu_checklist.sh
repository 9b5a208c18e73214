#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) as one call of at most 8
# minutes on a machine with one CUDA GPU and torch installed (nothing is
# installed here). Every step has its own time limit (they add up to 470 s)
# and its own files under $OUT (default ./gpu-out), each written the moment
# a figure is measured, so a step that fails, hangs or is cut off costs only
# itself. Nothing runs here that a CPU can check (bench/kernel_report.py
# reads the kernels' SASS on a CPU); the kernels' tiles are pinned
# (hetseq/keyed/kernels/flash.py), never tuned here.
#   bash bench/gpu_checklist.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# A step that hangs is ended with SIGABRT: faulthandler prints every thread's stack.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_DEFAULT_FP_FUSION=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.log"; }
goals() {  # the ratios of a JSON file, each against its goal, into the summary
  $PY - "$1" <<'PYEOF' >>"$OUT/summary.log" 2>&1
import json, sys
result = json.load(open(sys.argv[1]))
tables = result["tables"]
for table in (tables.values() if isinstance(tables, dict) else tables):
    for name, value in table.get("ratios", {}).items():
        print(f"   seq {table.get('seq', '')} {name}: {value}")
PYEOF
}

log "0. machine (limit 30 s)"
timeout -s ABRT 30 $PY - <<'PYEOF' >>"$OUT/summary.log" 2>&1
import json, subprocess, torch, triton
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))
from hetseq.bert import demo
config = json.load(open(demo.pretraining_data().config))
config.update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
              intermediate_size=3072, vocab_size=30522)
json.dump(config, open("/tmp/bert_base_demo.json", "w"))
print("demo corpus and /tmp/bert_base_demo.json ready")
PYEOF

# 1. The side-by-side step table (issue 46's goals), sequence 128 then 512,
#    each in its own process, its file rewritten after every round.
log "1a. step table, BERT-base bf16, sequence 128, batch 256 (limit 110 s)"
timeout -s ABRT 110 $PY bench/step_table.py --seq 128 --batch 256 --rounds 3 --steps 3 \
  --out "$OUT/table_128.json" >"$OUT/table_128.log" 2>&1; echo "rc=$?" >>"$OUT/table_128.log"
goals "$OUT/table_128.json"
log "1b. step table, sequence 512, batch 64 (limit 100 s)"
timeout -s ABRT 100 $PY bench/step_table.py --seq 512 --batch 64 --rounds 3 --steps 3 \
  --out "$OUT/table_512.json" >"$OUT/table_512.log" 2>&1; echo "rc=$?" >>"$OUT/table_512.log"
goals "$OUT/table_512.json"

# 2. The keyed kernels alone against torch's flash SDPA (no dropout, no
#    mask; goals 1.3x at 512, 1.5x at 128), and keyed dropout against torch's.
log "2. keyed attention and dropout against flash SDPA (limit 50 s)"
timeout -s ABRT 50 $PY bench/attention_kernels.py --seq 128 512 --out "$OUT/kernels.json" \
  >"$OUT/kernels.log" 2>&1; echo "rc=$?" >>"$OUT/kernels.log"
goals "$OUT/kernels.json"

# 3. What only a GPU can check: the CUDA tests, the kernels' tests on the
#    card (masks bit for bit, gradients against the explicit path; fp32 on
#    the kernels under HETSEQ_KERNELS=triton), no compile tests.
log "3. CUDA tests and the kernels' tests on the GPU (limit 90 s)"
timeout -s ABRT 90 $PY -m pytest -p no:cacheprovider -o addopts="" -rA -n 4 --dist load \
  tests/system/test_cuda.py tests/unit/keyed/test_kernels.py tests/system/test_kernels.py -k "not compiled and not step_table" \
  >"$OUT/pytest.log" 2>&1; echo "rc=$?" >>"$OUT/pytest.log"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3 >>"$OUT/summary.log"

# 4. The main job end to end at the bench's batch, then with a CPU rank
#    beside the GPU (gloo, --capacity auto): goal >= 0.97 of the GPU alone.
log "4a. main job, BERT-base bf16 batch 256 (limit 45 s)"
timeout -s ABRT 45 $PY train.py --task bert --config_file /tmp/bert_base_demo.json --bf16 \
  --max-sentences 256 --max-update 30 --lr 1e-4 --warmup-updates 5 --distributed-world-size 1 \
  --no-progress-bar --log-interval 10 --no-save --disable-validation >"$OUT/main.log" 2>&1
echo "rc=$?" >>"$OUT/main.log"
grep -E "samples_per_s|update 30" "$OUT/main.log" | tail -2 >>"$OUT/summary.log"
log "4b. GPU + a CPU rank, --capacity auto, global batch 256 (limit 45 s)"
PORT=29631
COMMON4="--task bert --config_file /tmp/bert_base_demo.json --bf16 --capacity auto
  --global-batch-size 256 --max-update 30 --lr 1e-4 --warmup-updates 5 --no-progress-bar
  --log-interval 10 --no-save --disable-validation --distributed-backend gloo
  --distributed-world-size 2 --distributed-gpus 1 --distributed-init-method tcp://127.0.0.1:$PORT"
timeout -s ABRT 45 $PY train.py $COMMON4 --distributed-rank 0 >"$OUT/gpu_cpu.log" 2>&1 &
GPU_PID=$!
timeout -s ABRT 45 $PY train.py $COMMON4 --distributed-rank 1 --cpu >"$OUT/gpu_cpu.1.log" 2>&1
wait $GPU_PID; echo "rc=$?" >>"$OUT/gpu_cpu.log"
grep -E "sits out|pays for|links to rank 0|samples_per_s|update 30" "$OUT/gpu_cpu.log" | tail -5 \
  >>"$OUT/summary.log"
log "done"
