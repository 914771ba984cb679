"""`StepPlan` and `StepMetadata`: the host and the in-jit constructors (reserving or reading
the host's reservation) agree, field by field."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import sequences
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.model import StepMetadata, StepPlan, metadata

CFG = paged_kv.PoolConfig(num_blocks=12, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=6, max_segments=6)
_FIELDS = ("seq_ids", "positions", "slot_mapping", "cu_q_lens", "seg_block", "seg_start",
           "seg_length", "num_segments", "seq_lens", "num_decodes", "num_prefills")


def _pool_with_history():
  """Rows 0..3 open; rows 0 and 1 hold 5 and 3 cached tokens, rows 2 and 3 none."""
  state = paged_kv.init_pool(CFG)
  z = jnp.zeros((4, 1), jnp.int32)
  state, status = sequences.open_sequence(state, jnp.arange(4, dtype=jnp.int32), z, z, z,
                                         jnp.zeros((4,), jnp.int32), config=CFG)
  np.testing.assert_array_equal(status, 0)
  state, (_, status) = sequences.reserve_tokens(state, jnp.array([0, 1, -1, -1], jnp.int32),
                                               jnp.array([5, 3, 0, 0], jnp.int32), config=CFG,
                                               max_new_tokens=8)
  np.testing.assert_array_equal(status, 0)
  return state


def _plan():
  # Two decodes (rows 0 and 1), a 6-token prefill chunk (row 3), a 2-token chunk (row 2).
  return StepPlan.build([(0, [7]), (1, [8]), (3, [1, 2, 3, 4, 5, 6]), (2, [9, 9])],
                        num_rows=6, max_query_len=8)


def _with_reserved(plan, slot_idx, status):
  """`plan` carrying the reservation as the host hands it over (`plan.reserved`)."""
  return dataclasses.replace(plan, reserved=metadata.reserved_slots(plan, slot_idx, status))


def _reserve(state, plan):
  state, (slot_idx, status) = sequences.reserve_tokens(
      state, plan.seq_ids, plan.num_new, config=CFG, max_new_tokens=plan.max_query_len)
  return state, slot_idx, status


class StepPlanTest(absltest.TestCase):

  def test_build_packs_rows_ragged_and_pads(self):
    plan = _plan()
    np.testing.assert_array_equal(plan.seq_ids, [0, 1, 3, 2, -1, -1])
    np.testing.assert_array_equal(plan.num_new, [1, 1, 6, 2, 0, 0])
    self.assertEqual(plan.num_tokens, 16)  # 10 tokens, rounded up to a power of two
    np.testing.assert_array_equal(plan.tokens[:10], [7, 8, 1, 2, 3, 4, 5, 6, 9, 9])
    self.assertEqual(jax.tree_util.tree_structure(plan).num_leaves, 3)  # max_query_len static

  def test_build_rejects_bad_rows(self):
    with self.assertRaisesRegex(InvalidArgument, "max_query_len"):
      StepPlan.build([(0, [1, 2, 3])], num_rows=2, max_query_len=2)
    with self.assertRaisesRegex(InvalidArgument, "rows"):
      StepPlan.build([(0, [1]), (1, [1]), (2, [1])], num_rows=2, max_query_len=1)
    with self.assertRaisesRegex(InvalidArgument, "tokens"):
      StepPlan.build([(0, [1, 2])], num_rows=2, max_query_len=2, num_tokens=1)


class StepMetadataTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_host_and_in_jit_constructors_agree(self):
    state = _pool_with_history()
    plan = _plan()
    state, slot_idx, status = _reserve(state, plan)
    np.testing.assert_array_equal(status, 0)
    host = StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx))
    device = self.variant(StepMetadata.from_reservation)(plan, state.table, slot_idx, status)
    self.assertEqual(host.max_query_len, device.max_query_len)
    reserved = self.variant(StepMetadata.from_reserved)(_with_reserved(plan, slot_idx, status),
                                                        state.table)
    for name in _FIELDS:
      np.testing.assert_array_equal(getattr(host, name), getattr(device, name), err_msg=name)
      np.testing.assert_array_equal(getattr(reserved, name), getattr(device, name), err_msg=name)
    # The expected values, spelled out.
    np.testing.assert_array_equal(host.cu_q_lens, [0, 1, 2, 8, 10, 10, 10])
    np.testing.assert_array_equal(host.positions[:10], [5, 3, 0, 1, 2, 3, 4, 5, 0, 1])
    self.assertTrue((host.positions[10:] == -1).all() and (host.slot_mapping[10:] == -1).all())
    np.testing.assert_array_equal(host.seq_lens, [6, 4, 6, 2, 0, 0])
    self.assertEqual((int(host.num_decodes), int(host.num_prefills)), (2, 2))
    # Row 0's new token follows its 5 cached ones in place: block of token 4, slot 1.
    t = state.table
    self.assertEqual(int(host.slot_mapping[0]), int(t.block[0, 1]) * CFG.block_size + 1)
    ns = np.asarray(host.num_segments)
    for b, seq in enumerate(np.asarray(plan.seq_ids)[:4]):
      np.testing.assert_array_equal(host.seg_block[b, :ns[b]], t.block[seq, :ns[b]])
      self.assertTrue((host.seg_block[b, ns[b]:] == 0).all())

  @chex.variants(with_jit=True, without_jit=True)
  def test_failed_rows_keep_their_layout_and_attend_to_nothing(self):
    state = _pool_with_history()
    # Leave 1 free block: row 0's decode fits in place, row 3's 6 tokens do not.
    free = int(state.meta.num_free)
    state, (_, ok) = paged_kv.allocate(state, free - 1, config=CFG, max_blocks=CFG.num_blocks,
                                       contiguous="never")
    self.assertEqual(int(ok), 0)
    plan = StepPlan.build([(0, [7]), (3, [1, 2, 3, 4, 5, 6])], num_rows=4, max_query_len=8)
    state, slot_idx, status = _reserve(state, plan)
    self.assertEqual(np.asarray(status).tolist(), [Status.OK, Status.NO_FREE_BLOCK, 0, 0])
    host = StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx), np.asarray(status))
    device = self.variant(StepMetadata.from_reservation)(plan, state.table, slot_idx, status)
    reserved = self.variant(StepMetadata.from_reserved)(_with_reserved(plan, slot_idx, status),
                                                        state.table)
    for name in _FIELDS:
      np.testing.assert_array_equal(getattr(host, name), getattr(device, name), err_msg=name)
      np.testing.assert_array_equal(getattr(reserved, name), getattr(device, name), err_msg=name)
    np.testing.assert_array_equal(host.cu_q_lens, [0, 1, 7, 7, 7])
    self.assertTrue((host.slot_mapping[1:7] == -1).all())
    self.assertEqual(int(host.num_segments[1]), 0)
    self.assertEqual(int(host.seq_lens[1]), 0)
    self.assertEqual((int(host.num_decodes), int(host.num_prefills)), (1, 0))

  def test_is_a_pytree_with_a_static_bound(self):
    state = _pool_with_history()
    plan = _plan()
    state, slot_idx, status = _reserve(state, plan)
    meta = StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx))
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    self.assertLen(leaves, len(_FIELDS))
    self.assertEqual(jax.tree_util.tree_unflatten(treedef, leaves).max_query_len, 8)
    out = jax.jit(lambda m: m.q_lens * m.max_query_len)(meta)
    np.testing.assert_array_equal(out, [8, 8, 48, 16, 0, 0])

  def test_host_constructor_validates(self):
    state = _pool_with_history()
    plan = _plan()
    state, slot_idx, _ = _reserve(state, plan)
    with self.assertRaisesRegex(InvalidArgument, "width of slot_idx"):
      StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx)[:, :2])
    with self.assertRaisesRegex(InvalidArgument, "agree"):
      StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx)[:3])
    bad = StepPlan.build([(5, [1])], num_rows=6, max_query_len=8)  # row 5 is not open
    with self.assertRaisesRegex(InvalidArgument, "not all active"):
      StepMetadata.from_plan(bad, state.table, np.asarray(slot_idx))

  def test_reserved_slots_validates_and_masks(self):
    state = _pool_with_history()
    plan = _plan()
    state, slot_idx, status = _reserve(state, plan)
    with self.assertRaisesRegex(InvalidArgument, "for the plan's rows"):
      metadata.reserved_slots(plan, np.asarray(slot_idx)[:3], np.asarray(status)[:3])
    with self.assertRaisesRegex(InvalidArgument, "for the plan's rows"):
      metadata.reserved_slots(plan, np.asarray(slot_idx)[0], np.asarray(status))
    failed = np.asarray(status).copy()
    failed[2] = Status.NO_FREE_BLOCK  # row 3's chunk: tokens 2..7 of the layout
    got = metadata.reserved_slots(plan, slot_idx, failed)
    self.assertEqual((got.slot_mapping.shape, got.status.shape), ((16,), (6,)))
    self.assertTrue((got.slot_mapping[2:8] == -1).all() and (got.slot_mapping[10:] == -1).all())
    self.assertTrue((got.slot_mapping[:2] >= 0).all() and (got.slot_mapping[8:10] >= 0).all())

  def test_reserved_slots_host_form_equals_the_general_one(self):
    rng = np.random.default_rng(0)
    for _ in range(400):
      b, w = int(rng.integers(1, 40)), int(rng.choice([1, 2, 5, 16]))
      num_new = rng.integers(0, w + 1, b).astype(np.int32)
      if rng.random() < 0.5:  # a step's layout: one-token rows, then chunks, then padding
        nd, nc = int(rng.integers(0, b + 1)), int(rng.integers(0, 6))
        num_new[:nd] = 1
        num_new[nd + nc:] = 0
      if rng.random() < 0.1:
        num_new[rng.integers(0, b)] = w + 2  # wider than slot_idx: the general form
      seq_ids = rng.integers(-1, 30, b).astype(np.int32)
      t = max(1, int(num_new.sum()) + int(rng.integers(-2, 6)))
      plan = StepPlan(seq_ids=seq_ids, num_new=num_new, tokens=np.zeros(t, np.int32),
                      max_query_len=w)
      slot_idx = rng.integers(-1, 500, (b, w)).astype(np.int32)
      status = np.where(rng.random(b) < 0.8, 0, int(Status.NO_FREE_BLOCK)).astype(np.int32)
      np.testing.assert_array_equal(
          metadata.reserved_slots(plan, slot_idx, status).slot_mapping,
          metadata.token_slots(np, plan, slot_idx, status))


if __name__ == "__main__":
  absltest.main()
