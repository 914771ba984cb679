"""Decode-step bookkeeping cost: jitted `reserve_tokens` + `write_kv` vs host allocators.

One decode step gives each of B sequences one new token: find room (in place or
a fresh block), append to the table, produce the token's physical slot and
write its K/V. Three ways, each one dispatch per step:

- jitted: `reserve_tokens` and `write_kv` in one jitted call, state donated;
- python host (vLLM-style): a block per request only when its next token
  starts one (a Python loop over the batch, FIFO free queue), then the slot
  mapping computed vectorised from a block-table array, as vLLM's model runner
  does (`block_table[req, pos // bs] * bs + pos % bs`);
- numpy host: the same bookkeeping with no per-sequence loop.

Both host baselines pass their numpy slots straight to the same jitted K/V write
(and are checked to produce identical slots). A second comparison amortises the
dispatch: the jitted step inside a `lax.scan` of `--scan` steps against the
scan-equivalent host loop (`--scan` steps of numpy bookkeeping, then one jitted
scan of `--scan` writes). The script prints what the numbers mean on a CPU and
what they should mean on a GPU.

Like is compared with like: the per-step jitted call against the per-step host
baselines (one dispatch per step each), the jitted scan against the host's scan
(one dispatch per `--scan` steps each); the vectorised numpy baseline comes first,
because it is the one to beat. Within a run the variants are called in turn, one
call each per round, so a load spike on a shared machine hits them alike. `--runs`
repeats every pool size (the sizes interleaved), and the ratios are reported as medians
with [min-max] over the runs, each ratio paired within one run.

Usage:
  PYTHONPATH=. python benchmarks/bench_allocator.py                       # the full table
  PYTHONPATH=. python benchmarks/bench_allocator.py --pool_sizes=16384 --steps=20 --runs=1  # quick look
"""

from __future__ import annotations

import collections
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.core import kv, sequences

_BATCH = flags.DEFINE_integer("batch", 256, "Sequences decoding together.")
_BLOCK_SIZE = shared_flags.define_block_size()
_POOL_SIZES = flags.DEFINE_list("pool_sizes", ["16384", "65536", "262144"], "Pools (blocks).")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 8192, "Prompt lengths are drawn from 1..max_len, clipped so the batch fills at "
    "most 85% of the smallest pool (noted in the output).")
_STEPS = flags.DEFINE_integer("steps", 60, "Timed decode steps (after warm-up).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 32, "K/V head size (1 layer, 1 kv head).")
_SEED = shared_flags.define_seed()
_SCAN = flags.DEFINE_integer("scan", 32, "Decode steps per call in the lax.scan variant.")
_RUNS = flags.DEFINE_integer("runs", 3, "Runs of every pool size (interleaved); ratios are "
                             "medians [min-max] over the runs.")
_RECORD = shared_flags.define_record()


class PythonHostPool:
  """Baseline 1, vLLM-style: per-sequence Python bookkeeping, vectorised slot mapping.

  Like vLLM's KV cache manager, a request gets a block from a FIFO free queue
  only when its next token starts one (a Python loop over the batch); like
  vLLM's model runner, the slot mapping of the step is computed with numpy from a
  `[B, max_blocks]` block-table array and the positions:
  `block_table[req, pos // bs] * bs + pos % bs`.
  """

  def __init__(self, num_blocks: int, block_size: int, batch: int, max_blocks: int):
    self.block_size = block_size
    self.free = collections.deque(range(num_blocks))
    self.block_table = np.zeros((batch, max_blocks), np.int32)
    self.num_blocks = [0] * batch
    self.lens = np.zeros(batch, np.int64)

  def add(self, seq: int, length: int) -> None:
    need = -(-length // self.block_size)
    for _ in range(need):
      self.block_table[seq, self.num_blocks[seq]] = self.free.popleft()
      self.num_blocks[seq] += 1
    self.lens[seq] = length

  def decode_step(self) -> np.ndarray:
    """Room for one token per sequence; returns the step's slot mapping `i32[B]`."""
    bs = self.block_size
    for seq in range(len(self.num_blocks)):  # allocate_slots, one request at a time
      if self.lens[seq] % bs == 0:
        if not self.free:
          raise MemoryError("pool exhausted")
        self.block_table[seq, self.num_blocks[seq]] = self.free.popleft()
        self.num_blocks[seq] += 1
    pos = self.lens
    rows = np.arange(pos.size)
    slots = self.block_table[rows, pos // bs] * bs + pos % bs
    self.lens = pos + 1
    return slots.astype(np.int32)


class NumpyHostPool(PythonHostPool):
  """Baseline 2: the same bookkeeping vectorised (numpy, no per-sequence loop).

  The free queue is an array with a head index; the sequences that start a block
  this step take the next blocks in batch order (what the Python loop does).
  """

  def __init__(self, num_blocks: int, block_size: int, batch: int, max_blocks: int):
    super().__init__(num_blocks, block_size, batch, max_blocks)
    self.free_array = np.arange(num_blocks, dtype=np.int32)
    self.head = 0
    self.nblocks = np.zeros(batch, np.int64)

  def add(self, seq: int, length: int) -> None:
    need = -(-length // self.block_size)
    self.block_table[seq, :need] = self.free_array[self.head:self.head + need]
    self.head += need
    self.nblocks[seq] = need
    self.lens[seq] = length

  def decode_step(self) -> np.ndarray:
    bs = self.block_size
    pos = self.lens
    (rows,) = np.nonzero(pos % bs == 0)
    if self.head + rows.size > self.free_array.size:
      raise MemoryError("pool exhausted")
    self.block_table[rows, self.nblocks[rows]] = self.free_array[self.head:self.head + rows.size]
    self.head += rows.size
    self.nblocks[rows] += 1
    slots = self.block_table[np.arange(pos.size), pos // bs] * bs + pos % bs
    self.lens = pos + 1
    return slots.astype(np.int32)


def _growth(steps: int) -> int:
  """Tokens each sequence gains during one `bench_pool` run."""
  return 10 + 2 * steps + _SCAN.value * (1 + _scan_calls(steps))


def _scan_calls(steps: int) -> int:
  """Timed calls of each scan variant in one run."""
  return max(5, steps // 8)


def _interleaved_us(fns, rounds: int) -> list[float]:
  """Median microseconds per call of each of `fns`, called in turn `rounds` times."""
  times = [[] for _ in fns]
  for _ in range(rounds):
    for fn, out in zip(fns, times):
      t0 = time.perf_counter()
      fn()
      out.append(time.perf_counter() - t0)
  return [statistics.median(t) * 1e6 for t in times]


def bench_pool(num_blocks: int, lengths: np.ndarray, steps: int) -> dict:
  bs, b = _BLOCK_SIZE.value, len(lengths)
  cfg = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=bs, num_layers=1, num_kv_heads=1,
                            head_dim=_HEAD_DIM.value, dtype="bfloat16", max_seqs=b,
                            max_segments=int(-(-(lengths.max() + _growth(steps)) // bs)) + 1)
  state = paged_kv.init_pool(cfg)
  ids = jnp.arange(b, dtype=jnp.int32)
  z = jnp.zeros((b, 1), jnp.int32)
  state, st = sequences.open_sequence(state, ids, z, z, z, jnp.zeros((b,), jnp.int32), config=cfg)
  chunk = 1024
  remaining = lengths.copy()
  while remaining.any():  # prefill in chunks (bookkeeping only: K/V content is irrelevant)
    take = np.minimum(remaining, chunk)
    state, (_, st) = sequences.reserve_tokens(state, ids, jnp.asarray(take, jnp.int32),
                                             config=cfg, max_new_tokens=chunk)
    assert (np.asarray(st) == 0).all(), "prefill did not fit"
    remaining -= take
  one = jnp.ones((b,), jnp.int32)
  kv_new = jnp.ones((b, 1, 1, _HEAD_DIM.value), jnp.bfloat16)

  @jax.jit
  def _step(state, ids, one, kv_new):
    state, (slots, status) = sequences.reserve_tokens.__wrapped__(
        state, ids, one, config=cfg, max_new_tokens=1)
    pages = kv.write_kv(state.pages, 0, slots, kv_new, kv_new)
    return type(state)(pages=pages, meta=state.meta, table=state.table, step=state.step), status

  step = jax.jit(_step.__wrapped__, donate_argnums=0)

  @jax.jit
  def _scan_steps(state, ids, one, kv_new):
    def body(state, _):
      return _step.__wrapped__(state, ids, one, kv_new)
    return jax.lax.scan(body, state, None, length=_SCAN.value)

  scan_steps = jax.jit(_scan_steps.__wrapped__, donate_argnums=0)
  reserve_only = jax.jit(lambda s, i, o: sequences.reserve_tokens.__wrapped__(
      s, i, o, config=cfg, max_new_tokens=1), donate_argnums=0)

  holder = {"state": state}

  def run_step():
    holder["state"], status = step(holder["state"], ids, one, kv_new)
    status.block_until_ready()

  def run_reserve():
    holder["state"], (slots, status) = reserve_only(holder["state"], ids, one)
    status.block_until_ready()

  def run_scan():
    holder["state"], status = scan_steps(holder["state"], ids, one, kv_new)
    status.block_until_ready()

  # The host baselines get pages of their own, so every variant can run in turn.
  hp = {"pages": jax.tree.map(jnp.copy, holder["state"].pages)}
  py = PythonHostPool(num_blocks, bs, b, cfg.max_segments)
  npy = NumpyHostPool(num_blocks, bs, b, cfg.max_segments)
  for s, n in enumerate(lengths):
    py.add(s, int(n))
    npy.add(s, int(n))
  for _ in range(3):  # the two baselines do the same bookkeeping: same slots
    np.testing.assert_array_equal(py.decode_step(), npy.decode_step())
  # The same jitted K/V write for both baselines, numpy slots passed straight in
  # (their transfer is part of the one dispatch per step).
  write = jax.jit(lambda p, sl, k: kv.write_kv(p, 0, sl, k, k), donate_argnums=0)

  def _write_steps(p, slots, k):  # slots: [S, B], one step's write per scan step
    return jax.lax.scan(lambda p, sl: (kv.write_kv(p, 0, sl[:, None], k, k), None), p,
                        slots)[0]

  write_scan = jax.jit(_write_steps, donate_argnums=0)

  def host_step(pool):
    hp["pages"] = write(hp["pages"], pool.decode_step()[:, None], kv_new)
    hp["pages"].k.block_until_ready()

  def host_scan():  # the scan-equivalent host loop: S steps of bookkeeping, one write call
    slots = np.stack([npy.decode_step() for _ in range(_SCAN.value)])
    hp["pages"] = write_scan(hp["pages"], slots, kv_new)
    hp["pages"].k.block_until_ready()

  for _ in range(5):
    run_step()
    run_reserve()
    host_step(py)
    host_step(npy)
  run_scan()
  host_scan()
  # Interleaved: each timed round calls every variant once, so a load spike on this
  # shared machine hits all of them alike and the ratios are paired.
  jit_step, np_step, py_step, jit_reserve, np_book, py_book = _interleaved_us(
      [run_step, lambda: host_step(npy), lambda: host_step(py), run_reserve,
       npy.decode_step, py.decode_step], steps)
  scan_calls = _scan_calls(steps)
  jit_scan, np_scan = (t / _SCAN.value for t in _interleaved_us([run_scan, host_scan],
                                                                   scan_calls))
  got = np.asarray(holder["state"].table.seq_len)
  grown = 10 + 2 * steps + _SCAN.value * (1 + scan_calls)
  assert (got == lengths + grown).all(), np.unique(got - lengths)
  paged_kv.check_invariants(holder["state"])
  return dict(num_blocks=num_blocks, jit_step=jit_step, jit_reserve=jit_reserve,
              jit_scan=jit_scan, py_step=py_step, np_step=np_step, py_book=py_book,
              np_book=np_book, np_scan=np_scan)


_MEANING = """\
What the numbers mean.
- Every per-step column is one dispatch per step: the jitted side runs reserve_tokens and
  the K/V write in one jitted call; each host baseline computes the slots on the host and
  passes the numpy array straight to one jitted write. The scan columns amortise one
  dispatch over {scan} steps on both sides (the host side computes {scan} steps of slots,
  then one jitted scan of {scan} writes).
- On a CPU (this backend: {backend}) host and device are the same processor: there is no
  transfer to save and no launch to overlap, so allocating inside the jitted step cannot
  beat a vectorised numpy allocator; it costs one dispatch of the ~15-buffer state, which
  dominates. Read the CPU numbers as: what the bookkeeping costs, and that it does not
  grow with the pool (compare the rows).
- On a GPU the host baselines must finish their bookkeeping and copy the slot mapping to
  the device before every launch (a host sync per step), while the jitted step allocates
  on the device and a k-step scan runs k decode steps per launch with no host round trip.
  That is where allocation inside the jitted step should pay off; measure it there (this
  script runs unchanged on a GPU backend) before claiming a speedup.
"""


RATIOS = (
    # (key, numerator, denominator, what): host time / jitted time, > 1 = jitted faster.
    ("step_vs_numpy", "np_step", "jit_step", "per step: numpy host + write / jitted"),
    ("step_vs_python", "py_step", "jit_step", "per step: python host + write / jitted"),
    ("scan_vs_numpy", "np_scan", "jit_scan", "amortised: numpy host scan / jitted scan"),
)
"""The paired ratios: both sides one dispatch per step, or both one per scan."""


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_allocator", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  rng = np.random.default_rng(_SEED.value)
  sizes = [int(x) for x in _POOL_SIZES.value]
  b, bs = _BATCH.value, _BLOCK_SIZE.value
  cap = int(0.85 * min(sizes) * bs)
  hi = _MAX_LEN.value
  lengths = rng.integers(1, hi + 1, size=b)
  while lengths.sum() + b * _growth(_STEPS.value) > cap:
    hi = int(hi * 0.9)
    lengths = rng.integers(1, hi + 1, size=b)
  note = "" if hi == _MAX_LEN.value else (
      f" (--max_len={_MAX_LEN.value} clipped to {hi} so the batch fits 85% of the "
      f"{min(sizes)}-block pool)")
  print(f"batch={b} block_size={bs} prompt lengths drawn from 1..{hi}{note}: "
        f"{lengths.min()}..{lengths.max()}, sum {lengths.sum()} tokens; {_STEPS.value} timed "
        f"steps, medians; {_RUNS.value} runs; backend={jax.default_backend()}", flush=True)
  rows = []
  for run in range(_RUNS.value):
    for n in sizes:
      r = bench_pool(n, lengths, _STEPS.value)
      r["run"] = run
      rows.append(r)
      print(f"  run {run} pool {n}: jitted {r['jit_step']:.0f} us/step, numpy host "
            f"{r['np_step']:.0f}, scan {r['jit_scan']:.1f} vs {r['np_scan']:.1f}", flush=True)
  s = _SCAN.value
  print()
  print("| run | pool blocks | numpy host + write (us) | python host + write (us) | "
        "jitted reserve+write (us) | numpy bookkeeping (us) | python bookkeeping (us) | "
        f"jitted reserve only (us) | numpy host, {s} steps + one {s}-write scan (us/step) | "
        f"jitted, {s}-step scan (us/step) |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['run']} | {r['num_blocks']} | {r['np_step']:.0f} | {r['py_step']:.0f} | "
          f"{r['jit_step']:.0f} | {r['np_book']:.0f} | {r['py_book']:.0f} | "
          f"{r['jit_reserve']:.0f} | {r['np_scan']:.1f} | {r['jit_scan']:.1f} |")
  print()
  print("Host time / jitted time, paired within each run (> 1: the jitted path is faster), "
        "median [min-max] over runs:")
  print("| pool blocks | " + " | ".join(what for _, _, _, what in RATIOS) + " |")
  print("|---:|" + "---:|" * len(RATIOS))
  for n in sizes:
    mine = [r for r in rows if r["num_blocks"] == n]
    cells = [records.format_median_range([r[a] / r[b] for r in mine], suffix="x")
             for _, a, b, _ in RATIOS]
    print(f"| {n} | " + " | ".join(cells) + " |")
  print()
  print(_MEANING.format(scan=s, backend=jax.default_backend()))
  rec.write({"batch": b, "block_size": bs, "max_len_used": hi,
             "lengths_min": lengths.min(), "lengths_max": lengths.max(),
             "lengths_sum": lengths.sum(), "steps": _STEPS.value, "scan": s,
             "runs": _RUNS.value, "rows": rows})


if __name__ == "__main__":
  app.run(main)
