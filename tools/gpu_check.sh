#!/usr/bin/env bash
# The one prepared GPU check for a session lent an H100/H200 (run from the repo root):
#   OUT=/some/dir tools/gpu_check.sh
# 1) kernel tests, compiled (not interpret) where a test allows it, then the usual
#    interpret-mode suite; 2) the full benchmark, whose table lands in $OUT.
# Everything is logged under $OUT; the exit status is that of the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH=.
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1
  "$PY" -c 'import jax; print(jax.__version__, jax.devices())'
} > "$OUT/env.txt" 2>&1

# Compiled-mode smoke of every kernel on the GPU: short checks against the refs.
"$PY" - > "$OUT/compiled_check.txt" 2>&1 <<'PYEOF'
import numpy as np, jax, jax.numpy as jnp, sys
sys.path.insert(0, "tests")
from tests.kernels.test_paged_attention import _case, _SEQ_LENS, ref64
from pallas_kernels import paged_attention as pa, permute_blocks as pb
q, k, v, t = _case(0, dtype=jnp.bfloat16, group=4, seq_lens=_SEQ_LENS, head_dim=128,
                   block_size=16)
want = ref64(pa.ref_paged_attention, q, k, v, *t)
for impl in ("xla", "pallas"):
  try:
    out = np.asarray(pa.paged_attention(q, k, v, *t, impl=impl, num_splits=2)
                     .astype(jnp.float32))
    print("decode", impl, "max err", float(np.max(np.abs(out - want))))
  except Exception as e:  # report and continue: the table below still runs
    print("decode", impl, "FAILED", type(e).__name__, str(e)[:2000])
pages = jax.random.normal(jax.random.key(0), (4, 2, 64, 16, 128), jnp.bfloat16)
src = jnp.arange(32, 40, dtype=jnp.int32); dst = jnp.arange(0, 8, dtype=jnp.int32)
want = np.asarray(pb.ref_permute_blocks(pages, src, dst).astype(jnp.float32))
for impl in ("xla", "pallas", "mosaic"):
  try:
    out = pb.permute_blocks(jnp.array(pages), src, dst, impl=impl)
    print("permute", impl, "exact", bool(np.array_equal(
        np.asarray(out.astype(jnp.float32)), want)))
  except Exception as e:
    print("permute", impl, "FAILED", type(e).__name__, str(e)[:2000])
PYEOF

timeout 900 "$PY" -m pytest -q tests/test_kernels_paged_attention.py \
  tests/test_kernels_prefill_attention.py tests/test_kernels_permute_blocks.py \
  tests/test_kernels_mosaic_attention.py \
  > "$OUT/pytest.txt" 2>&1

timeout 1200 "$PY" examples/bench_kernels.py --out="$OUT/bench_table.md" \
  > "$OUT/bench_stdout.txt" 2>&1
rc=$?
# The Mosaic GPU decode kernel separately: it is verified only in interpret mode so far,
# and a lowering failure must not cost the table above.
timeout 600 "$PY" examples/bench_kernels.py --decode_impls=mosaic --permute_impls=mosaic \
  --out="$OUT/bench_table_mosaic.md" > "$OUT/bench_stdout_mosaic.txt" 2>&1 || true
tail -n 60 "$OUT/bench_stdout.txt"
exit $rc
