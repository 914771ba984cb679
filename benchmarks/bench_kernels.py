"""Benchmark of the paged_kv kernels against the device's copy bandwidth.

The GPU session's check is `tools/gpu_check.sh` (rows flushed one by one,
deadline, dry mode); this script is the longer sweep over placements.

Usage:
  PYTHONPATH=. python3 benchmarks/bench_kernels.py                      # GPU, full
  PYTHONPATH=. python3 benchmarks/bench_kernels.py --interpret --small  # CPU smoke
  PYTHONPATH=. python3 benchmarks/bench_kernels.py --out=/tmp/table.md

Order: (1) copy bandwidth of a large device-to-device copy (bytes read + written);
(2) decode attention for batch x context, 32 q / 8 kv heads, head_dim 128, bf16,
block 16, with contiguous, scattered and slot-heavy (two rows per block) tables,
for the Pallas kernel and the XLA gather path, plus dense
`jax.nn.dot_product_attention` on contiguous KV of the same length as yardstick;
(3) the in-place permutation of 32 blocks of a 32-layer, 8-kv-head, 128-dim bf16
pool (xla, pallas, mosaic). Every result is checked against the reference (decode:
on the first two rows, to bound the reference's memory) before its time is
printed. Bytes of decode are whole blocks touched (k and v); achieved bandwidth is
reported in TB/s and as % of the measured copy bandwidth. `--small` shrinks every
shape so that interpret mode on CPU finishes in seconds; its numbers are not
performance claims.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import records, shared_flags
from pallas_kernels import decode_attention as pa
from pallas_kernels import permute_blocks as pb

_INTERPRET = flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU).")
_SMALL = flags.DEFINE_bool("small", False, "Tiny shapes (smoke test).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64", "256"], "Decode batches.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "8192", "32768"],
                              "Decode context lengths (tokens).")
_PLACEMENTS = flags.DEFINE_list("placements", ["contiguous", "scattered", "slotted"],
                                "Block placements of the decode tables.")
_DECODE_IMPLS = flags.DEFINE_list("decode_impls", ["pallas", "xla"],
                                  "decode_attention impls to time.")
_PERMUTE_IMPLS = flags.DEFINE_list("permute_impls", ["xla", "pallas", "mosaic"],
                                   "permute_blocks impls to time.")
_NUM_SPLITS = flags.DEFINE_integer(
    "num_splits", 0, "Split-K factor; 0 = the wrapper's choice (num_splits=None).")
_PAGES_PER_STEP = flags.DEFINE_integer(
    "pages_per_step", 0, "Pages per step; 0 = the wrapper's default (None).")
_RUNS = flags.DEFINE_integer("runs", 10, "Timed runs (median reported).")
_OUT = flags.DEFINE_string("out", "", "Also write the final table to this file.")
_RECORD = shared_flags.define_record()

_BLOCK = 16


def _time(fn, *args, runs):
  jax.block_until_ready(fn(*args))  # warm-up / compile
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def copy_bandwidth(nbytes, runs):
  """Bytes read + written per second of a large elementwise copy."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a + jnp.ones((), a.dtype))
  t = _time(f, x, runs=runs)
  return 2 * x.nbytes / t, t


def decode_tables(rng, batch, context, placement):
  """Segment tables (numpy) and the number of blocks of the pool."""
  if placement == "slotted":
    half = _BLOCK // 2  # two rows share every block: segments of 8 tokens
    segs = context // half
    num_blocks = batch * segs // 2 + 1
    slots = rng.permutation(batch * segs)  # (block, half) pairs, scattered
    blk = (slots // 2).reshape(batch, segs).astype(np.int32)
    start = ((slots % 2) * half).reshape(batch, segs).astype(np.int32)
    length = np.full((batch, segs), half, np.int32)
  else:
    segs = context // _BLOCK
    num_blocks = batch * segs
    ids = np.arange(num_blocks) if placement == "contiguous" else rng.permutation(
        num_blocks)
    blk = ids.reshape(batch, segs).astype(np.int32)
    start = np.zeros((batch, segs), np.int32)
    length = np.full((batch, segs), _BLOCK, np.int32)
  return blk, start, length, np.full((batch,), segs, np.int32), num_blocks


def _check(name, got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = float(np.max(np.abs(got - want))) if got.size else 0.0
  if not np.all(np.isfinite(got)) or err > tol:
    raise SystemExit(f"{name}: result differs from the reference (max err {err})")


def bench_decode(rows, bw, *, q_heads, kv_heads, head_dim, batches, contexts,
                 runs, interpret):
  rng = np.random.default_rng(0)
  dtype = jnp.bfloat16
  for batch in batches:
    for context in contexts:
      splits = _NUM_SPLITS.value or None
      for placement in _PLACEMENTS.value:
        blk, st, ln, ns, num_blocks = decode_tables(rng, batch, context, placement)
        key = jax.random.key(batch * 7 + context)
        kk, kv, kq = jax.random.split(key, 3)
        shape = (kv_heads, num_blocks, _BLOCK, head_dim)
        k = jax.random.normal(kk, shape, dtype)
        v = jax.random.normal(kv, shape, dtype)
        q = jax.random.normal(kq, (batch, q_heads, head_dim), dtype)
        table = [jnp.asarray(a) for a in (blk, st, ln, ns)]
        want = pa.ref_decode_attention(q[:2], k, v, *[t[:2] for t in table])
        blocks_read = batch * blk.shape[1]
        nbytes = 2 * blocks_read * kv_heads * _BLOCK * head_dim * k.dtype.itemsize
        for impl in _DECODE_IMPLS.value:
          fn = jax.jit(lambda q, k, v, *t, impl=impl: pa.decode_attention(
              q, k, v, *t, impl=impl, interpret=interpret, num_splits=splits,
              pages_per_step=_PAGES_PER_STEP.value or None))
          out = fn(q, k, v, *table)
          _check(f"decode {impl} {placement} b{batch} c{context}", out[:2], want,
                 0.05)
          t = _time(fn, q, k, v, *table, runs=runs)
          rows.append(("decode", impl, placement, batch, context, t, nbytes / t,
                       nbytes / t / bw))
        del k, v
      # Dense yardstick: contiguous K/V of the same length, same bytes.
      kd = jax.random.normal(kk, (batch, context, kv_heads, head_dim), dtype)
      vd = jax.random.normal(kv, (batch, context, kv_heads, head_dim), dtype)
      qd = q[:, None]
      dense = jax.jit(jax.nn.dot_product_attention)
      _check(f"dense b{batch} c{context}", dense(qd, kd, vd)[:2, 0],
             _dense_ref(qd[:2], kd[:2], vd[:2]), 0.05)
      t = _time(dense, qd, kd, vd, runs=runs)
      nbytes = kd.nbytes + vd.nbytes
      rows.append(("decode", "dense", "contiguous", batch, context, t, nbytes / t,
                   nbytes / t / bw))
      del kd, vd


def _dense_ref(q, k, v):
  """f32 softmax attention, GQA by repeating kv heads."""
  rep = q.shape[2] // k.shape[2]
  k = jnp.repeat(k.astype(jnp.float32), rep, axis=2)
  v = jnp.repeat(v.astype(jnp.float32), rep, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) / np.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)[:, 0]


def bench_permute(rows, bw, *, shape, num_moves, runs, interpret):
  rng = np.random.default_rng(1)
  pages = jax.random.normal(jax.random.key(3), shape, jnp.bfloat16)
  perm = rng.permutation(shape[2])
  src = jnp.asarray(perm[:num_moves], jnp.int32)
  dst = jnp.asarray(perm[num_moves:2 * num_moves], jnp.int32)
  want = np.asarray(pb.ref_permute_blocks(pages, src, dst)[:, :, dst], np.float32)
  nbytes = 2 * num_moves * shape[0] * shape[1] * shape[3] * shape[4] * 2
  for impl in _PERMUTE_IMPLS.value:
    itp = interpret
    if impl == "mosaic" and interpret:
      from pallas_kernels import lowering
      itp = lowering.gpu_interpret_params()
    work = jnp.array(pages)
    work = pb.permute_blocks(work, src, dst, impl=impl, interpret=itp)
    _check(f"permute {impl}", work[:, :, dst], want, 0.0)
    times = []
    for i in range(runs + 1):  # alternate directions; sets stay disjoint
      a, b = (dst, src) if i % 2 == 0 else (src, dst)
      jax.block_until_ready(work)
      t0 = time.perf_counter()
      work = jax.block_until_ready(pb.permute_blocks(work, a, b, impl=impl,
                                                     interpret=itp))
      times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    rows.append(("permute32", impl, "-", num_moves, shape[0], t, nbytes / t,
                 nbytes / t / bw))


def format_table(rows, bw):
  lines = [f"copy bandwidth: {bw / 1e12:.3f} TB/s  (device: {jax.devices()[0]})",
           "| kernel | impl | placement | batch/moves | context/layers | time us |"
           " TB/s | % copy bw |", "|---|---|---|---|---|---|---|---|"]
  for kind, impl, place, a, b, t, rate, frac in rows:
    lines.append(f"| {kind} | {impl} | {place} | {a} | {b} | {t * 1e6:.1f} | "
                 f"{rate / 1e12:.4f} | {100 * frac:.1f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_kernels", flag_values=records.script_flags())
  small, interpret, runs = _SMALL.value, _INTERPRET.value, _RUNS.value
  if small:
    cfg = dict(q_heads=8, kv_heads=2, head_dim=32, batches=[2], contexts=[64])
    perm_shape, copy_bytes, runs = (4, 2, 24, _BLOCK, 32), 1 << 22, min(runs, 2)
  else:
    cfg = dict(q_heads=32, kv_heads=8, head_dim=128,
               batches=[int(b) for b in _BATCHES.value],
               contexts=[int(c) for c in _CONTEXTS.value])
    perm_shape, copy_bytes = (32, 8, 1024, _BLOCK, 128), 4 << 30
  bw, _ = copy_bandwidth(copy_bytes, runs)
  print(f"copy bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
  rows = []
  bench_decode(rows, bw, runs=runs, interpret=interpret, **cfg)
  bench_permute(rows, bw, shape=perm_shape, num_moves=min(32, perm_shape[2] // 2),
                runs=runs, interpret=interpret)
  table = format_table(rows, bw)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(" ".join(sys.argv) + "\n\n" + table + "\n")
  rec.write({"copy_bandwidth": bw, "runs": runs, "rows": [
      dict(kernel=kind, impl=impl, placement=place, batch_or_moves=a, context_or_layers=b,
           seconds=t, bytes_per_s=rate, copy_share=frac)
      for kind, impl, place, a, b, t, rate, frac in rows]},
            notes=(["interpret mode: a smoke test, not a performance figure"]
                   if interpret else []))


if __name__ == "__main__":
  app.run(main)
