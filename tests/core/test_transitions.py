"""Unit tests of the pure transitions, each in jit and non-jit variants (chex)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.core import alloc, kv, sequences
from paged_kv.core.errors import Status

CFG = paged_kv.PoolConfig(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2,
                          head_dim=3, max_seqs=4, max_segments=6)


def _open_empty(state, ids, cfg=CFG):
  b = len(ids)
  z = jnp.zeros((b, 1), jnp.int32)
  state, status = sequences.open_sequence(state, jnp.asarray(ids, jnp.int32), z, z, z,
                                         jnp.zeros((b,), jnp.int32), config=cfg)
  np.testing.assert_array_equal(status, 0)
  return state


def _reserve(state, ids, counts, t=8, cfg=CFG):
  state, (slots, status) = sequences.reserve_tokens(state, jnp.asarray(ids, jnp.int32),
                                                   jnp.asarray(counts, jnp.int32), config=cfg,
                                                   max_new_tokens=t)
  return state, np.asarray(slots), np.asarray(status)


class TransitionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_allocate_lowest_first_and_contiguous(self):
    fn = self.variant(alloc.allocate.__wrapped__,
                      static_argnames=("config", "max_blocks", "contiguous"))
    state = paged_kv.init_pool(CFG)
    state, (ids, status) = fn(state, 3, config=CFG, max_blocks=4)
    np.testing.assert_array_equal(ids, [0, 1, 2, -1])
    self.assertEqual(int(status), Status.OK)
    # Free block 1 only: a 2-block request must skip the hole for a run.
    state, st = alloc.apply_ref_deltas(state, jnp.array([1]), jnp.array([-1]), config=CFG)
    state, (ids, status) = fn(state, 2, config=CFG, max_blocks=2)
    np.testing.assert_array_equal(ids, [3, 4])
    state, (ids, status) = fn(state, 1, config=CFG, max_blocks=2)
    np.testing.assert_array_equal(ids, [1, -1])
    state, (ids, status) = fn(state, 12, config=CFG, max_blocks=16)
    self.assertEqual(int(status), Status.NO_FREE_BLOCK)
    np.testing.assert_array_equal(ids, -1)
    state, (ids, status) = fn(state, -1, config=CFG, max_blocks=2)
    self.assertEqual(int(status), Status.INVALID_COUNT)
    paged_kv.check_invariants(state, [(b, 0, 0) for b in []] or None, raise_on_error=False)

  @chex.variants(with_jit=True, without_jit=True)
  def test_allocate_require_contiguous(self):
    fn = self.variant(alloc.allocate.__wrapped__,
                      static_argnames=("config", "max_blocks", "contiguous"))
    state = paged_kv.init_pool(CFG)
    state, (ids, _) = fn(state, 16, config=CFG, max_blocks=16)
    odd = jnp.arange(1, 16, 2)
    state, st = alloc.apply_ref_deltas(state, odd, -jnp.ones_like(odd), config=CFG)
    np.testing.assert_array_equal(st, 0)
    state, (ids, status) = fn(state, 2, config=CFG, max_blocks=2, contiguous="require")
    self.assertEqual(int(status), Status.NO_CONTIGUOUS_RUN)
    state, (ids, status) = fn(state, 2, config=CFG, max_blocks=2, contiguous="prefer")
    np.testing.assert_array_equal(ids, [1, 3])

  @chex.variants(with_jit=True, without_jit=True)
  def test_open_sequence_with_shared_prefix(self):
    fn = self.variant(sequences.open_sequence.__wrapped__, static_argnames=("config", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0])
    state, slots, _ = _reserve(state, [0], [6])
    blk = jnp.array([[0, 1]]); start = jnp.array([[0, 0]]); length = jnp.array([[4, 1]])
    state, status = fn(state, jnp.array([2]), blk, start, length, jnp.array([2]), config=CFG)
    np.testing.assert_array_equal(status, [0])
    np.testing.assert_array_equal(state.table.seq_len[2], 5)
    np.testing.assert_array_equal(state.meta.ref_count[:2], [2, 2])
    # Unwritten slots (block 1 slot 3), free blocks and active rows are refused.
    for bad_blk, bad_start, bad_len, row, code in (
        ([[1]], [[3]], [[1]], 3, Status.INVALID_SEGMENT),
        ([[9]], [[0]], [[1]], 3, Status.INVALID_BLOCK),
        ([[0]], [[2]], [[3]], 3, Status.INVALID_SEGMENT),
        ([[0]], [[0]], [[1]], 0, Status.INVALID_SEQUENCE)):
      before = jax.tree.map(np.asarray, state)
      state, status = fn(state, jnp.array([row]), jnp.array(bad_blk), jnp.array(bad_start),
                         jnp.array(bad_len), jnp.array([1]), config=CFG)
      np.testing.assert_array_equal(status, [code])
      jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))
    paged_kv.check_invariants(state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reserve_tokens_in_place_then_new_block(self):
    fn = self.variant(sequences.reserve_tokens.__wrapped__,
                      static_argnames=("config", "max_new_tokens", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0, 1])
    state, (slots, status) = fn(state, jnp.array([0, 1]), jnp.array([3, 5]), config=CFG,
                                max_new_tokens=8)
    np.testing.assert_array_equal(status, [0, 0])
    np.testing.assert_array_equal(slots, [[0, 1, 2, -1, -1, -1, -1, -1],
                                          [4, 5, 6, 7, 8, -1, -1, -1]])
    state, (slots, status) = fn(state, jnp.array([0, 1]), jnp.array([2, 1]), config=CFG,
                                max_new_tokens=2)
    # seq 0: slot 3 of block 0 in place, then a fresh block 3; seq 1: in place in block 2.
    np.testing.assert_array_equal(slots, [[3, 12], [9, -1]])
    np.testing.assert_array_equal(state.table.num_segments[:2], [2, 2])
    np.testing.assert_array_equal(state.table.seq_len[:2], [5, 6])
    paged_kv.check_invariants(state)

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.slow
  def test_reserve_failures_leave_rows_untouched(self):
    fn = self.variant(sequences.reserve_tokens.__wrapped__,
                      static_argnames=("config", "max_new_tokens", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0, 1, 2])
    # Row 0 takes 12 blocks of 16; row 1 wants 8 more (no room); row 3 inactive; -1 padding.
    state, (slots, status) = fn(state, jnp.array([0, 1, 3, -1, 2]),
                                jnp.array([24, 32, 1, 0, 4]), config=CFG, max_new_tokens=32)
    np.testing.assert_array_equal(status, [0, Status.TABLE_FULL, Status.INVALID_SEQUENCE, 0, 0])
    self.assertTrue((slots[1:4] == -1).all())
    np.testing.assert_array_equal(state.table.seq_len[:3], [24, 0, 4])
    state, (slots, status) = fn(state, jnp.array([1, 2]), jnp.array([24, 1]), config=CFG,
                                max_new_tokens=24)
    # Row 1 takes 6 of the 9 free blocks, row 2 one more: 2 blocks stay free.
    np.testing.assert_array_equal(status, [0, 0])
    self.assertEqual(int(state.meta.num_free), 2)
    # Row 2 fits 3 tokens in place and needs 3 blocks for 9 more: refused, untouched.
    state, (slots, status) = fn(state, jnp.array([2, 1]), jnp.array([12, 0]), config=CFG,
                                max_new_tokens=12)
    np.testing.assert_array_equal(status, [Status.NO_FREE_BLOCK, 0])
    np.testing.assert_array_equal(state.table.seq_len[2], 5)
    self.assertEqual(int(state.meta.num_free), 2)
    paged_kv.check_invariants(state)
    # Atomic: one failure, nothing applied, the valid row reports ABORTED.
    before = jax.tree.map(np.asarray, state)
    state, (slots, status) = fn(state, jnp.array([2, 1]), jnp.array([1, -1]), config=CFG,
                                max_new_tokens=8, atomic=True)
    np.testing.assert_array_equal(status, [Status.ABORTED, Status.INVALID_COUNT])
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))

  @chex.variants(with_jit=True, without_jit=True)
  def test_reserve_rejects_duplicates(self):
    fn = self.variant(sequences.reserve_tokens.__wrapped__,
                      static_argnames=("config", "max_new_tokens", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0])
    state, (slots, status) = fn(state, jnp.array([0, 0]), jnp.array([1, 1]), config=CFG,
                                max_new_tokens=1)
    np.testing.assert_array_equal(status, [0, Status.INVALID_SEQUENCE])
    np.testing.assert_array_equal(state.table.seq_len[0], 1)

  @chex.variants(with_jit=True, without_jit=True)
  def test_fork_shares_and_first_append_avoids_shared_block(self):
    fn = self.variant(sequences.fork.__wrapped__, static_argnames=("config", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0])
    state, _, _ = _reserve(state, [0], [6])
    state, status = fn(state, jnp.array([0, 0]), jnp.array([1, 2]), config=CFG)
    np.testing.assert_array_equal(status, [0, 0])
    np.testing.assert_array_equal(state.meta.ref_count[:2], [3, 3])
    state, slots, status = _reserve(state, [0, 1, 2], [1, 1, 1], t=1)
    np.testing.assert_array_equal(status, 0)
    self.assertFalse(np.isin(slots // CFG.block_size, [0, 1]).any())
    self.assertEqual(len(set(slots.ravel().tolist())), 3)
    state, status = fn(state, jnp.array([3]), jnp.array([0]), config=CFG)  # src inactive
    np.testing.assert_array_equal(status, [Status.INVALID_SEQUENCE])
    paged_kv.check_invariants(state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_release_frees_blocks_in_address_order(self):
    fn = self.variant(sequences.release.__wrapped__, static_argnames=("config", "atomic"))
    state = _open_empty(paged_kv.init_pool(CFG), [0, 1])
    state, _, _ = _reserve(state, [0, 1], [8, 4])
    state, status = fn(state, jnp.array([0]), config=CFG)
    np.testing.assert_array_equal(status, [0])
    self.assertEqual(int(state.meta.num_free), 15)
    self.assertFalse(bool(state.table.active[0]))
    state, slots, _ = _reserve(state, [1], [5])  # lowest free addresses come back first
    np.testing.assert_array_equal(slots[0, :5] // CFG.block_size, [0, 0, 0, 0, 1])
    state, status = fn(state, jnp.array([0]), config=CFG)  # double release
    np.testing.assert_array_equal(status, [Status.INVALID_SEQUENCE])
    paged_kv.check_invariants(state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_apply_ref_deltas(self):
    fn = self.variant(alloc.apply_ref_deltas.__wrapped__, static_argnames=("config",))
    state = _open_empty(paged_kv.init_pool(CFG), [0])
    state, _, _ = _reserve(state, [0], [8])
    state, status = fn(state, jnp.array([0, 0, 1, -1]), jnp.array([1, 1, 1, 0]), config=CFG)
    np.testing.assert_array_equal(status, [0, 0, 0, 0])
    np.testing.assert_array_equal(state.meta.ref_count[:2], [3, 2])
    for ids, deltas, code in (([0], [-4], Status.REF_UNDERFLOW), ([5], [1], Status.INVALID_BLOCK),
                              ([16], [1], Status.INVALID_BLOCK)):
      before = jax.tree.map(np.asarray, state)
      state, status = fn(state, jnp.array(ids), jnp.array(deltas), config=CFG)
      np.testing.assert_array_equal(status, [code])
      jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))
    paged_kv.check_invariants(state, [(0, 0, 4), (0, 0, 4), (1, 0, 4)])

  @chex.variants(with_jit=True, without_jit=True)
  def test_write_and_gather_kv(self):
    write = self.variant(kv.write_kv)
    state = _open_empty(paged_kv.init_pool(CFG), [0, 1])
    state, slots, _ = _reserve(state, [0, 1], [5, 3])
    key = jax.random.key(1)
    k = jax.random.normal(key, slots.shape + (2, 3))
    v = -k
    pages = state.pages
    for layer in range(2):
      pages = write(pages, layer, jnp.asarray(slots), k + layer, v - layer)
    state = state.__class__(pages=pages, meta=state.meta, table=state.table, step=state.step)
    gk, gv, valid = kv.gather_kv(state, 0, max_len=8)
    np.testing.assert_array_equal(valid, [True] * 5 + [False] * 3)
    np.testing.assert_array_equal(gk[1, :, :5], np.transpose(k[0, :5] + 1, (1, 0, 2)))
    np.testing.assert_array_equal(gv[0, :, :5], np.transpose(v[0, :5], (1, 0, 2)))
    np.testing.assert_array_equal(gk[:, :, 5:], 0)
    # Bad shapes and dtypes are refused.
    with self.assertRaises(ValueError):
      kv.write_kv(pages, 0, jnp.asarray(slots), k[..., :2], v[..., :2])
    with self.assertRaises(ValueError):
      kv.write_kv(pages, 0, jnp.asarray(slots), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))


# Only the variants without jit (op by op) are slow; chex generates them from the
# methods above, so they are marked by their generated names.
pytest.mark.slow(TransitionTest.test_allocate_lowest_first_and_contiguous__without_jit)
pytest.mark.slow(TransitionTest.test_allocate_require_contiguous__without_jit)


class ConfigTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(num_blocks=0), dict(block_size=3), dict(block_size=256), dict(head_dim=-1),
      dict(dtype="int8"), dict(base_pool_fraction=1.0), dict(max_seqs=2.5))
  def test_rejects_bad_config(self, **kw):
    args = dict(num_blocks=8)
    args.update(kw)
    with self.assertRaises(ValueError):
      paged_kv.PoolConfig(**args)

  def test_hashable_and_shapes(self):
    cfg = paged_kv.PoolConfig(num_blocks=10, block_size=64, dtype=jnp.bfloat16,
                              base_pool_fraction=0.2)
    self.assertEqual(hash(cfg), hash(paged_kv.PoolConfig(num_blocks=10, block_size=64,
                                                         dtype="bfloat16",
                                                         base_pool_fraction=0.2)))
    state = paged_kv.init_pool(cfg)
    chex.assert_shape(state.pages.k, (1, 1, 10, 64, 64))
    chex.assert_shape(state.meta.slots, (10, 2))
    self.assertEqual(int(state.meta.num_free), 8)  # 2 base blocks are not handed out
    paged_kv.check_invariants(state)


if __name__ == "__main__":
  absltest.main()


class BestFitTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_best_fit_takes_the_shortest_run_that_fits(self):
    fn = self.variant(alloc.allocate.__wrapped__,
                      static_argnames=("config", "max_blocks", "contiguous", "fit"))
    state = paged_kv.init_pool(CFG)
    state, _ = fn(state, 16, config=CFG, max_blocks=16)
    # Free runs: [1, 5) (4 blocks), [7, 9) (2 blocks), [11, 16) (5 blocks).
    free = jnp.array([1, 2, 3, 4, 7, 8, 11, 12, 13, 14, 15])
    state, st = alloc.apply_ref_deltas(state, free, -jnp.ones_like(free), config=CFG)
    np.testing.assert_array_equal(st, 0)
    for fit, want in (("first", [1, 2]), ("best", [7, 8])):
      s2, (ids, status) = fn(jax.tree.map(jnp.copy, state), 2, config=CFG, max_blocks=2,
                             contiguous="require", fit=fit)
      np.testing.assert_array_equal(ids, want)
      self.assertEqual(int(status), Status.OK)
    s3, (ids, status) = fn(state, 5, config=CFG, max_blocks=8, contiguous="require", fit="best")
    np.testing.assert_array_equal(ids[:5], [11, 12, 13, 14, 15])
    s4, (ids, status) = fn(s3, 6, config=CFG, max_blocks=8, contiguous="require", fit="best")
    self.assertEqual(int(status), Status.NO_CONTIGUOUS_RUN)
