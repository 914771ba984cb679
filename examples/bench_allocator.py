"""Decode-step bookkeeping cost: jitted `reserve_tokens` + `write_kv` vs a host free list.

One decode step gives each of B sequences one new token: find room (in place or
a fresh block), append to the segment table, produce the token's physical slot
and write its K/V. The jitted path does it on device with the state donated;
the baseline does the same bookkeeping in Python, one sequence at a time, with a
FIFO free list and per-sequence block lists (the way vLLM's host block pool
works), then the same jitted KV scatter with the slots it computed.

Two jitted numbers are reported: one decode step per call (dominated on CPU by
the dispatch of ~15 state buffers) and the per-step cost inside a `lax.scan` of
`--scan` steps, which is what the step costs inside a model's jitted decode.

Usage:
  python examples/bench_allocator.py                       # the full table
  python examples/bench_allocator.py --pool_sizes=16384 --steps=20   # quick look
"""

from __future__ import annotations

import collections
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import paged_kv
from paged_kv.core import kv, segments

_BATCH = flags.DEFINE_integer("batch", 256, "Sequences decoding together.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_POOL_SIZES = flags.DEFINE_list("pool_sizes", ["16384", "65536", "262144"], "Pools (blocks).")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 8192, "Prompt lengths are drawn from 1..max_len, clipped so the batch fills at "
    "most 85%% of the smallest pool (noted in the output).")
_STEPS = flags.DEFINE_integer("steps", 60, "Timed decode steps (after warm-up).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 32, "K/V head size (1 layer, 1 kv head).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_SCAN = flags.DEFINE_integer("scan", 32, "Decode steps per call in the lax.scan variant.")


class HostFreeListPool:
  """Baseline: host-side bookkeeping, one sequence at a time, plain Python."""

  def __init__(self, num_blocks: int, block_size: int):
    self.block_size = block_size
    self.free = collections.deque(range(num_blocks))
    self.ref_count = [0] * num_blocks
    self.tables: dict[int, list[int]] = {}
    self.lens: dict[int, int] = {}

  def add(self, seq: int, length: int) -> None:
    self.tables[seq], self.lens[seq] = [], 0
    self.append(seq, length)

  def append(self, seq: int, n: int) -> list[int]:
    slots = []
    table = self.tables[seq]
    for _ in range(n):
      off = self.lens[seq] % self.block_size
      if off == 0:
        if not self.free:
          raise MemoryError("pool exhausted")
        b = self.free.popleft()
        self.ref_count[b] += 1
        table.append(b)
      slots.append(table[-1] * self.block_size + off)
      self.lens[seq] += 1
    return slots

  def decode_step(self, seqs) -> np.ndarray:
    return np.array([self.append(s, 1)[0] for s in seqs], np.int32)


def _growth(steps: int) -> int:
  """Tokens each sequence gains during one `bench_pool` run."""
  return 10 + 2 * steps + _SCAN.value * (1 + max(3, steps // _SCAN.value))


def _median_us(fn, steps: int) -> float:
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e6


def bench_pool(num_blocks: int, lengths: np.ndarray, steps: int) -> dict:
  bs, b = _BLOCK_SIZE.value, len(lengths)
  cfg = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=bs, num_layers=1, num_kv_heads=1,
                            head_dim=_HEAD_DIM.value, dtype="bfloat16", max_seqs=b,
                            max_segments=int(-(-(lengths.max() + _growth(steps)) // bs)) + 1)
  state = paged_kv.init_pool(cfg)
  ids = jnp.arange(b, dtype=jnp.int32)
  z = jnp.zeros((b, 1), jnp.int32)
  state, st = segments.open_sequence(state, ids, z, z, z, jnp.zeros((b,), jnp.int32), config=cfg)
  chunk = 1024
  remaining = lengths.copy()
  while remaining.any():  # prefill in chunks (bookkeeping only: K/V content is irrelevant)
    take = np.minimum(remaining, chunk)
    state, (_, st) = segments.reserve_tokens(state, ids, jnp.asarray(take, jnp.int32),
                                             config=cfg, max_new_tokens=chunk)
    assert (np.asarray(st) == 0).all(), "prefill did not fit"
    remaining -= take
  one = jnp.ones((b,), jnp.int32)
  kv_new = jnp.ones((b, 1, 1, _HEAD_DIM.value), jnp.bfloat16)

  @jax.jit
  def _step(state, ids, one, kv_new):
    state, (slots, status) = segments.reserve_tokens.__wrapped__(
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
  reserve_only = jax.jit(lambda s, i, o: segments.reserve_tokens.__wrapped__(
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

  for _ in range(5):
    run_step()
    run_reserve()
  run_scan()
  jit_step = _median_us(run_step, steps)
  jit_reserve = _median_us(run_reserve, steps)
  scan_calls = max(3, steps // _SCAN.value)
  jit_scan = _median_us(run_scan, scan_calls) / _SCAN.value
  got = np.asarray(holder["state"].table.seq_len)
  grown = 10 + 2 * steps + _SCAN.value * (1 + scan_calls)
  assert (got == lengths + grown).all(), np.unique(got - lengths)
  paged_kv.check_invariants(holder["state"])

  host = HostFreeListPool(num_blocks, bs)
  for s, n in enumerate(lengths):
    host.add(s, int(n))
  seqs = list(range(b))
  pages = holder["state"].pages
  write = jax.jit(lambda p, sl, k: kv.write_kv(p, 0, sl, k, k), donate_argnums=0)
  hp = {"pages": pages}
  del holder

  def host_step():
    slots = host.decode_step(seqs)
    hp["pages"] = write(hp["pages"], jnp.asarray(slots)[:, None], kv_new)
    hp["pages"].k.block_until_ready()

  for _ in range(5):
    host_step()
  host_full = _median_us(host_step, steps)
  host_book = _median_us(lambda: host.decode_step(seqs), steps)
  return dict(num_blocks=num_blocks, jit_step=jit_step, jit_reserve=jit_reserve, jit_scan=jit_scan,
              host_step=host_full, host_book=host_book)


def main(argv):
  del argv
  rng = np.random.default_rng(_SEED.value)
  sizes = [int(x) for x in _POOL_SIZES.value]
  b, bs = _BATCH.value, _BLOCK_SIZE.value
  cap = int(0.85 * min(sizes) * bs)
  hi = _MAX_LEN.value
  lengths = rng.integers(1, hi + 1, size=b)
  while lengths.sum() + b * _growth(_STEPS.value) > cap:
    hi = int(hi * 0.9)
    lengths = rng.integers(1, hi + 1, size=b)
  print(f"batch={b} block_size={bs} prompt lengths 1..{hi} (sum {lengths.sum()} tokens), "
        f"{_STEPS.value} timed steps, median; backend={jax.default_backend()}")
  rows = [bench_pool(n, lengths, _STEPS.value) for n in sizes]
  print()
  print("| pool blocks | jitted step, 1 call (us) | jitted step in a %d-step scan (us/step) | "
        "jitted reserve only (us) | host loop + write (us) | host bookkeeping only (us) | "
        "speedup, 1 call | speedup, in scan |" % _SCAN.value)
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['num_blocks']} | {r['jit_step']:.0f} | {r['jit_scan']:.1f} | "
          f"{r['jit_reserve']:.0f} | {r['host_step']:.0f} | {r['host_book']:.0f} | "
          f"{r['host_step'] / r['jit_step']:.1f}x | {r['host_step'] / r['jit_scan']:.1f}x |")


if __name__ == "__main__":
  app.run(main)
