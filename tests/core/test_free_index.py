"""The free index (bitmap + count levels): select, mark, allocation, compatibility view."""

from __future__ import annotations

import dataclasses
import functools

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv
from paged_kv.core import alloc, compact
from paged_kv.telemetry import metrics
from paged_kv.core.state import REGION_DYNAMIC, build_free_index, free_index_levels


def _meta(free: np.ndarray) -> paged_kv.BlockMeta:
  n = free.size
  bits, counts = build_free_index(jnp.asarray(free))
  return paged_kv.BlockMeta(ref_count=jnp.asarray((~free).astype(np.int32)),
                            slots=jnp.zeros((n, 1), jnp.uint32), last_use=jnp.zeros(n, jnp.int32),
                            region=jnp.zeros(n, jnp.int8), free_bits=bits, free_counts=counts,
                            num_free=jnp.int32(free.sum()))


class FreeIndexTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("one_word", 20), ("two_words", 33), ("one_level", 1000),
                                  ("two_levels", 1025), ("three_levels", 40000))
  def test_lowest_free_matches_numpy(self, n):
    rng = np.random.default_rng(n)
    free = rng.random(n) < 0.3
    free[-1] = True  # the last block, at the edge of the padding
    meta = _meta(free)
    want = np.flatnonzero(free)
    ranks = np.concatenate([np.arange(min(64, want.size)), [want.size - 1, want.size, -1, n]])
    got = np.asarray(self.variant(alloc.lowest_free)(meta, jnp.asarray(ranks, jnp.int32)))
    expect = np.where((ranks >= 0) & (ranks < want.size), want[np.clip(ranks, 0, want.size - 1)],
                      -1)
    np.testing.assert_array_equal(got, expect)

  @chex.variants(with_jit=True, without_jit=True)
  def test_mark_blocks_matches_rebuild(self):
    n = 5000
    rng = np.random.default_rng(1)
    free = rng.random(n) < 0.5
    meta = _meta(free)
    take = rng.choice(np.flatnonzero(free), 40, replace=False)
    give = rng.choice(np.flatnonzero(~free), 40, replace=False)
    blocks = np.concatenate([take, give, [-1, n]]).astype(np.int32)
    delta = np.concatenate([-np.ones(40), np.ones(40), [1, 1]]).astype(np.int32)
    out = self.variant(alloc.mark_blocks)(meta, jnp.asarray(blocks), jnp.asarray(delta))
    free[take], free[give] = False, True
    bits, counts = build_free_index(jnp.asarray(free))
    np.testing.assert_array_equal(out.free_bits, bits)
    np.testing.assert_array_equal(out.free_counts, counts)
    self.assertEqual(int(out.num_free), int(free.sum()))

  def test_levels(self):
    self.assertEqual(free_index_levels(32), ((1,), (0,)))
    self.assertEqual(free_index_levels(1 << 20), ((32768, 1024, 32), (0, 0, 1024)))

  def test_free_list_view_and_compat_constructor(self):
    """`free_list` keeps the old layout; `replace(meta, free_list=...)` sets the index."""
    free = np.zeros(64, bool)
    free[[3, 5, 6, 40]] = True
    meta = _meta(free)
    fl = np.asarray(meta.free_list)
    np.testing.assert_array_equal(fl[-4:], [3, 5, 6, 40])
    self.assertTrue((fl[:-4] == -1).all())
    rebuilt, num = alloc.rebuild_free_list(meta.ref_count, meta.region)
    again = dataclasses.replace(meta, free_list=rebuilt, num_free=num)
    np.testing.assert_array_equal(again.free_bits, meta.free_bits)
    np.testing.assert_array_equal(again.free_counts, meta.free_counts)
    # Unflattening (tree.map) stores the leaves as they are, whatever they are.
    self.assertIsNone(jax.tree.map(lambda x: None, meta).free_bits)


def _ref_run(free: np.ndarray, num: int, fit: str):
  """Start of the first (or shortest, lowest) run of `num` free blocks, or None."""
  runs, i, n = [], 0, free.size
  while i < n:
    if free[i]:
      j = i
      while j < n and free[j]:
        j += 1
      runs.append((i, j - i))
      i = j
    else:
      i += 1
  fits = [(s, ln) for s, ln in runs if ln >= num]
  if not fits:
    return None
  if fit == "first":
    return fits[0][0]
  return min(fits, key=lambda r: (r[1], r[0]))[0]


@pytest.mark.slow
class AllocateTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True)
  @parameterized.parameters(("prefer", "first"), ("prefer", "best"), ("require", "first"),
                            ("require", "best"), ("never", "first"))  # never ignores fit
  def test_matches_reference(self, contiguous, fit):
    self._check_against_reference(contiguous, fit)

  @chex.variants(without_jit=True)
  @parameterized.parameters(("prefer", "first"), ("require", "best"))
  def test_matches_reference_eagerly(self, contiguous, fit):
    # Op by op the reference check costs ~10x the jitted one: two modes cover the
    # eager path (CI time); every mode runs jitted above.
    self._check_against_reference(contiguous, fit)

  def _check_against_reference(self, contiguous, fit):
    config = paged_kv.PoolConfig(num_blocks=96, block_size=4, num_layers=1, num_kv_heads=1,
                                 head_dim=2, max_seqs=4, max_segments=4)
    rng = np.random.default_rng(7)
    fn = self.variant(functools.partial(alloc.allocate.__wrapped__, config=config, max_blocks=8,
                                        contiguous=contiguous, fit=fit))
    for trial in range(3):
      free = rng.random(96) < (0.3 + 0.2 * trial)
      state = paged_kv.init_pool(config)
      ref = jnp.asarray((~free).astype(np.int32))
      bits, counts = build_free_index(jnp.asarray(free))
      state = dataclasses.replace(state, meta=dataclasses.replace(
          state.meta, ref_count=ref, free_bits=bits, free_counts=counts,
          num_free=jnp.int32(free.sum())))
      for num in (0, 1, 3, 6):
        new, (ids, status) = fn(state, jnp.int32(num))
        ids, status = np.asarray(ids), int(status)
        lowest = np.flatnonzero(free)[:num]
        run = _ref_run(free, num, fit) if num > 1 else None
        if num > free.sum():
          self.assertEqual(status, paged_kv.Status.NO_FREE_BLOCK)
          continue
        if contiguous == "require" and num > 1 and run is None:
          self.assertEqual(status, paged_kv.Status.NO_CONTIGUOUS_RUN)
          jax.tree.map(np.testing.assert_array_equal, new.meta, state.meta)
          continue
        self.assertEqual(status, paged_kv.Status.OK)
        want = (np.arange(run, run + num) if contiguous != "never" and run is not None
                else lowest)
        np.testing.assert_array_equal(ids[:num], want)
        self.assertTrue((ids[num:] == -1).all())
        after = free.copy()
        after[want] = False
        np.testing.assert_array_equal(
            np.asarray(alloc.lowest_free(new.meta, jnp.arange(96))),
            np.pad(np.flatnonzero(after), (0, 96 - after.sum()), constant_values=-1))


class LargestFreeRunTest(chex.TestCase, parameterized.TestCase):
  """`compact.largest_run_of_bits` (on the free bit words) equals `largest_run` (on the mask)."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("one_word", 20), ("exact_words", 64), ("odd", 1000),
                                  ("not_power_of_two_words", 3 * 32 + 5))
  def test_matches_the_mask_version(self, n):
    rng = np.random.default_rng(n)
    masks = [np.zeros(n, bool), np.ones(n, bool)]
    for p in (0.1, 0.5, 0.9, 0.99):
      masks.append(rng.random(n) < p)
    # Runs that start and end at word edges, and span several whole words.
    edge = np.zeros(n, bool)
    edge[min(31, n - 1):min(31 + 70, n)] = True
    masks.append(edge)
    tail = np.zeros(n, bool)
    tail[-min(n, 40):] = True
    masks.append(tail)
    run = self.variant(compact.largest_run_of_bits)
    for mask in masks:
      bits, _ = jax.jit(build_free_index)(jnp.asarray(mask))
      want = int(jax.jit(compact.largest_run)(jnp.asarray(mask)))
      self.assertEqual(int(run(bits)), want)
      self.assertEqual(want, metrics.largest_free_run(mask))


class ChangeRefsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_repeated_ids_free_once(self):
    """A block named twice in one decref batch frees once; the index stays exact."""
    config = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                                 head_dim=2, max_seqs=4, max_segments=4)
    pool = paged_kv.BlockPool(config)
    ids = pool.allocate(4)
    pool.apply_ref_deltas(ids, [1, 1, 0, 0])  # blocks 0, 1 at 2 refs
    fn = self.variant(lambda s, b, d: alloc.change_refs(s, b, d, config=config))
    state = fn(pool.state, jnp.asarray([0, 0, 1, 2, 64, 2], jnp.int32),
               jnp.asarray([-1, -1, -1, 0, -1, -1], jnp.int32))
    ref = np.asarray(state.meta.ref_count)
    np.testing.assert_array_equal(ref[:4], [0, 1, 0, 1])
    paged_kv.check_invariants(state, extra_blocks=[1, 3])
    self.assertEqual(int(state.meta.num_free), 62)
    self.assertEqual(int(state.meta.region[0]), REGION_DYNAMIC)


if __name__ == "__main__":
  absltest.main()
