"""Regions: the base pool, promotion into it, live/cached quotas, pool shrink and grow."""

from __future__ import annotations

import chex
import jax
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact, regions
from paged_kv.core.errors import Status
from tests.testutil import KVModel, small_config

CONFIG = small_config(base_pool_fraction=0.25)  # blocks 0..7 are the base pool
NB = CONFIG.num_base_blocks


def _shared_prefix_pool():
  """A 16-token prefix (two blocks) read by four sequences, plus a private one."""
  pool = paged_kv.BlockPool(CONFIG)
  model = KVModel(pool)
  root = model.open()
  model.append([root], [16])
  readers = [model.fork(root) for _ in range(3)]
  model.append(readers, [3, 3, 3])
  other = model.open()
  model.append([other], [9])
  return pool, model, root


class BasePoolTest(absltest.TestCase):

  def test_allocation_and_compaction_leave_the_base_pool_alone(self):
    self.assertEqual(NB, 8)
    pool, model, _ = _shared_prefix_pool()
    ref = np.asarray(pool.state.meta.ref_count)
    self.assertFalse(ref[:NB].any())
    ids = pool.allocate(3)
    self.assertTrue((ids >= NB).all())
    pool.apply_ref_deltas(ids, [-1, -1, -1])
    src, dst = (np.asarray(x) for x in compact.plan_compaction(pool.state.meta, budget=32))
    self.assertTrue((src[src >= 0] >= NB).all() and (dst[dst >= 0] >= NB).all())
    model.check()


class PromotionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_promote_most_read_blocks(self):
    pool, model, root = _shared_prefix_pool()
    prefix_blocks = pool.segments(root)[:, 0]
    src, dst = regions.plan_promotion(pool.state.meta, 4, max_moves=4)
    src, dst = np.asarray(src), np.asarray(dst)
    np.testing.assert_array_equal(src[:2], prefix_blocks)  # ref_count 4 each
    np.testing.assert_array_equal(dst[:2], [0, 1])
    self.assertTrue((src[2:] == -1).all())
    fn = self.variant(regions.promote_blocks.__wrapped__,
                      static_argnames=("config", "impl", "interpret"))
    pool.state, (remap, status) = fn(pool.state, src, dst, config=CONFIG)
    self.assertTrue((np.asarray(status) == Status.OK).all())
    np.testing.assert_array_equal(np.asarray(remap)[prefix_blocks], [0, 1])
    np.testing.assert_array_equal(pool.segments(root)[:, 0], [0, 1])
    model.check()
    # Promoted blocks are pinned: compaction does not plan them.
    s, _ = compact.plan_compaction(pool.state.meta, budget=32)
    self.assertFalse(np.isin(np.asarray(s), [0, 1]).any())
    # A promoted (base) tail is never appended to in place.
    model.release([root])
    model.check()

  def test_promotion_into_a_dynamic_block_is_refused(self):
    pool, model, root = _shared_prefix_pool()
    b = int(pool.segments(root)[0, 0])
    free_dyn = int(np.flatnonzero(np.asarray(pool.state.meta.ref_count)[NB:] == 0)[0]) + NB
    pool.state, (_, status) = regions.promote_blocks(
        pool.state, np.array([b], np.int32), np.array([free_dyn], np.int32), config=CONFIG)
    self.assertEqual(int(status[0]), Status.INVALID_BLOCK)
    model.check()

  def test_block_pool_promote(self):
    pool, model, root = _shared_prefix_pool()
    remap = pool.promote(min_readers=4)
    self.assertEqual(sorted(remap[pool.segments(root)[:, 0]].tolist()), [0, 1])
    model.check()


class QuotaTest(absltest.TestCase):

  def test_borrow_above_high_and_give_back_below_low_rate_limited(self):
    q = regions.WatermarkQuota(total_blocks=1000, live_fraction=0.6, max_step=50)
    self.assertEqual((q.live_quota, q.cached_quota), (600, 400))
    d = q.update(live_blocks=500, cached_blocks=400)  # 0.83 < 0.85: nothing
    self.assertEqual((d.change, d.live_limit, d.evict_cached), (0, 600, 0))
    d = q.update(live_blocks=550, cached_blocks=400)  # 0.92 > 0.85: borrow 50
    self.assertEqual((d.change, d.live_limit, d.cached_limit, d.evict_cached),
                     (50, 650, 350, 50))
    d = q.update(live_blocks=600, cached_blocks=350)  # 0.92 again: borrow 50 more
    self.assertEqual((d.borrowed, d.evict_cached), (100, 50))
    d = q.update(live_blocks=500, cached_blocks=300)  # 0.71: hysteresis, keep
    self.assertEqual(d.change, 0)
    d = q.update(live_blocks=200, cached_blocks=300)  # 0.29 < 0.5: give back 50
    self.assertEqual((d.change, d.borrowed), (-50, 50))
    d = q.update(live_blocks=200, cached_blocks=300)
    self.assertEqual((d.change, d.borrowed, d.live_limit), (-50, 0, 600))
    d = q.update(live_blocks=0, cached_blocks=300)
    self.assertEqual(d.change, 0)

  def test_borrowing_stops_at_the_cached_quota(self):
    q = regions.WatermarkQuota(total_blocks=100, live_fraction=0.9, max_step=64)
    d = q.update(live_blocks=90, cached_blocks=10)
    self.assertEqual((d.borrowed, d.cached_limit), (10, 0))
    d = q.update(live_blocks=100, cached_blocks=0)
    self.assertEqual(d.change, 0)

  def test_block_usage(self):
    pool, model, root = _shared_prefix_pool()
    seg = pool.segments(root)[-1].tolist()
    pool.apply_ref_deltas([seg[0]], [1])
    live, cached = regions.block_usage(pool.state)
    self.assertEqual(cached, 0)
    model.release([root])
    self.assertEqual(regions.block_usage(pool.state), (live, 0))  # readers still use it
    del seg

  def test_invalid_quota(self):
    with self.assertRaises(paged_kv.InvalidArgument):
      regions.WatermarkQuota(total_blocks=10, low_watermark=0.9, high_watermark=0.5)


class ResizeTest(absltest.TestCase):

  def test_shrink_after_compaction_and_grow_back(self):
    pool = paged_kv.BlockPool(CONFIG)
    model = KVModel(pool)
    seqs = [model.open() for _ in range(6)]
    model.append(seqs, [8, 30, 9, 16, 3, 24])
    model.release(seqs[::2])
    with self.assertRaises(paged_kv.InvalidBlock):
      pool.resize(20)
    pool.compact(budget=32)
    used = int((np.asarray(pool.state.meta.ref_count) > 0).sum())
    pool.resize(NB + used)
    self.assertEqual(pool.config.num_blocks, NB + used)
    self.assertEqual(pool.config.num_base_blocks, NB)
    self.assertEqual(pool.num_free_blocks, 0)
    model.check()
    pool.resize(CONFIG.num_blocks + 8)
    self.assertEqual(pool.num_free_blocks, CONFIG.num_blocks + 8 - NB - used)
    model.check()
    model.append(sorted(model.kv), [5] * len(model.kv))
    model.check()

  def test_shrink_while_serving(self):
    """Budgeted plan_shrink moves between decode steps, then one cut; K/V intact."""
    pool = paged_kv.BlockPool(CONFIG)
    model = KVModel(pool)
    seqs = [model.open() for _ in range(6)]
    model.append(seqs, [8, 30, 9, 16, 3, 24])
    model.release(seqs[::2])
    live = sorted(model.kv)
    used = int((np.asarray(pool.state.meta.ref_count) > 0).sum())
    cut = NB + used + 4  # room for the appends below
    for step in range(40):
      model.append(live, [1] * len(live))  # serving goes on
      src, dst = regions.plan_shrink(pool.state.meta, cut, budget=2)
      src, dst = np.asarray(src), np.asarray(dst)
      if not (src >= 0).any():
        break
      self.assertTrue(((src >= cut) | (src < 0)).all() and (dst < cut).all())
      pool.move_blocks(src, dst)
      model.check()
    self.assertLess(step, 40)
    self.assertFalse((np.asarray(pool.state.meta.ref_count)[cut:] > 0).any())
    pool.resize(cut)
    self.assertEqual(pool.config.num_blocks, cut)
    model.check()
    model.append(live, [3] * len(live))
    model.check()
    pool.check_invariants()

  def test_resized_config(self):
    for n in range(9, 200, 7):
      self.assertEqual(regions.resized_config(CONFIG, n).num_base_blocks, NB)
    with self.assertRaises(paged_kv.InvalidArgument):
      regions.resized_config(CONFIG, NB)
    with self.assertRaises(paged_kv.InvalidArgument):
      regions.resize_pool(paged_kv.init_pool(CONFIG), config=CONFIG,
                          new_config=small_config(num_blocks=40, base_pool_fraction=0.25,
                                                  head_dim=4))


if __name__ == "__main__":
  absltest.main()
