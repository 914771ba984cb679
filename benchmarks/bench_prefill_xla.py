"""Before/after timing of the "xla" prefill path (CPU is fine): the row scan it
replaced (each row's pass over all T tokens, quadratic in batch) against
`prefill_attention(impl="xla")` (token tiles of one row each, linear).

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_prefill_xla.py --batches=1,4,16 --q_len=256

Both are checked against `ref_prefill_attention` before timing; medians of
`--runs` calls, each ended by `block_until_ready`.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import records, shared_flags
from pallas_kernels import prefill_attention as pf

_BATCHES = flags.DEFINE_list("batches", ["1", "4", "16"], "Rows per batch.")
_Q_LEN = flags.DEFINE_integer("q_len", 256, "New tokens per row (no prefix).")
_HEADS = flags.DEFINE_list("heads", ["8", "2"], "q heads, kv heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_BLOCK = shared_flags.define_block_size()
_RUNS = flags.DEFINE_integer("runs", 5, "Timed runs (median).")
_RECORD = shared_flags.define_record()


def row_scan_prefill(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                     seg_length, num_segments, *, sm_scale):
  """The replaced path: `lax.scan` over rows, each over all T tokens."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  batch, num_seg_slots = seg_block.shape
  seq_lens, cum_before = pf._seq_lens_and_cum(seg_length, num_segments)
  tok_row, tok_pos = pf._token_rows(cu_q_lens, seq_lens, num_tokens)
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  j = jnp.arange(block_size)[None, :]

  def one_row(out, b):
    valid = jnp.arange(num_seg_slots) < num_segments[b]
    blocks = jnp.clip(jnp.where(valid, seg_block[b], 0), 0, num_blocks - 1)
    start = seg_start[b][:, None]
    in_seg = valid[:, None] & (j >= start) & (j < start + seg_length[b][:, None])
    key_pos = (cum_before[b][:, None] + j - start).reshape(-1)
    in_seg = in_seg.reshape(-1)
    k = k_pages[:, blocks].reshape(num_kv_heads, -1, head_dim)
    v = v_pages[:, blocks].reshape(num_kv_heads, -1, head_dim)
    v = jnp.where(in_seg[None, :, None], v, jnp.zeros((), v.dtype))
    mine = tok_row == b
    mask = mine[:, None] & in_seg[None, :] & (key_pos[None, :] <= tok_pos[:, None])
    logits = jnp.einsum("thgd,hjd->thgj", qg, k,
                        preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgj,hjd->thgd", p, v.astype(jnp.float32))
    o = jnp.where(denom == 0, 0.0, o / jnp.where(denom == 0, 1.0, denom))
    return jnp.where(mine[:, None, None, None], o, out), None

  init = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
  out, _ = jax.lax.scan(one_row, init, jnp.arange(batch))
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _median_time(fn, args, runs):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_prefill_xla", flag_values=records.script_flags())
  rows = []
  qh, kvh = (int(h) for h in _HEADS.value)
  d, bs, q_len = _HEAD_DIM.value, _BLOCK.value, _Q_LEN.value
  sm_scale = 1 / math.sqrt(d)
  print(f"jax {jax.__version__} {jax.devices()[0]}; {qh}/{kvh} heads, D={d}, "
        f"block {bs}, {q_len} new tokens per row, f32")
  print("| batch | row scan (before) ms | tiles (after) ms | ratio |")
  print("|---|---|---|---|")
  for batch in (int(b) for b in _BATCHES.value):
    rng = np.random.default_rng(batch)
    segs = q_len // bs
    num_blocks = batch * segs
    blk = rng.permutation(num_blocks).reshape(batch, segs).astype(np.int32)
    table = [jnp.asarray(blk), jnp.zeros((batch, segs), jnp.int32),
             jnp.full((batch, segs), bs, jnp.int32),
             jnp.full((batch,), segs, jnp.int32)]
    cu = jnp.asarray(np.arange(batch + 1) * q_len, jnp.int32)
    k = jnp.asarray(rng.standard_normal((kvh, num_blocks, bs, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((kvh, num_blocks, bs, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch * q_len, qh, d)), jnp.float32)
    args = (q, k, v, cu, *table)
    before = jax.jit(lambda *a: row_scan_prefill(*a, sm_scale=sm_scale))
    after = jax.jit(lambda *a: pf.prefill_attention(*a, impl="xla"))
    want = np.asarray(pf.ref_prefill_attention(*args))
    for name, fn in (("before", before), ("after", after)):
      err = float(np.max(np.abs(np.asarray(fn(*args)) - want)))
      if not err < 1e-4:
        raise SystemExit(f"{name} differs from the reference: {err}")
    t_before = _median_time(before, args, _RUNS.value)
    t_after = _median_time(after, args, _RUNS.value)
    print(f"| {batch} | {t_before * 1e3:.1f} | {t_after * 1e3:.1f} | "
          f"{t_before / t_after:.1f}x |", flush=True)
    rows.append(dict(batch=batch, before_s=t_before, after_s=t_after))
  rec.write({"q_len": q_len, "heads": [qh, kvh], "head_dim": d, "block_size": bs,
             "rows": rows})


if __name__ == "__main__":
  app.run(main)
