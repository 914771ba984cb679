"""Per-call cost of the `BlockPool` host API against pool size (is every call O(batch)?).

Times each host-API call through `paged_kv.BlockPool` (validation, one jitted
transition with the state donated, the status read back) at several pool sizes,
and prints the median and p99 per call in microseconds, plus the ratio of the
largest pool to the smallest. A call whose cost is O(batch) gives a flat row;
one that touches every block (a free-list rebuild, a whole-array select, a
host copy of a per-block array) grows with the pool.

The calls: `open_sequence()`; `reserve_tokens` of 1 token for a batch of 1, 32
and 256 sequences (a decode step: in place, and a fresh block every 16th
step); `release` of a sequence holding 4 blocks (frees them); `fork` of a
4-block sequence; `allocate(4)` and `apply_ref_deltas` with 4 blocks (+1 on live
blocks, and -1 freeing the 4 blocks `allocate` gave).

The pages are 1 layer x 1 kv head x head_dim 1 (bf16) so a 1M-block pool fits
anywhere; the bookkeeping does not depend on the page size. On a shared CPU the
numbers are noisy: `--rounds` repeats the whole measurement (sizes interleaved), and the
largest/smallest ratio is taken per round (paired) and reported as the median with
[min-max] over the rounds.

Usage:
  PYTHONPATH=. python benchmarks/bench_pool_ops.py                            # 4k, 64k, 262k, 1M blocks
  PYTHONPATH=. python benchmarks/bench_pool_ops.py --sizes=4096,65536 --reps=20   # quick look
"""

from __future__ import annotations

import time

from absl import app, flags
import numpy as np

from benchmarks import records, shared_flags
import paged_kv

_SIZES = flags.DEFINE_list("sizes", ["4096", "65536", "262144", "1048576"],
                           "Pool sizes in blocks.")
_REPS = flags.DEFINE_integer("reps", 60, "Timed calls per operation and pool size.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Repeat the whole measurement; per-call medians "
                               "of all, size ratios paired per round.")
_RECORD = shared_flags.define_record()
_BATCHES = flags.DEFINE_list("batches", ["1", "32", "256"], "Batches for reserve_tokens.")
_BLOCK_SIZE = 16


def _config(num_blocks: int, max_batch: int) -> paged_kv.PoolConfig:
  return paged_kv.PoolConfig(num_blocks=num_blocks, block_size=_BLOCK_SIZE, num_layers=1,
                             num_kv_heads=1, head_dim=1, dtype="bfloat16",
                             max_seqs=max(2 * max_batch, 64), max_segments=32)


def _time(fn, reps: int, setup=None, teardown=None, warmup: int = 3) -> list[float]:
  """Seconds per call of `fn(ctx)`; `setup()` -> ctx and `teardown(ctx)` are untimed."""
  out = []
  for i in range(warmup + reps):
    ctx = setup() if setup else None
    t0 = time.perf_counter()
    res = fn(ctx)
    t1 = time.perf_counter()
    if teardown:
      teardown(ctx, res)
    if i >= warmup:
      out.append(t1 - t0)
  return out


def _bench_size(num_blocks: int, reps: int, batches: list[int]) -> dict[str, list[float]]:
  pool = paged_kv.BlockPool(_config(num_blocks, max(batches)))
  res: dict[str, list[float]] = {}

  def opened(tokens: int) -> int:
    s = pool.open_sequence()
    if tokens:
      pool.reserve_tokens([s], [tokens])
    return s

  res["open_sequence"] = _time(lambda _: pool.open_sequence(), reps,
                               teardown=lambda _, s: pool.release([s]))
  for b in batches:
    seqs = [opened(0) for _ in range(b)]
    steps = [0]

    def reserve(_, seqs=seqs):
      return pool.reserve_tokens(seqs, [1] * len(seqs))

    def after(_, out, seqs=seqs, b=b):
      steps[0] += 1
      if steps[0] % (_BLOCK_SIZE * 16) == 0:  # stay within max_segments
        pool.release(seqs)
        seqs[:] = [opened(0) for _ in range(b)]

    res[f"reserve 1 tok x{b}"] = _time(reserve, reps, teardown=after)
    pool.release(seqs)
  res["release (4 blocks)"] = _time(lambda s: pool.release([s]), reps,
                                    setup=lambda: opened(4 * _BLOCK_SIZE))
  parent = opened(4 * _BLOCK_SIZE)
  res["fork (4 blocks)"] = _time(lambda _: pool.fork(parent), reps,
                                 teardown=lambda _, c: pool.release([c]))
  blocks = pool.segments(parent)[:, 0]
  res["apply_ref_deltas +1 x4"] = _time(lambda _: pool.apply_ref_deltas(blocks, [1] * 4), reps,
                                        teardown=lambda *_: pool.apply_ref_deltas(blocks,
                                                                                  [-1] * 4))
  held = []
  res["allocate(4)"] = _time(lambda _: pool.allocate(4), reps,
                             teardown=lambda _, ids: held.append(ids))
  res["apply_ref_deltas -1 x4 (frees)"] = _time(
      lambda ids: pool.apply_ref_deltas(ids, [-1] * 4), min(reps, len(held)),
      setup=lambda: held.pop(), warmup=0)
  while held:
    pool.apply_ref_deltas(held.pop(), [-1] * 4)
  pool.release([parent])
  pool.check_invariants()  # the numbers are of a pool that stayed consistent
  assert pool.num_free_blocks == num_blocks, pool.num_free_blocks
  return res


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_pool_ops", flag_values=records.script_flags())
  sizes = [int(s) for s in _SIZES.value]
  batches = [int(b) for b in _BATCHES.value]
  times: dict[tuple[str, int], list[float]] = {}
  per_round: list[dict] = []  # {op: {size: median us}} per round
  ops: list[str] = []
  for _ in range(_ROUNDS.value):
    meds_round: dict[str, dict[int, float]] = {}
    for n in sizes:
      t0 = time.perf_counter()
      for op, ts in _bench_size(n, _REPS.value, batches).items():
        times.setdefault((op, n), []).extend(ts)
        meds_round.setdefault(op, {})[n] = float(np.median(ts)) * 1e6
        if op not in ops:
          ops.append(op)
      print(f"  measured {n} blocks in {time.perf_counter() - t0:.1f} s", flush=True)
    per_round.append(meds_round)
  head = " | ".join(f"{n:>8d} p50 / p99" for n in sizes)
  print(f"\nBlockPool host API, us per call ({paged_kv.__file__}, "
        f"{_ROUNDS.value} x {_REPS.value} calls); last column: per-round ratio of the p50s, "
        "median [min-max] over rounds")
  print(f"| {'call':<32} | {head} | {sizes[-1]}/{sizes[0]} p50 |")
  print(f"|{'-' * 34}|" + "|".join("-" * 20 for _ in sizes) + f"|{'-' * 15}|")
  for op in ops:
    cells = []
    for n in sizes:
      us = np.asarray(times[(op, n)]) * 1e6
      med, p99 = float(np.median(us)), float(np.percentile(us, 99))
      cells.append(f"{med:>9.0f} / {p99:>7.0f}")
    ratio = records.format_median_range(
        [r[op][sizes[-1]] / r[op][sizes[0]] for r in per_round], suffix="x")
    print(f"| {op:<32} | " + " | ".join(cells) + f" | {ratio} |")
  rec.write({"sizes": sizes, "reps": _REPS.value, "rounds": _ROUNDS.value, "ops": ops,
             "median_us_per_round": per_round,
             "p99_us": {op: {n: float(np.percentile(np.asarray(times[(op, n)]) * 1e6, 99))
                             for n in sizes} for op in ops}})


if __name__ == "__main__":
  app.run(main)
