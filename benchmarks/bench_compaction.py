"""Cost of one compaction step against a plain copy of the same bytes, and where it goes.

A pool with `--moves` live blocks at the top and free blocks at the bottom; each
timed call moves the live blocks down (or back up), so every call does the same
work. Timed, interleaved (one call of each variant per round, so load on a shared
machine hits all alike), medians and minima of `--reps` rounds:

* `compact_permute`: the whole step (pages, metadata, free list, tables, remap).
* `pages only`: `page_copy.move_pages` alone, jitted, pages donated.
* `metadata only`: `compact_permute` on a pool of the same block count with
  one-element pages (the per-call cost that does not depend on the bytes).
* `plain copy`: the same bytes copied once (`jnp.copy` of a flat buffer), the
  baseline the ratio is taken against; and `x[::-1]` (the study's earlier baseline).

Every variant's result is checked (the moved blocks equal the originals) before a
number is printed. `--runs` repeats the whole measurement (pool sizes interleaved); the
ratio to the copy is paired within a run and reported as the median with [min-max]
over the runs.

Usage: PYTHONPATH=. python benchmarks/bench_compaction.py [--pool_sizes=512,4096 --moves=32 --reps=50 --runs=3]
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.core import alloc, compact, page_copy

_POOL_SIZES = flags.DEFINE_list("pool_sizes", ["512", "4096"], "Pool sizes (blocks).")
_MOVES = flags.DEFINE_integer("moves", 32, "Block moves per compaction step.")
_REPS = flags.DEFINE_integer("reps", 50, "Timed rounds (after 3 warm-up rounds).")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.")
_HEADS = flags.DEFINE_integer("num_kv_heads", 4, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head size.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "K/V dtype.")
_RUNS = flags.DEFINE_integer("runs", 3, "Runs of the whole measurement; ratios are medians "
                             "[min-max] over the runs.")
_RECORD = shared_flags.define_record()


def _pool(n: int, moves: int, **dims) -> tuple[paged_kv.PoolConfig, paged_kv.PoolState]:
  """A pool of `n` blocks whose top `moves` blocks are live (random K/V), the rest free."""
  config = paged_kv.PoolConfig(num_blocks=n, block_size=16, max_seqs=4, max_segments=4,
                               **dims)
  state = paged_kv.init_pool(config)
  key = jax.random.key(0)
  shape = state.pages.k.shape
  k1, k2 = jax.random.split(key)
  state = paged_kv.PoolState(
      pages=paged_kv.KVPages(k=jax.random.normal(k1, shape).astype(config.jnp_dtype),
                             v=jax.random.normal(k2, shape).astype(config.jnp_dtype)),
      meta=state.meta, table=state.table, step=state.step)
  state, _ = alloc.allocate(state, n, config=config, max_blocks=n, contiguous="never")
  state, _ = alloc.apply_ref_deltas(state, np.arange(0, n - moves, dtype=np.int32),
                                    -np.ones(n - moves, np.int32), config=config)
  return config, state


class _Variant:
  """A timed callable that moves blocks back and forth and checks the data."""

  def __init__(self, name, call, check):
    self.name, self.call, self.check, self.times = name, call, check, []

  def run(self, timed: bool):
    t0 = time.perf_counter()
    self.call()
    if timed:
      self.times.append(time.perf_counter() - t0)


def bench(n: int) -> dict:
  m = _MOVES.value
  dims = dict(num_layers=_LAYERS.value, num_kv_heads=_HEADS.value, head_dim=_HEAD_DIM.value,
              dtype=_DTYPE.value)
  config, state = _pool(n, m, **dims)
  top = jnp.arange(n - m, n, dtype=jnp.int32)
  bottom = jnp.arange(0, m, dtype=jnp.int32)
  want = np.asarray(state.pages.k[:, :, n - m:].astype(jnp.float32))

  full = dict(state=state, src=top, dst=bottom)

  def call_full():
    full["state"], (_, status) = compact.compact_permute(full["state"], full["src"], full["dst"],
                                                         config=config)
    jax.block_until_ready(full["state"].pages.k)
    full["src"], full["dst"] = full["dst"], full["src"]

  def check_full():
    at = np.asarray(full["src"])  # the data sits where the next call would take it from
    got = np.asarray(full["state"].pages.k[:, :, at].astype(jnp.float32))
    np.testing.assert_array_equal(got, want)

  _, pstate = _pool(n, m, **dims)
  pages = dict(pages=pstate.pages, src=top, dst=bottom)
  move = jax.jit(lambda p, s, d: page_copy.move_pages(p, s, d), donate_argnums=0)

  def call_pages():
    pages["pages"] = move(pages["pages"], pages["src"], pages["dst"])
    jax.block_until_ready(pages["pages"].k)
    pages["src"], pages["dst"] = pages["dst"], pages["src"]

  def check_pages():
    at = np.asarray(pages["src"])
    got = np.asarray(pages["pages"].k[:, :, at].astype(jnp.float32))
    np.testing.assert_array_equal(got, want)

  tiny_config, tiny_state = _pool(n, m, num_layers=1, num_kv_heads=1, head_dim=1,
                                  dtype="float32")
  meta = dict(state=tiny_state, src=top, dst=bottom)

  def call_meta():
    meta["state"], (_, status) = compact.compact_permute(meta["state"], meta["src"], meta["dst"],
                                                         config=tiny_config)
    jax.block_until_ready(meta["state"].pages.k)
    meta["src"], meta["dst"] = meta["dst"], meta["src"]

  def check_meta():
    ref = np.asarray(meta["state"].meta.ref_count)
    assert (ref[np.asarray(meta["src"])] == 1).all()

  nbytes = m * config.block_bytes
  buf = jax.random.normal(jax.random.key(1), (nbytes // config.jnp_dtype.itemsize,)).astype(
      config.jnp_dtype)
  copy = jax.jit(jnp.copy)
  rev = jax.jit(lambda x: x[::-1])
  out = {}

  def call_copy():
    out["copy"] = jax.block_until_ready(copy(buf))

  def call_rev():
    out["rev"] = jax.block_until_ready(rev(buf))

  def check_copy():
    np.testing.assert_array_equal(np.asarray(out["copy"]), np.asarray(buf))
    np.testing.assert_array_equal(np.asarray(out["rev"])[::-1], np.asarray(buf))

  variants = [_Variant("compact_permute", call_full, check_full),
              _Variant("pages only (move_pages)", call_pages, check_pages),
              _Variant("metadata only (1-element pages)", call_meta, check_meta),
              _Variant("plain copy (jnp.copy)", call_copy, check_copy),
              _Variant("x[::-1] copy", call_rev, lambda: None)]
  for r in range(_REPS.value + 3):
    for v in variants:
      v.run(timed=r >= 3)
  # Even number of rounds leaves the data at the bottom; the check reads where it is.
  for v in variants:
    v.check()
  base = float(np.median(variants[3].times))
  base_min = float(np.min(variants[3].times))
  rows = []
  for v in variants:
    med, low = float(np.median(v.times)), float(np.min(v.times))
    rows.append((v.name, med * 1e3, low * 1e3, med / base, low / base_min))
  return dict(n=n, nbytes=nbytes, rows=rows)


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_compaction", flag_values=records.script_flags())
  print(f"device: {jax.devices()[0].platform}; {_MOVES.value} moves of "
        f"{_LAYERS.value}x{_HEADS.value}x16x{_HEAD_DIM.value} {_DTYPE.value} blocks "
        f"(K and V); medians and minima of {_REPS.value} interleaved rounds; "
        f"{_RUNS.value} runs", flush=True)
  sizes = [int(x) for x in _POOL_SIZES.value]
  results = []
  for run in range(_RUNS.value):
    for n in sizes:
      res = bench(n)
      res["run"] = run
      res["rows"] = [dict(variant=name, median_ms=med, min_ms=low, median_over_copy=r_med,
                          min_over_copy=r_min) for name, med, low, r_med, r_min in res["rows"]]
      results.append(res)
  print("| run | pool blocks | MiB moved | variant | median ms | min ms | median / copy | "
        "min / copy |")
  print("|---|---|---|---|---|---|---|---|")
  for res in results:
    for r in res["rows"]:
      print(f"| {res['run']} | {res['n']} | {res['nbytes'] / 2**20:.1f} | {r['variant']} | "
            f"{r['median_ms']:.3f} | {r['min_ms']:.3f} | {r['median_over_copy']:.2f} | "
            f"{r['min_over_copy']:.2f} |")
  print()
  print("Median / copy's median, paired within each run: median [min-max] over runs")
  print("| pool blocks | variant | ratio |")
  print("|---|---|---|")
  for n in sizes:
    for name in [r["variant"] for r in results[0]["rows"]]:
      vals = [r["median_over_copy"] for res in results if res["n"] == n
              for r in res["rows"] if r["variant"] == name]
      print(f"| {n} | {name} | {records.format_median_range(vals, suffix='x')} |")
  rec.write({"moves": _MOVES.value, "runs": _RUNS.value, "reps": _REPS.value,
             "results": results})


if __name__ == "__main__":
  app.run(main)
