"""Resizing the pages with a bounded peak (`paged_kv.core.resize`).

The staged path must give exactly the device path's state (pages, metadata) while
holding at most the larger pool plus one layer of K on the device; a failure in the
middle must leave the pool as it was. The peak is measured by the module's own
sampling of live arrays, so the device path's test also checks that the sampling sees
the two pools (a measurement that could not see them would pass any bound).
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core import regions
from paged_kv.core import resize as resize_lib
from tests.testutil import KVModel, small_config

CONFIG = small_config(num_blocks=48, num_layers=4, base_pool_fraction=0.1)
NB = CONFIG.num_base_blocks


def _filled_pool():
  """A pool with live sequences below block 24 (compacted) and K/V to check."""
  pool = paged_kv.BlockPool(CONFIG)
  model = KVModel(pool)
  seqs = [model.open() for _ in range(5)]
  model.append(seqs, [8, 30, 9, 16, 21])
  model.release(seqs[1::2])
  pool.compact(budget=32)
  assert not np.asarray(pool.state.meta.ref_count)[24:].any()
  return pool, model


def _arrays(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


class ResizeTest(parameterized.TestCase):

  @parameterized.parameters((24,), (64,))
  def test_staged_equals_device_and_keeps_kv(self, num_blocks):
    expect = None
    for staging in ("device", "host"):
      pool, model = _filled_pool()
      report = pool.resize(num_blocks, staging=staging)
      self.assertIs(pool.last_resize, report)
      self.assertEqual(report.staged, staging == "host")
      self.assertEqual((report.old_blocks, report.new_blocks), (48, num_blocks))
      self.assertEqual(pool.state.pages.k.shape[2], num_blocks)
      model.check()
      pool.check_invariants()
      got = _arrays(pool.state)
      if expect is None:
        expect = got
      else:
        for a, b in zip(expect, got):
          np.testing.assert_array_equal(a, b)
      # The pool keeps serving at the new size.
      model.append(sorted(model.kv), [3] * len(model.kv))
      model.check()

  def test_staged_peak_is_one_pool_plus_one_layer(self):
    pool, _ = _filled_pool()
    report = pool.resize(24, staging="host")
    layer = CONFIG.num_kv_heads * 24 * CONFIG.block_size * CONFIG.head_dim * 4  # f32
    self.assertEqual(report.chunk_bytes, layer)
    # K goes through the host, both ways; V's kept half waits on the device in the room
    # K's cut freed (48 -> 24 blocks: exactly V's kept part).
    self.assertEqual(report.host_bytes, 2 * CONFIG.num_layers * layer)
    self.assertEqual(report.device_bytes, CONFIG.num_layers * layer)
    meta_slack = 48 * 64  # the new block metadata beside the old (a few words per block)
    self.assertLessEqual(report.peak_extra_bytes, layer + meta_slack)
    self.assertLess(report.peak_extra_bytes, report.pages_after // 2)

  def test_a_device_budget_keeps_chunks_on_the_device(self):
    """Within the budget kept parts wait on the device: fewer bytes cross the host link,
    the peak grows by at most the budget, and the state is the same."""
    layer = CONFIG.num_kv_heads * 24 * CONFIG.block_size * CONFIG.head_dim * 4
    new = regions.resized_config(CONFIG, 24)
    results = []
    for budget in (0, 3 * layer):
      pool, model = _filled_pool()
      state, report = resize_lib.resize_state_staged(pool.state, config=CONFIG,
                                                     new_config=new, device_budget=budget)
      results.append(_arrays(state))
      self.assertEqual(report.host_bytes, 2 * (CONFIG.num_layers - budget // layer) * layer)
      self.assertEqual(report.device_bytes, 2 * CONFIG.num_layers * layer - report.host_bytes // 2)
      self.assertLessEqual(report.peak_extra_bytes, budget + layer + 48 * 64)
    for a, b in zip(*results):
      np.testing.assert_array_equal(a, b)

  def test_auto_budget_is_the_free_memory(self):
    new = regions.resized_config(CONFIG, 24)
    chunk = 24 * CONFIG.block_bytes // (2 * CONFIG.num_layers)
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=8000):
      self.assertEqual(resize_lib.plan_staging(CONFIG, new), (True, 7000 - chunk))
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=100):
      self.assertEqual(resize_lib.plan_staging(CONFIG, new), (True, 0))
    self.assertEqual(resize_lib.plan_staging(CONFIG, new, "host"), (True, 0))

  def test_device_path_holds_both_pools_and_the_measure_sees_it(self):
    pool, _ = _filled_pool()
    report = pool.resize(24, staging="device")
    self.assertGreaterEqual(report.peak_extra_bytes, report.pages_after)
    self.assertEqual((report.chunk_bytes, report.host_bytes), (0, 0))

  def test_growth_staged_peak_is_the_new_pool_plus_one_layer(self):
    pool, model = _filled_pool()
    report = pool.resize(64, staging="host")
    slack = report.chunk_bytes + 64 * 64
    self.assertLessEqual(report.peak_bytes,
                         report.bytes_before - report.pages_before + report.pages_after + slack)
    model.check()

  def test_the_old_pages_are_freed(self):
    pool, _ = _filled_pool()
    old = pool.state.pages
    pool.resize(24, staging="host")
    self.assertTrue(old.k.is_deleted() and old.v.is_deleted())

  @parameterized.parameters(
      (24, "_put_layer", 2),  # K's upload, its old array freed
      (24, "_put_layer", 6),  # V's upload: K already resized, V's old array freed
      (24, "_take_layer", 6),  # V's staging: K already resized, V intact
      (64, "_put_layer", 6),
      (64, "_take_layer", 7))
  def test_a_failure_leaves_the_pool_as_it_was(self, num_blocks, program, nth):
    pool, model = _filled_pool()
    before = _arrays(pool.state)
    calls = [0]
    real = getattr(resize_lib, program)

    def failing(*args, **kwargs):
      calls[0] += 1
      if calls[0] == nth:
        raise MemoryError("injected")
      return real(*args, **kwargs)

    with mock.patch.object(resize_lib, program, failing):
      with self.assertRaises(MemoryError):
        pool.resize(num_blocks, staging="host")
    self.assertGreaterEqual(calls[0], nth)
    self.assertEqual(pool.config, CONFIG)
    self.assertIsNone(pool.last_resize)
    after = _arrays(pool.state)
    for i, (a, b) in enumerate(zip(before, after)):
      if i < 2:  # pages: the kept part exact, a cut tail (free) zeros
        keep = min(48, num_blocks)
        np.testing.assert_array_equal(a[:, :, :keep], b[:, :, :keep])
        np.testing.assert_array_equal(b[:, :, keep:], 0)
      else:
        np.testing.assert_array_equal(a, b)
    pool.check_invariants()
    model.check()
    pool.resize(24, staging="host")  # and it resizes afterwards
    model.check()

  def test_auto_stages_only_without_room_beside_the_old_pool(self):
    new = regions.resized_config(CONFIG, 24)
    need = 24 * CONFIG.block_bytes
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=need):
      self.assertTrue(resize_lib.stages_through_host(CONFIG, new))
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=2 * need):
      self.assertFalse(resize_lib.stages_through_host(CONFIG, new))
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=None):
      self.assertFalse(resize_lib.stages_through_host(CONFIG, new))
    self.assertTrue(resize_lib.stages_through_host(CONFIG, new, "host"))
    self.assertFalse(resize_lib.stages_through_host(CONFIG, new, "device"))
    pool, model = _filled_pool()
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=need):
      self.assertTrue(pool.resize(24).staged)
    model.check()

  def test_growth_checks_the_memory_its_path_needs(self):
    """Staged growth frees the old pages first: it fits where the device path would not."""
    new = regions.resized_config(CONFIG, 64)
    free = resize_lib.device_memory.pool_bytes(new) - 48 * CONFIG.block_bytes // 2
    pool, model = _filled_pool()
    with mock.patch.object(resize_lib.device_memory, "free_bytes", return_value=free):
      with self.assertRaisesRegex(paged_kv.PoolTooLarge, "replaces"):
        pool.resize(1000, staging="host")
      with self.assertRaises(paged_kv.PoolTooLarge):
        pool.resize(64, staging="device")
      self.assertEqual(pool.config, CONFIG)
      self.assertTrue(pool.resize(64, staging="host").staged)
    model.check()

  def test_bad_staging_changes_nothing(self):
    pool, model = _filled_pool()
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "staging"):
      pool.resize(24, staging="disk")
    self.assertEqual(pool.config, CONFIG)
    model.check()

  def test_staged_programs_write_in_place_and_take_one_layer(self):
    """The compiled upload aliases the pages (no pool-sized copy or temporary); the
    download program's output is one layer of the kept blocks."""
    pages = jnp.zeros((4, 2, 24, 8, 3), jnp.float32)
    chunk = jnp.ones((1, 2, 24, 8, 3), jnp.float32)
    put = resize_lib._put_layer.lower(pages, chunk, jnp.int32(1)).compile()  # pylint: disable=protected-access
    mem = put.memory_analysis()
    if mem is None:
      self.skipTest("no memory analysis on this backend")
    self.assertEqual(mem.alias_size_in_bytes, pages.nbytes)
    self.assertLess(mem.temp_size_in_bytes, pages.nbytes // 2)
    take = resize_lib._take_layer.lower(jnp.zeros((4, 2, 48, 8, 3)), jnp.int32(2),  # pylint: disable=protected-access
                                        keep=24).compile()
    self.assertEqual(take.memory_analysis().output_size_in_bytes, chunk.nbytes)


if __name__ == "__main__":
  absltest.main()
