#!/usr/bin/env bash
# The one prepared GPU check for a session lent an H100/H200, sized for 15 minutes
# of device time: one command, under 8 minutes wall. From the repo root:
#   OUT=/some/dir tools/gpu_check.sh          # on the GPU machine
#   DRY=1 OUT=/tmp/x tools/gpu_check.sh       # anywhere: lowers, times nothing
# 1) the lowering tier on the CPU (JAX_PLATFORMS=cpu, no GPU time): every row of
#    step 2 lowered for cuda against an abstract H200 at its real shapes;
# 2) the timed rows (tools/gpu_check.py), cheapest first, each in its own
#    try/except, appended and flushed to $OUT/table.md as it ends, none started
#    after the global deadline. No pytest: interpret-mode tests say nothing about
#    the GPU and run in CI anyway.
# Exit status: that of step 2 (non-zero if any row failed or was wrong).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
DEADLINE_S="${DEADLINE_S:-300}"  # last row starts by then (step 2's clock)
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1
  "$PY" -c 'import jax; print(jax.__version__, jax.devices())' 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== 1) lowering tier (CPU) =="
JAX_PLATFORMS=cpu timeout 60 "$PY" tools/gpu_check.py --dry \
  --out="$OUT/table.md" 2>&1 | tee "$OUT/lowering_log.txt" | grep '^|\|failed'

if [ -n "${DRY:-}" ]; then
  echo "== 2) dry: timed rows lowered instead (CPU) =="
  JAX_PLATFORMS=cpu timeout 120 "$PY" tools/gpu_check.py --dry \
    --deadline_s="$DEADLINE_S" --out="$OUT/table.md" > "$OUT/timed_log.txt" 2>&1
  rc=$?
else
  echo "== 2) timed rows (GPU) =="
  timeout $((DEADLINE_S + 60)) "$PY" tools/gpu_check.py \
    --deadline_s="$DEADLINE_S" --out="$OUT/table.md" > "$OUT/timed_log.txt" 2>&1
  rc=$?
fi
echo "== table ($OUT/table.md) =="
cat "$OUT/table.md"
exit $rc
