"""Compaction: fragmentation ratio, move plans, the permutation of pages/metadata/tables."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact
from paged_kv.telemetry import metrics
from paged_kv.core.errors import Status
from tests.testutil import KVModel, small_config

CONFIG = small_config()


def _fragmented_pool(seed=0):
  """Eight sequences of 1-3 blocks; every other one released: holes everywhere."""
  pool = paged_kv.BlockPool(CONFIG)
  model = KVModel(pool, seed)
  seqs = [model.open() for _ in range(8)]
  model.append(seqs, [8, 20, 9, 16, 3, 24, 12, 5])
  model.release(seqs[::2])
  return pool, model


class FragmentationRatioTest(absltest.TestCase):

  def test_matches_numpy_reference_per_region(self):
    rng = np.random.default_rng(0)
    for _ in range(20):
      n = 24  # one shape: compiles once
      ref = (rng.random(n) < 0.5).astype(np.int32)
      region = (rng.random(n) < 0.3).astype(np.int8)
      meta = paged_kv.BlockMeta(ref_count=jnp.asarray(ref), slots=jnp.zeros((n, 1), jnp.uint32),
                                last_use=jnp.zeros(n, jnp.int32), region=jnp.asarray(region),
                                free_list=jnp.zeros(n, jnp.int32), num_free=jnp.int32(0))
      got = np.asarray(compact.region_fragmentation(meta))
      masks = metrics.region_free_masks(ref, region)
      want = [metrics.fragmentation_ratio(masks["dynamic"]), metrics.fragmentation_ratio(
          masks["base"])]
      np.testing.assert_allclose(got, want, atol=1e-6)


class PlanTest(absltest.TestCase):

  def test_plan_properties(self):
    pool, _ = _fragmented_pool()
    meta = jax.tree.map(np.asarray, pool.state.meta)
    for budget in (1, 3, 32):
      src, dst = (np.asarray(x) for x in compact.plan_compaction(pool.state.meta, budget=budget))
      valid = src >= 0
      self.assertEqual(valid.shape, (budget,))
      self.assertTrue((valid == (dst >= 0)).all())
      s, d = src[valid], dst[valid]
      self.assertTrue((meta.ref_count[s] > 0).all() and (meta.ref_count[d] == 0).all())
      self.assertTrue((s > d).all())
      self.assertEqual(len(set(s) | set(d)), 2 * len(s))
      live = np.flatnonzero(meta.ref_count > 0)[::-1]
      free = np.flatnonzero(meta.ref_count == 0)
      np.testing.assert_array_equal(s, live[:len(s)])  # highest live first
      np.testing.assert_array_equal(d, free[:len(d)])  # lowest free first


class PermuteTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_moves_keep_every_sequence_bit_identical(self):
    pool, model = _fragmented_pool()
    # An outside holder of one live segment (a cache node), to follow via remap.
    live = sorted(model.kv)[0]
    seg = pool.segments(live)[0].tolist()
    pool.apply_ref_deltas([seg[0]], [1])
    extra = np.array([seg])
    model.check(extra)
    before_ratio = float(compact.fragmentation_ratio(pool.state.meta))
    self.assertGreater(before_ratio, 0.0)
    src, dst = compact.plan_compaction(pool.state.meta, budget=32)
    fn = self.variant(compact.compact_permute.__wrapped__,
                      static_argnames=("config", "impl", "interpret"))
    pool.state, (remap, status) = fn(pool.state, src, dst, config=CONFIG)
    remap = np.asarray(remap)
    self.assertTrue((np.asarray(status) == Status.OK).all())
    s, d = np.asarray(src), np.asarray(dst)
    np.testing.assert_array_equal(remap[s[s >= 0]], d[d >= 0])
    untouched = np.setdiff1d(np.arange(CONFIG.num_blocks), s[s >= 0])
    np.testing.assert_array_equal(remap[untouched], untouched)
    extra[:, 0] = remap[extra[:, 0]]
    model.check(extra)
    self.assertEqual(float(compact.fragmentation_ratio(pool.state.meta)), 0.0)

  def test_invalid_moves_refuse_the_whole_plan(self):
    pool, model = _fragmented_pool()
    meta = jax.tree.map(np.asarray, pool.state.meta)
    live = np.flatnonzero(meta.ref_count > 0)
    free = np.flatnonzero(meta.ref_count == 0)
    before = jax.tree.map(np.asarray, pool.state)
    cases = [([live[-1], live[-2]], [free[0], live[0]]),     # destination live
             ([free[1], live[-1]], [free[0], free[2]]),      # source free
             ([live[-1], live[-1]], [free[0], free[1]]),     # source twice
             ([live[-1], live[-2]], [free[0], free[0]]),     # destination twice
             ([live[-1], -1], [CONFIG.num_blocks, -1])]      # out of range
    for src, dst in cases:
      pool.state, (remap, status) = compact.compact_permute(
          pool.state, np.array(src, np.int32), np.array(dst, np.int32), config=CONFIG)
      self.assertIn(Status.INVALID_BLOCK, np.asarray(status).tolist())
      np.testing.assert_array_equal(np.asarray(remap), np.arange(CONFIG.num_blocks))
      chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, pool.state))
    model.check()

  def test_donation_aliases_the_pages(self):
    pool, _ = _fragmented_pool()
    src, dst = compact.plan_compaction(pool.state.meta, budget=4)
    compiled = compact.compact_permute.lower(pool.state, src, dst, config=CONFIG).compile()
    page_bytes = 2 * pool.state.pages.k.nbytes
    self.assertGreaterEqual(compiled.memory_analysis().alias_size_in_bytes, page_bytes)


class CompactStepTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_threshold_force_and_convergence(self):
    pool, model = _fragmented_pool(seed=3)
    fn = self.variant(compact.compact_step.__wrapped__,
                      static_argnames=("config", "policy", "impl", "interpret"))
    lazy = compact.CompactionPolicy(threshold=1.0, budget=2)
    pool.state, (_, moves) = fn(pool.state, False, config=CONFIG, policy=lazy)
    self.assertEqual(int(moves), 0)
    pool.state, (remap, moves) = fn(pool.state, True, config=CONFIG, policy=lazy)
    self.assertEqual(int(moves), 2)
    model.check()
    eager = compact.CompactionPolicy(threshold=0.0, budget=2)
    for _ in range(10):
      pool.state, (_, moves) = fn(pool.state, False, config=CONFIG, policy=eager)
    self.assertEqual(float(compact.fragmentation_ratio(pool.state.meta)), 0.0)
    self.assertEqual(int(moves), 0)
    model.check()

  def test_second_call_compiles_nothing(self):
    pool, _ = _fragmented_pool()
    policy = compact.CompactionPolicy(threshold=0.0, budget=4)
    pool.state, _ = compact.compact_step(pool.state, True, config=CONFIG, policy=policy)
    size = compact.compact_step._cache_size()
    pool.state, _ = compact.compact_step(pool.state, True, config=CONFIG, policy=policy)
    self.assertEqual(compact.compact_step._cache_size(), size)

  def test_policy(self):
    p = compact.CompactionPolicy()
    self.assertEqual((p.threshold, p.budget), (0.35, None))
    self.assertEqual(p.max_moves(), compact.LEGACY_MOVES)  # no bytes per block known
    self.assertTrue(p.should_compact(0.4))
    self.assertFalse(p.should_compact(0.3))
    self.assertTrue(p.should_compact(0.0, contiguous_failed=True))
    with self.assertRaises(ValueError):
      compact.CompactionPolicy(budget=0)
    with self.assertRaises(ValueError):
      compact.CompactionPolicy(threshold=1.5)


class ByteBudgetTest(absltest.TestCase):
  """The per-step budget is bytes (or a share of step time); moves are derived."""

  def test_default_is_two_percent_of_a_step_at_h200_bandwidth(self):
    p = compact.CompactionPolicy()
    self.assertEqual(p.step_bytes, int(0.02 * 0.020 * 4.3e12 / 2))  # 860 MB per step
    block = 2 * 32 * 8 * 16 * 128 * 2  # Llama-3-8B, 16 tokens, bf16: 2 MiB
    self.assertEqual(p.max_moves(block), 860_000_000 // block)  # 410
    self.assertAlmostEqual(p.step_time_share(p.max_moves(block), block), 0.02, delta=1e-4)

  def test_bytes_budget_and_move_cap(self):
    p = compact.CompactionPolicy(budget_bytes=10 * 4096)
    self.assertEqual(p.max_moves(4096), 10)
    self.assertEqual(p.max_moves(4095), 10)
    self.assertEqual(p.max_moves(5000), 8)
    self.assertEqual(p.max_moves(10**9), 1)  # at least one move, so compaction progresses
    capped = compact.CompactionPolicy(budget_bytes=10 * 4096, budget=3)
    self.assertEqual(capped.max_moves(4096), 3)
    self.assertEqual(capped.max_moves(), 3)
    timed = compact.CompactionPolicy(step_fraction=0.5, step_seconds=1e-3, copy_bandwidth=8e6)
    self.assertEqual(timed.step_bytes, 2000)
    self.assertEqual(timed.max_moves(100), 20)
    self.assertAlmostEqual(timed.step_time_share(20, 100), 0.5)

  def test_validation(self):
    for kw in (dict(budget_bytes=0), dict(budget_bytes=1.5), dict(budget=True),
               dict(step_fraction=0.0), dict(step_fraction=1.5), dict(step_seconds=0),
               dict(copy_bandwidth=-1.0)):
      with self.assertRaises(ValueError, msg=str(kw)):
        compact.CompactionPolicy(**kw)
    with self.assertRaises(ValueError):
      compact.CompactionPolicy().max_moves(0)

  def test_plan_width_follows_the_pool_block_bytes(self):
    pool, model = _fragmented_pool()
    bb = CONFIG.block_bytes
    for strategy in compact.STRATEGIES:
      p = compact.CompactionPolicy(threshold=0.0, budget_bytes=3 * bb, strategy=strategy)
      src, dst = p.plan(pool.state.meta, config=CONFIG)
      self.assertEqual(src.shape, (3,))
      self.assertEqual(p.plan(pool.state.meta, block_bytes=bb // 2)[0].shape, (6,))
      self.assertEqual(p.plan(pool.state.meta)[0].shape,  # capped at num_blocks // 2
                       (min(compact.LEGACY_MOVES, CONFIG.num_blocks // 2),))
      self.assertGreater(int((src >= 0).sum()), 0)
    # compact_step derives the same width from the config.
    p = compact.CompactionPolicy(threshold=0.0, budget_bytes=3 * bb, strategy="top_down")
    pool.state, (_, moves) = compact.compact_step(pool.state, True, config=CONFIG, policy=p)
    self.assertEqual(int(moves), 3)
    model.check()
    pool.check_invariants()


class HostWrapperTest(absltest.TestCase):

  def test_block_pool_compact(self):
    pool, model = _fragmented_pool()
    remap = pool.compact(budget=32)
    self.assertEqual(remap.shape, (CONFIG.num_blocks,))
    model.check()
    self.assertEqual(metrics.snapshot(pool.state, CONFIG).fragmentation_ratio, 0.0)

  def test_block_pool_compact_with_a_byte_budget(self):
    pool, model = _fragmented_pool()
    policy = compact.CompactionPolicy(budget_bytes=2 * CONFIG.block_bytes, strategy="top_down")
    before = np.asarray(pool.state.meta.ref_count).copy()
    remap = pool.compact(policy=policy)
    self.assertEqual(int((remap != np.arange(CONFIG.num_blocks)).sum()), 2)  # 2 blocks' worth
    model.check()
    pool.check_invariants()
    after = np.asarray(pool.state.meta.ref_count)
    self.assertEqual(int((before > 0).sum()), int((after > 0).sum()))


if __name__ == "__main__":
  absltest.main()


class PlanDefragTest(absltest.TestCase):
  """The host planner that grows the largest free run."""

  def _ratio(self, free):
    from paged_kv.telemetry.metrics import fragmentation_ratio as ratio
    return ratio(free)

  def test_each_move_lowers_the_ratio_and_converges(self):
    rng = np.random.default_rng(0)
    for trial in range(20):
      n = 64
      ref = (rng.random(n) < 0.6).astype(np.int32) * rng.integers(1, 3, n)
      region = np.zeros(n, np.int8)
      region[:int(rng.integers(0, 6))] = 1
      ref[region == 1] = rng.integers(0, 2, int((region == 1).sum()))
      free0 = (ref == 0) & (region == 0)
      src, dst = compact.plan_defrag(ref, region, budget=n)
      moves = src >= 0
      self.assertTrue(((src >= 0) == (dst >= 0)).all())
      s, d = src[moves], dst[moves]
      self.assertEqual(len(set(s.tolist()) | set(d.tolist())), 2 * len(s))  # disjoint
      self.assertTrue((ref[s] > 0).all() and (region[s] == 0).all())
      self.assertTrue(free0[d].all())
      free = free0.copy()
      last = self._ratio(free)
      for a, b in zip(s, d):
        free[a], free[b] = True, False
        now = self._ratio(free)
        self.assertLess(now, last + 1e-12)
        last = now
      # With an unlimited budget, all free dynamic blocks end up in one run unless
      # base-region blocks split the dynamic region.
      if not (region == 1).any():
        self.assertEqual(last, 0.0, trial)

  def test_applied_plan_keeps_kv_and_invariants(self):
    cfg = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=16)
    pool = paged_kv.BlockPool(cfg)
    seqs = [pool.open_sequence() for _ in range(4)]
    for i in range(6):
      slots = pool.reserve_tokens(seqs, [4, 4, 4, 4])
      kv = jnp.broadcast_to(jnp.arange(16.0).reshape(4, 4, 1, 1) + 100 * i, (4, 4, 1, 2))
      pool.write_kv(0, slots, kv, -kv, seq_ids=seqs)
    before = {s: np.asarray(pool.gather_kv(s)[0]) for s in seqs[::2]}
    pool.release(seqs[1::2])
    ratio0 = float(compact.fragmentation_ratio(pool.state.meta))
    self.assertGreater(ratio0, 0.3)
    policy = compact.CompactionPolicy(budget=32)
    src, dst = policy.plan(pool.state.meta)
    pool.state, (remap, status) = compact.compact_permute(pool.state, src, dst, config=cfg)
    np.testing.assert_array_equal(status, 0)
    self.assertEqual(float(compact.fragmentation_ratio(pool.state.meta)), 0.0)
    for s, k in before.items():
      np.testing.assert_array_equal(np.asarray(pool.gather_kv(s)[0]), k)
    pool.check_invariants()
