"""Regressions found in review.

Tests marked FIXED failed on the code as reviewed, because of a real bug (each
docstring says what went wrong); the fix followed in the same session. Tests marked
GUARD pin a subtle property that was verified by hand and had no test of its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv
from paged_kv import PoolConfig, BlockPool
from paged_kv.scheduler.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig


def _snapshot(pool):
  return jax.tree.map(np.asarray, pool.state)


def _assert_same(before, pool):
  after = _snapshot(pool)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


def _small(**kw):
  base = dict(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=4,
              max_segments=8)
  base.update(kw)
  return PoolConfig(**base)


# ---------------------------------------------------------------------------
# Pool core / host API.
# ---------------------------------------------------------------------------


def test_open_sequence_rejects_int32_overflowing_segment():
  """FIXED segments.py open_sequence `shape_ok`: `seg_start + seg_length <= bs` is computed
  in int32, so (start=1, length=2**31-1) wraps negative and passes; range_mask then is 0,
  so `written` is True too. The pool opens a row with seq_len 2**31-1 on a 4-slot block."""
  pool = BlockPool(_small())
  a = pool.open_sequence()
  pool.reserve_tokens([a], [3])
  blk = int(pool.segments(a)[0, 0])
  before = _snapshot(pool)
  with pytest.raises(paged_kv.PagedKVError):
    pool.open_sequence(segments=[[blk, 1, 2**31 - 1]])
  _assert_same(before, pool)
  pool.check_invariants()


def test_apply_ref_deltas_does_not_wrap_large_deltas():
  """FIXED pool.py apply_ref_deltas: int64 deltas are cast to int32 by `_pad` without a
  range check, so an incref of 2**32-1 becomes a decref of 1 and frees a live block."""
  pool = BlockPool(_small())
  (blk,) = pool.allocate(1)
  before = _snapshot(pool)
  try:
    pool.apply_ref_deltas([int(blk)], [2**32 - 1])
  except paged_kv.PagedKVError:
    _assert_same(before, pool)  # refused: fine
    return
  assert int(pool.state.meta.ref_count[blk]) != 0, "an incref freed the block"


@pytest.mark.slow
def test_allocate_best_fit_prefers_shortest_run_on_large_pool():
  """FIXED alloc.py allocate(fit="best"): `score = (end - j) * n + j` overflows int32 once
  run_length * num_blocks >= 2**31, so the longest run scores lowest and is taken."""
  cfg = PoolConfig(num_blocks=65536, block_size=1, num_layers=1, num_kv_heads=1, head_dim=1,
                   max_seqs=1, max_segments=1)
  pool = BlockPool(cfg)
  pool.allocate(4)                          # blocks 0..3
  pool.apply_ref_deltas([1, 2], [-1, -1])   # free runs: {1, 2} (2 long), [4, 65536)
  _, (ids, status) = paged_kv.allocate(pool.state, 2, config=cfg, max_blocks=2, fit="best")
  assert int(status) == paged_kv.Status.OK
  np.testing.assert_array_equal(np.asarray(ids), [1, 2])


# ---------------------------------------------------------------------------
# Scheduler.
# ---------------------------------------------------------------------------


def _drain(sched, max_steps):
  for _ in range(max_steps):
    if sched.idle:
      return
    sched.step()
    sched.check_invariants()


def test_scheduler_does_not_livelock_on_table_full_after_partial_prefix_match():
  """FIXED scheduler.py submit/_try_admit/_relieve_pressure: `submit` assumes a request
  needs at most ceil(tokens / block_size) segments, but a prefix matched mid-block adds
  a shared partial segment. Reserve then fails with TABLE_FULL every step;
  `_relieve_pressure` only evicts/preempts (useless for TABLE_FULL, and the matched node
  is locked), so the lone request retries forever and never finishes."""
  cfg = _small(num_blocks=32, max_segments=3)
  pool = BlockPool(cfg)
  sched = Scheduler(pool, DryExecutor(cfg), SchedulerConfig(max_batch=2, compaction=None))
  sched.submit(Request(0, np.arange(1, 7), 1))          # caches (b0,0,4), (b1,0,2)
  _drain(sched, 10)
  assert sched.stats.finished == 1
  # 11 prompt tokens + 1 output = 12 = max_segments * block_size: accepted by submit.
  sched.submit(Request(1, np.concatenate([np.arange(1, 6), [50] * 6]), 1))
  _drain(sched, 40)
  assert sched.stats.finished == 2, f"stuck: {sched.stats.oom_by_reason}"


def test_scheduler_admission_with_many_cached_segments_does_not_raise_or_leak_lock():
  """FIXED scheduler.py _try_admit: node splits make a cached prefix hold more segments
  than ceil(tokens / block_size); `open_sequence` then raises PoolExhausted(table_full)
  out of `step()`, after `match(lock=True)`, so the matched nodes stay locked forever
  and every later step raises again."""
  cfg = _small(num_blocks=32, max_segments=2)
  pool = BlockPool(cfg)
  sched = Scheduler(pool, DryExecutor(cfg), SchedulerConfig(max_batch=2, compaction=None))
  for i, prompt in enumerate(([1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 9])):
    sched.submit(Request(i, prompt, 1))
    _drain(sched, 10)
  # The second insert split the first node at token 2: 4 tree segments for 7 tokens.
  sched.submit(Request(2, [1, 2, 3, 4, 5, 6, 7], 1))
  try:
    _drain(sched, 20)
  finally:
    if sched.idle:
      locked = [n.node_id for n in sched.cache.tree.nodes() if n.lock_ref]
      assert not locked, f"nodes left locked: {locked}"
  assert sched.stats.finished == 3


@pytest.mark.slow
def test_recompute_preemption_with_cache_preempts_only_what_is_needed():
  """FIXED scheduler.py _relieve_pressure: with the prefix cache on, a recompute
  preemption inserts the victim's blocks into the cache before releasing it, so
  `num_free_blocks` does not grow and the `while` loop preempts every sequence but one
  (here 2 preemptions where 1 suffices; without the cache the same run preempts 1).
  Evicting the victim's now-unlocked cache entries inside the loop would fix it."""
  cfg = _small(num_blocks=6)
  pool = BlockPool(cfg)
  sched = Scheduler(pool, DryExecutor(cfg),
                    SchedulerConfig(max_batch=4, compaction=None, output_reserve_ratio=0.0))
  for i in range(3):
    sched.submit(Request(i, np.arange(3) + 10 * i, 8))
    sched.step()
  for _ in range(6):
    if sched.stats.preemptions:
      break
    sched.step()
    sched.check_invariants()
  assert sched.stats.preemptions == 1
  assert len(sched.running) == 2


@pytest.mark.slow
def test_pack_tails_with_promotion_does_not_crash():
  """FIXED scheduler.py _pack: a new leaf's short segment can lie on a block promoted into
  the base region (promote_readers=1 promotes every live block); pack_slots refuses
  base-region segments with InvalidBlock, and `_pack` only catches PoolExhausted, so
  `step()` raises. `_pack` should skip base-region candidates (or catch InvalidBlock)."""
  cfg = _small(num_blocks=32, base_pool_fraction=0.25)
  pool = BlockPool(cfg)
  sched = Scheduler(pool, DryExecutor(cfg),
                    SchedulerConfig(max_batch=2, compaction=None, pack_tails=True,
                                    promote_readers=1, promote_every=1))
  sched.submit(Request(0, np.arange(1, 8), 6))
  sched.submit(Request(1, np.arange(1, 8), 3))
  _drain(sched, 20)
  assert sched.stats.finished == 2


# ---------------------------------------------------------------------------
# GUARD tests (pass): scrubbing through every path that frees a block.
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_guard_scrub_zeroes_every_free_block_after_moves_and_keeps_live_kv():
  """GUARD: with scrub_freed_blocks, cow_split, pack_slots, compaction and promotion
  free their source blocks through paths other than `release` (only `release` was
  tested). Every free block must hold zeros and every live sequence's K/V must be
  bit-identical to what was written."""
  cfg = PoolConfig(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=1, head_dim=2,
                   max_seqs=6, max_segments=8, base_pool_fraction=0.25,
                   scrub_freed_blocks=True)
  pool = BlockPool(cfg)
  rng = np.random.default_rng(0)
  model = {}

  def append(seq, n):
    s = pool.reserve_tokens([seq], [n])[:, :n]
    k = rng.normal(size=(1, n, 1, 2)).astype(np.float32) + 1.0
    for layer in range(2):
      pool.write_kv(layer, s, jnp.asarray(k * (layer + 1)), jnp.asarray(-k * (layer + 1)),
                    seq_ids=seq)
    model.setdefault(seq, []).extend(list(k[0, :, 0, :]))

  def check():
    pool.check_invariants()
    for seq, vals in model.items():
      k, v = pool.gather_kv(seq)
      want = np.array(vals).reshape(-1, 2)
      np.testing.assert_array_equal(np.asarray(k[0, 0]), want)
      np.testing.assert_array_equal(np.asarray(v[1, 0]), -2 * want)
    free = np.asarray(pool.state.meta.ref_count) == 0
    assert not np.asarray(pool.state.pages.k)[:, :, free].any()
    assert not np.asarray(pool.state.pages.v)[:, :, free].any()

  a = pool.open_sequence(); append(a, 6)
  b = pool.fork(a); model[b] = list(model[a])
  pool.cow_split([b]); check()                       # b's shared tail copied out
  append(a, 3); append(b, 2); check()
  c = pool.open_sequence(); append(c, 9)
  d = pool.open_sequence(); append(d, 3)
  pool.release([c]); del model[c]; check()
  pool.compact(); check()                            # sources freed by moves
  append(d, 3); check()
  short = [(seq, i) for seq in (b, d) for i, n in enumerate(pool.segments(seq)[:, 2]) if n < 4]
  assert short
  pool.pack_slots(table_segments=short); check()     # packed sources freed
  pool.promote(1); check()                           # promoted sources freed
  append(b, 2); append(d, 2); check()


def test_guard_write_kv_skips_padding_in_the_middle():
  """GUARD: slot index -1 in the middle of a batch is skipped (not wrapped to the last
  slot of the pool, which is what a negative index would do in a JAX scatter)."""
  cfg = _small(num_blocks=4)
  pool = BlockPool(cfg)
  a = pool.open_sequence()
  slots = np.asarray(pool.reserve_tokens([a], [3]))[:, :3]
  idx = np.array([[slots[0, 0], -1, slots[0, 1], -1, slots[0, 2]]], np.int32)
  k = jnp.arange(1, 11, dtype=jnp.float32).reshape(1, 5, 1, 2)
  pool.write_kv(0, idx, k, -k, seq_ids=a)
  kk, vv = pool.gather_kv(a)
  np.testing.assert_array_equal(np.asarray(kk[0, 0]), [[1, 2], [5, 6], [9, 10]])
  pages = np.asarray(pool.state.pages.k)
  used = set(int(s) for s in slots[0])
  flat = pages.reshape(cfg.num_slots, 2)
  for s in range(cfg.num_slots):
    if s not in used:
      assert not flat[s].any(), f"padding wrote slot {s}"
