"""Issue J (items 3, 10, 11, 12): every bad input the probe found is refused with a
typed error and the pool state bit-identical; the low-level doors (`write_kv`,
`apply_ref_deltas`, `pack_slots(extra_segments=)`) check ownership; the ghost check
looks both ways; `check_invariants` accounts for `allocate()` holders.

`BAD_POOL_CALLS` and `BAD_CONFIGS` are the bad inputs of the notes table
("bad inputs tried, all typed, state unchanged"): `len(BAD_POOL_CALLS) +
len(BAD_CONFIGS)` of them.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.core import alloc, compact, regions
from paged_kv.core.errors import (BlockInUse, InvalidArgument, InvalidBlock, InvalidSegment,
                                  InvalidSequence, PagedKVError, RefCountOverflow, Status)
from paged_kv.telemetry import metrics

CFG = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2,
                          head_dim=4, max_seqs=4, max_segments=8)
BASE_CFG = dataclasses.replace(CFG, base_pool_fraction=0.25)  # blocks 0, 1: base pool


def _snapshot(pool):
  return jax.tree.map(np.asarray, pool.state)


def _assert_same(test, before, pool):
  after = _snapshot(pool)
  leaves_b, leaves_a = jax.tree.leaves(before), jax.tree.leaves(after)
  test.assertEqual(len(leaves_b), len(leaves_a))
  for b, a in zip(leaves_b, leaves_a):
    np.testing.assert_array_equal(b, a)


def _kv(shape, cfg=CFG, scale=1.0):
  return scale * jax.random.normal(jax.random.key(0), tuple(shape) + (cfg.num_kv_heads,
                                                                      cfg.head_dim),
                                   cfg.jnp_dtype)


def _filled_pool(cfg=CFG):
  """Seq a: 6 tokens (a full block + 2 slots of the next), seq b: 3 tokens."""
  pool = paged_kv.BlockPool(cfg)
  a, b = pool.open_sequence(), pool.open_sequence()
  slots = pool.reserve_tokens([a, b], [6, 3])
  for layer in range(cfg.num_layers):
    pool.write_kv(layer, slots, _kv(slots.shape, cfg), _kv(slots.shape, cfg, 2.0),
                  seq_ids=[a, b])
  return pool, a, b, np.asarray(slots)


def _zeros(n, cfg=CFG):
  return jnp.zeros((n, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype)


def _slot_of(pool, seq, token):
  seg = pool.segments(seq)
  ends = np.cumsum(seg[:, 2])
  i = int(np.searchsorted(ends, token, side="right"))
  before = int(ends[i] - seg[i, 2])
  return int(seg[i, 0]) * pool.config.block_size + int(seg[i, 1]) + token - before


def _b_slot(p, a, b):
  return _slot_of(p, b, 0)


# (name, setup(pool, a, b) or None, call(pool, a, b, slots), expected error, message part)
BAD_POOL_CALLS = [
    # -- item 3: write_kv slot indices, no cast before the range check ------------------
    ("write_int64_wraps_to_other_seq", None,
     lambda p, a, b, s: p.write_kv(0, np.array([2**32 + _b_slot(p, a, b)], np.int64),
                                   _zeros(1), _zeros(1), seq_ids=b), InvalidBlock, "4294967"),
    ("write_uint64_max", None,
     lambda p, a, b, s: p.write_kv(0, np.array([2**64 - 1], np.uint64), _zeros(1), _zeros(1),
                                   seq_ids=b),
     InvalidBlock, "18446744073709551615"),
    ("write_float_slot", None,
     lambda p, a, b, s: p.write_kv(0, np.array([_b_slot(p, a, b) + 0.9]), _zeros(1),
                                   _zeros(1), seq_ids=b), InvalidArgument, "int"),
    ("write_float_slot_jax", None,
     lambda p, a, b, s: p.write_kv(0, jnp.array([4.9]), _zeros(1), _zeros(1), seq_ids=b),
     InvalidArgument, "int"),
    ("write_bool_slot", None,
     lambda p, a, b, s: p.write_kv(0, np.array([True]), _zeros(1), _zeros(1), seq_ids=b),
     InvalidArgument, "int"),
    ("write_slot_below_minus_one", None,
     lambda p, a, b, s: p.write_kv(0, np.array([-2]), _zeros(1), _zeros(1), seq_ids=b),
     InvalidBlock, ""),
    # -- item 10: write_kv ownership -----------------------------------------------------
    ("write_other_seq_slot", None,
     lambda p, a, b, s: p.write_kv(0, np.array([[_b_slot(p, a, b)]]), _zeros(1)[None],
                                   _zeros(1)[None], seq_ids=[a]), BlockInUse, "belongs to"),
    # -- issue P item 2: the writer is required, and one writer covers a 1-D write ------
    ("write_other_seq_slot_one_writer", None,
     lambda p, a, b, s: p.write_kv(0, np.array([_b_slot(p, a, b)]), _zeros(1), _zeros(1),
                                   seq_ids=a), BlockInUse, "belongs to"),
    ("write_layers_other_seq_slot", None,
     lambda p, a, b, s: p.write_kv_layers(np.array([_b_slot(p, a, b)]),
                                          jnp.zeros((2, 2, 1, 4)), jnp.zeros((2, 2, 1, 4)),
                                          seq_ids=[a]), BlockInUse, "belongs to"),
    ("write_free_block", None,
     lambda p, a, b, s: p.write_kv(0, np.array([7 * 4]), _zeros(1), _zeros(1), seq_ids=a),
     InvalidBlock, "free"),
    ("write_unhanded_slot", None,
     lambda p, a, b, s: p.write_kv(0, np.array([_slot_of(p, a, 5) + 1]), _zeros(1),
                                   _zeros(1), seq_ids=a), InvalidSegment, "handed"),
    ("write_duplicate_slots", None,
     lambda p, a, b, s: p.write_kv(0, np.array([_b_slot(p, a, b)] * 2), _zeros(2), _zeros(2),
                                   seq_ids=b),
     InvalidArgument, "more than once"),
    ("write_shared_slot_after_fork", lambda p, a, b: p.fork(b),
     lambda p, a, b, s: p.write_kv(0, np.array([_b_slot(p, a, b)]), _zeros(1), _zeros(1),
                                   seq_ids=b),
     BlockInUse, "shared"),
    ("write_cache_held_block", lambda p, a, b: p.apply_ref_deltas([p.segments(b)[0, 0]], [1]),
     lambda p, a, b, s: p.write_kv(0, np.array([_b_slot(p, a, b)]), _zeros(1), _zeros(1),
                                   seq_ids=b),
     BlockInUse, "outside"),
    ("write_allocated_block", lambda p, a, b: p.allocate(1),
     lambda p, a, b, s: p.write_kv(0, np.array([3 * 4]), _zeros(1), _zeros(1), seq_ids=a),
     InvalidSegment, "handed"),
    ("write_seq_ids_wrong_shape", None,
     lambda p, a, b, s: p.write_kv(0, s, _kv(s.shape), _kv(s.shape), seq_ids=[a]),
     InvalidArgument, "seq_ids"),
    ("write_seq_ids_inactive", None,
     lambda p, a, b, s: p.write_kv(0, s, _kv(s.shape), _kv(s.shape), seq_ids=[a, 3]),
     InvalidSequence, ""),
    # -- item 12: write_kv layer and K/V types -------------------------------------------
    ("write_layer_true", None,
     lambda p, a, b, s: p.write_kv(True, s, _kv(s.shape), _kv(s.shape), seq_ids=[a, b]),
     InvalidArgument,
     "layer"),
    ("write_layer_np_bool", None,
     lambda p, a, b, s: p.write_kv(np.bool_(False), s, _kv(s.shape), _kv(s.shape),
                                   seq_ids=[a, b]),
     InvalidArgument, "layer"),
    ("write_layer_float", None,
     lambda p, a, b, s: p.write_kv(1.0, s, _kv(s.shape), _kv(s.shape), seq_ids=[a, b]),
     InvalidArgument,
     "layer"),
    ("write_layer_jax_out_of_range", None,
     lambda p, a, b, s: p.write_kv(jnp.int32(2), s, _kv(s.shape), _kv(s.shape),
                                   seq_ids=[a, b]),
     InvalidArgument, "layer"),
    ("write_list_kv", None,
     lambda p, a, b, s: p.write_kv(0, s, np.asarray(_kv(s.shape)).tolist(),
                                   np.asarray(_kv(s.shape)).tolist(), seq_ids=[a, b]),
     InvalidArgument, "k"),
    ("write_object_kv", None,
     lambda p, a, b, s: p.write_kv(0, s, [object()], [object()], seq_ids=[a, b]),
     InvalidArgument, "k"),
    # -- item 10: apply_ref_deltas ---------------------------------------------------------
    ("deltas_free_live_seq_block", None,
     lambda p, a, b, s: p.apply_ref_deltas([p.segments(b)[0, 0]], [-1]), BlockInUse, ""),
    ("deltas_below_table_refs", lambda p, a, b: p.fork(b),
     lambda p, a, b, s: p.apply_ref_deltas([p.segments(b)[0, 0]], [-1]), BlockInUse, ""),
    ("deltas_overflow_on_device", None,
     lambda p, a, b, s: p.apply_ref_deltas([0], [2**31 - 1]), RefCountOverflow, ""),
    ("deltas_summed_overflow", None,
     lambda p, a, b, s: p.apply_ref_deltas([0, 0], [2**31 - 1, 2**31 - 1]),
     RefCountOverflow, "int32"),
    ("deltas_uint64", None,
     lambda p, a, b, s: p.apply_ref_deltas([0], np.array([2**64 - 1], np.uint64)),
     InvalidArgument, "18446744073709551615"),
    ("reserve_uint64_count", None,
     lambda p, a, b, s: p.reserve_tokens([a], np.array([2**64 - 1], np.uint64)),
     InvalidArgument, "18446744073709551615"),
    ("deltas_bool", None,
     lambda p, a, b, s: p.apply_ref_deltas([0], [True]), InvalidArgument, ""),
    # -- item 10 / 12: pack_slots --------------------------------------------------------
    ("pack_table_segment_as_extra", None,
     lambda p, a, b, s: p.pack_slots(extra_segments=p.segments(b)), BlockInUse, "outside"),
    ("pack_unheld_extra", None,
     lambda p, a, b, s: p.pack_slots(extra_segments=[[p.segments(a)[1, 0], 0, 2]]),
     BlockInUse, "outside"),
    ("pack_two_extras_one_holder",
     lambda p, a, b: p.apply_ref_deltas([p.segments(b)[0, 0]], [1]),
     lambda p, a, b, s: p.pack_slots(extra_segments=np.repeat(p.segments(b), 2, axis=0)),
     BlockInUse, ""),
    ("pack_table_segments_flat", None,
     lambda p, a, b, s: p.pack_slots(table_segments=[1, 2, 3]), InvalidArgument, "(row, col)"),
    ("pack_table_segments_float", None,
     lambda p, a, b, s: p.pack_slots(table_segments=[[0.5, 1.0]]), InvalidArgument, ""),
    ("pack_table_segments_ragged", None,
     lambda p, a, b, s: p.pack_slots(table_segments=[[0, 1], [2]]), InvalidArgument, ""),
    # -- item 12: compaction, allocation, promotion, resize ------------------------------
    ("compact_bogus_impl", None, lambda p, a, b, s: p.compact(impl="bogus"), InvalidArgument,
     "'xla'"),
    ("compact_budget_true", None, lambda p, a, b, s: p.compact(budget=True), InvalidArgument,
     "budget"),
    ("compact_budget_zero", None, lambda p, a, b, s: p.compact(budget=0), InvalidArgument,
     "budget"),
    ("compact_budget_float", None, lambda p, a, b, s: p.compact(budget=2.5), InvalidArgument,
     "budget"),
    ("move_blocks_bogus_impl", None, lambda p, a, b, s: p.move_blocks([-1], [-1], impl="x"),
     InvalidArgument, "'mosaic'"),
    ("move_blocks_float_plan", None, lambda p, a, b, s: p.move_blocks([2.0], [5.0]),
     InvalidArgument, "src"),
    ("allocate_bogus_contiguous", None, lambda p, a, b, s: p.allocate(1, contiguous="bogus"),
     InvalidArgument, "'prefer'"),
    ("allocate_true", None, lambda p, a, b, s: p.allocate(True), InvalidArgument, "num"),
    ("allocate_float", None, lambda p, a, b, s: p.allocate(2.5), InvalidArgument, "num"),
    ("promote_negative_moves", None, lambda p, a, b, s: p.promote(1, max_moves=-1),
     InvalidArgument, "max_moves"),
    ("promote_float_moves", None, lambda p, a, b, s: p.promote(1, max_moves=2.5),
     InvalidArgument, "max_moves"),
    ("promote_float_readers", None, lambda p, a, b, s: p.promote(2.5), InvalidArgument,
     "min_readers"),
    ("promote_bool_readers", None, lambda p, a, b, s: p.promote(True), InvalidArgument,
     "min_readers"),
    ("resize_beyond_int32", None, lambda p, a, b, s: p.resize(2**30), InvalidArgument,
     "int32"),
    ("resize_float", None, lambda p, a, b, s: p.resize(16.0), InvalidArgument, "num_blocks"),
    ("resize_true", None, lambda p, a, b, s: p.resize(True), InvalidArgument, "num_blocks"),
    ("resize_zero", None, lambda p, a, b, s: p.resize(0), InvalidArgument, "num_blocks"),
]

BAD_CONFIGS = [
    ("scrub_truthy_string", dict(scrub_freed_blocks="no")),
    ("scrub_int", dict(scrub_freed_blocks=1)),
    ("scrub_none", dict(scrub_freed_blocks=None)),
    ("num_blocks_bool", dict(num_blocks=True)),
    ("num_blocks_float", dict(num_blocks=8.0)),
    ("num_blocks_str", dict(num_blocks="8")),
    ("block_size_float", dict(block_size=16.0)),
    ("max_seqs_bool", dict(max_seqs=True)),
    ("base_fraction_str", dict(base_pool_fraction="0.1")),
    ("base_fraction_bool", dict(base_pool_fraction=True)),
    ("base_fraction_nan", dict(base_pool_fraction=float("nan"))),
    ("dtype_int8", dict(dtype="int8")),
    ("dtype_object", dict(dtype=object())),
    ("slots_beyond_int32", dict(num_blocks=2**30, block_size=8)),
    # ~11 TB: 2**21 blocks of 16 tokens, 80 layers, 16 kv heads, head_dim 128, bf16.
    ("eleven_terabytes", dict(num_blocks=2**21, block_size=16, num_layers=80, num_kv_heads=16,
                              head_dim=128, dtype="bfloat16")),
]


class BadPoolCallTest(parameterized.TestCase):
  """Every bad call: its typed error, and the state bit-identical afterwards."""

  @parameterized.named_parameters(*BAD_POOL_CALLS)
  def test_refused_with_typed_error_state_unchanged(self, setup, call, error, part):
    pool, a, b, slots = _filled_pool()
    if setup is not None:
      setup(pool, a, b)
    before = _snapshot(pool)
    with self.assertRaises(error) as ctx:
      call(pool, a, b, slots)
    self.assertIsInstance(ctx.exception, PagedKVError)
    self.assertIn(part, str(ctx.exception))
    _assert_same(self, before, pool)

  def test_a_write_names_its_writer(self):
    """Issue P item 2: without `seq_ids` a write into another live sequence's exclusive
    slot was accepted (only the owner check needs a writer); the writer is required."""
    pool, a, b, _ = _filled_pool()
    before = _snapshot(pool)
    kb, _ = pool.gather_kv(b)
    with self.assertRaisesRegex(TypeError, "seq_ids"):
      pool.write_kv(0, np.array([_b_slot(pool, a, b)]), _zeros(1) + 7, _zeros(1) + 7)
    with self.assertRaisesRegex(TypeError, "seq_ids"):
      pool.write_kv_layers(np.array([_b_slot(pool, a, b)]), jnp.zeros((2, 2, 1, 4)),
                           jnp.zeros((2, 2, 1, 4)))
    _assert_same(self, before, pool)
    np.testing.assert_array_equal(pool.gather_kv(b)[0], kb)
    pool.write_kv(0, np.array([_b_slot(pool, a, b)]), _zeros(1) + 7, _zeros(1) + 7, seq_ids=b)
    self.assertEqual(float(pool.gather_kv(b)[0][0, 0, 0, 0]), 7.0)  # its own: accepted

  def test_int64_wrapped_slot_does_not_overwrite_other_sequence(self):
    pool, a, b, _ = _filled_pool()
    kb, _ = pool.gather_kv(b)
    with self.assertRaises(InvalidBlock):
      pool.write_kv(0, np.array([2**32 + _b_slot(pool, a, b)], np.int64),
                    _zeros(1) + 7, _zeros(1) + 7, seq_ids=a)
    np.testing.assert_array_equal(pool.gather_kv(b)[0], kb)


class BadConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(*BAD_CONFIGS)
  def test_refused_typed(self, kw):
    base = dict(num_blocks=8)
    base.update(kw)
    with self.assertRaises(InvalidArgument) as ctx:
      paged_kv.PoolConfig(**base)
    self.assertIsInstance(ctx.exception, ValueError)  # still a ValueError for old callers

  def test_huge_config_message_names_bytes_and_limit(self):
    with self.assertRaisesRegex(InvalidArgument, "TiB.*MAX_POOL_BYTES"):
      paged_kv.PoolConfig(num_blocks=2**21, block_size=16, num_layers=80, num_kv_heads=16,
                          head_dim=128, dtype="bfloat16")

  def test_numpy_scalars_accepted_and_normalised(self):
    cfg = paged_kv.PoolConfig(num_blocks=np.int64(8), block_size=np.int32(4),
                              scrub_freed_blocks=np.bool_(True),
                              base_pool_fraction=np.float32(0.25))
    self.assertIs(type(cfg.num_blocks), int)
    self.assertIs(cfg.scrub_freed_blocks, True)
    self.assertEqual(cfg, dataclasses.replace(cfg))
    hash(cfg)


# Issue P item 4: (owner, field, bad value) of every policy dataclass; each must raise
# `InvalidArgument` naming the owner and the field. Before: plain ValueError/TypeError
# for some, silently accepted for the others (then failing later, or never).
def _policy(owner, **kw):
  from paged_kv.scheduler import SchedulerConfig  # pylint: disable=g-import-not-at-top
  from paged_kv.cache.governance import CacheGovernance  # pylint: disable=g-import-not-at-top
  return {"SchedulerConfig": SchedulerConfig, "CompactionPolicy": compact.CompactionPolicy,
          "CacheGovernance": CacheGovernance,
          "WatermarkQuota": functools.partial(regions.WatermarkQuota, 100)}[owner](**kw)


BAD_POLICIES = [
    ("SchedulerConfig", "preemption", "swapp"), ("SchedulerConfig", "preemption", None),
    ("SchedulerConfig", "output_reserve_ratio", 1.5),
    ("SchedulerConfig", "output_reserve_ratio", "half"),
    ("SchedulerConfig", "output_reserve_ratio", float("nan")),
    ("SchedulerConfig", "evict_policy", "fifo"), ("SchedulerConfig", "compaction", "yes"),
    ("SchedulerConfig", "enable_prefix_cache", "no"), ("SchedulerConfig", "pack_tails", 2),
    ("SchedulerConfig", "stop_token", 2**40), ("SchedulerConfig", "watermark_blocks", 2**40),
    ("SchedulerConfig", "max_batch", 0), ("SchedulerConfig", "max_batch", 2.0),
    ("SchedulerConfig", "stats_budget", 0.0), ("SchedulerConfig", "governance", "on"),
    ("CompactionPolicy", "threshold", 1.5), ("CompactionPolicy", "threshold", True),
    ("CompactionPolicy", "budget", 0), ("CompactionPolicy", "budget", 1.5),
    ("CompactionPolicy", "budget_bytes", -1), ("CompactionPolicy", "strategy", "greedy"),
    ("CompactionPolicy", "on_contiguous_failure", "yes"),
    ("CompactionPolicy", "step_fraction", 0.0), ("CompactionPolicy", "step_seconds", -1.0),
    ("CompactionPolicy", "copy_bandwidth", float("inf")),
    ("CacheGovernance", "max_step", 1.5), ("CacheGovernance", "gc_every", True),
    ("CacheGovernance", "gc_every", 0), ("CacheGovernance", "gc_ttl", -1.0),
    ("CacheGovernance", "quotas", "yes"), ("CacheGovernance", "live_fraction", 0.0),
    ("CacheGovernance", "low_watermark", 0.9),
    ("WatermarkQuota", "max_step", 0), ("WatermarkQuota", "live_fraction", 2),
    ("WatermarkQuota", "borrowed", -1),
]


class BadPolicyTest(parameterized.TestCase):

  @parameterized.parameters(*BAD_POLICIES)
  def test_refused_naming_the_field(self, owner, field, value):
    with self.assertRaises(InvalidArgument) as ctx:
      _policy(owner, **{field: value})
    self.assertIn(f"{owner}.{field}", str(ctx.exception))
    self.assertIn(repr(value) if not isinstance(value, float) else "got", str(ctx.exception))

  def test_bounds_that_need_the_pool(self):
    from paged_kv.scheduler import Scheduler, SchedulerConfig  # pylint: disable=g-import-not-at-top
    from paged_kv.scheduler.executor import DryExecutor  # pylint: disable=g-import-not-at-top
    pool = paged_kv.BlockPool(CFG)  # 8 blocks, max_seqs 4
    for kw, part in ((dict(max_batch=5), "max_batch"),
                     (dict(max_batch=4, watermark_blocks=8), "watermark")):
      with self.subTest(**kw), self.assertRaisesRegex(InvalidArgument, part):
        Scheduler(pool, DryExecutor(CFG), SchedulerConfig(compaction=None, **kw))
    with self.assertRaisesRegex(InvalidArgument, "SchedulerConfig"):
      Scheduler(pool, DryExecutor(CFG), {"max_batch": 4})

  def test_numpy_scalars_are_normalised(self):
    from paged_kv.scheduler import SchedulerConfig  # pylint: disable=g-import-not-at-top
    cfg = SchedulerConfig(max_batch=np.int64(4), output_reserve_ratio=np.float32(0.25),
                          pack_tails=np.bool_(False))
    self.assertIs(type(cfg.max_batch), int)
    self.assertIs(type(cfg.output_reserve_ratio), float)
    self.assertIs(cfg.pack_tails, False)

  def test_a_pool_beyond_the_device_memory_is_refused_before_allocating(self):
    from unittest import mock  # pylint: disable=g-import-not-at-top
    from paged_kv.core import device_memory# pylint: disable=g-import-not-at-top
    need = device_memory.pool_bytes(CFG)
    with mock.patch.object(device_memory, "free_bytes", return_value=need - 1):
      with self.assertRaisesRegex(paged_kv.PoolTooLarge, f"{need} bytes.*{need - 1} bytes"):
        paged_kv.BlockPool(CFG)
    with mock.patch.object(device_memory, "free_bytes", return_value=need):
      paged_kv.BlockPool(CFG)
    pool = paged_kv.BlockPool(CFG)
    with mock.patch.object(device_memory, "free_bytes", return_value=0):
      with self.assertRaises(paged_kv.PoolTooLarge):
        pool.resize(16)  # growing is checked too
      pool.resize(6)  # shrinking is not
    self.assertEqual(pool.config.num_blocks, 6)


class AcceptedInputTest(absltest.TestCase):
  """What the checks must keep accepting."""

  def test_write_kv_accepts_integer_scalars_for_layer(self):
    pool, a, b, slots = _filled_pool()
    for layer in (jnp.int32(0), np.int64(1), np.int32(0), jnp.asarray(1, jnp.int16)):
      pool.write_kv(layer, slots, _kv(slots.shape), _kv(slots.shape), seq_ids=[a, b])
    pool.check_invariants()

  def test_write_kv_accepts_numpy_int64_slots_and_numpy_kv(self):
    pool, a, b, slots = _filled_pool()
    k = np.asarray(_kv(slots.shape, scale=3.0))
    pool.write_kv(1, slots.astype(np.int64), k, k, seq_ids=[a, b])
    got, _ = pool.gather_kv(b)
    np.testing.assert_array_equal(np.asarray(got)[1], k[1, :3].transpose(1, 0, 2))

  def test_clamped_budgets_run(self):
    """compact(budget=2**31 / 10**8) and promote(max_moves=10**8): clamped, no OOM."""
    pool, a, b, _ = _filled_pool(BASE_CFG)
    pool.release([a])
    for budget in (2**31, 10**8):
      pool.compact(budget=budget)
    pool.fork(b)
    pool.promote(2, max_moves=10**8)
    pool.check_invariants()
    self.assertEqual(int(np.asarray(pool.state.meta.region)[pool.segments(b)[0, 0]]), 1)

  def test_apply_ref_deltas_decref_of_outside_holder_on_table_block(self):
    pool, a, b, _ = _filled_pool()
    blk = int(pool.segments(b)[0, 0])
    pool.apply_ref_deltas([blk], [1])    # a cache node takes a reference
    pool.apply_ref_deltas([blk], [-1])   # and drops it: the table's stays
    self.assertEqual(int(pool.state.meta.ref_count[blk]), 1)
    pool.check_invariants()

  def test_pack_slots_with_a_real_outside_holder(self):
    pool, a, b, _ = _filled_pool()
    seg = pool.segments(b)
    pool.apply_ref_deltas([seg[0, 0]], [1])
    pool.release([b])                    # only the outside holder is left
    res = pool.pack_slots(extra_segments=seg)
    pool.check_invariants(extra_segments=res.extra_segments)


@pytest.mark.slow
class NoOpMoveTest(chex.TestCase):
  """A move call that moves nothing leaves the state bit-identical (free list too)."""

  def test_noop_promote_keeps_free_list(self):
    pool, a, b, _ = _filled_pool(BASE_CFG)
    before = _snapshot(pool)
    # The stale part of the free list differs from a rebuilt one here.
    rebuilt, _ = alloc.rebuild_free_list(pool.state.meta.ref_count, pool.state.meta.region)
    self.assertFalse(np.array_equal(np.asarray(rebuilt), before.meta.free_list))
    remap = pool.promote(5)
    np.testing.assert_array_equal(remap, np.arange(BASE_CFG.num_blocks))
    _assert_same(self, before, pool)

  def test_noop_compact_keeps_free_list(self):
    pool, a, b, _ = _filled_pool()
    before = _snapshot(pool)
    pool.compact(budget=4)  # live blocks 0..2 are already lowest: nothing to move
    _assert_same(self, before, pool)

  @chex.variants(with_jit=True, without_jit=True)
  def test_compact_permute_empty_plan(self):
    pool, a, b, _ = _filled_pool()
    before = _snapshot(pool)
    fn = self.variant(compact.compact_permute.__wrapped__,
                      static_argnames=("config", "impl", "interpret"))
    state, (_, status) = fn(pool.state, jnp.full((4,), -1, jnp.int32),
                            jnp.full((4,), -1, jnp.int32), config=CFG)
    pool.state = state
    np.testing.assert_array_equal(status, Status.OK)
    _assert_same(self, before, pool)

  @chex.variants(with_jit=True, without_jit=True)
  def test_promote_blocks_refused_plan(self):
    pool, a, b, _ = _filled_pool(BASE_CFG)
    before = _snapshot(pool)
    fn = self.variant(regions.promote_blocks.__wrapped__,
                      static_argnames=("config", "impl", "interpret"))
    # Source 7 is free: refused, nothing moves.
    state, (_, status) = fn(pool.state, jnp.array([7], jnp.int32), jnp.array([0], jnp.int32),
                            config=BASE_CFG)
    pool.state = state
    np.testing.assert_array_equal(status, Status.INVALID_BLOCK)
    _assert_same(self, before, pool)


@pytest.mark.slow
class ApplyRefDeltasTransitionTest(chex.TestCase):
  """The pure transition reports overflow and in-use correctly (not REF_UNDERFLOW)."""

  def _run(self, pool, ids, deltas):
    fn = self.variant(functools.partial(alloc.apply_ref_deltas.__wrapped__, config=CFG))
    before = _snapshot(pool)
    state, status = fn(pool.state, jnp.asarray(ids, jnp.int32), jnp.asarray(deltas, jnp.int32))
    pool.state = state
    return before, np.asarray(status)

  @chex.variants(with_jit=True, without_jit=True)
  def test_overflow_reported_as_overflow(self):
    pool, a, b, _ = _filled_pool()
    before, status = self._run(pool, [0, 1], [2**31 - 1, 1])
    np.testing.assert_array_equal(status, [Status.REF_OVERFLOW, Status.ABORTED])
    _assert_same(self, before, pool)

  @chex.variants(with_jit=True, without_jit=True)
  def test_decref_of_table_block_is_in_use(self):
    pool, a, b, _ = _filled_pool()
    blk = int(pool.segments(b)[0, 0])
    before, status = self._run(pool, [blk], [-1])
    np.testing.assert_array_equal(status, [Status.BLOCK_IN_USE])
    _assert_same(self, before, pool)

  @chex.variants(with_jit=True, without_jit=True)
  def test_underflow_still_underflow(self):
    pool, a, b, _ = _filled_pool()
    before, status = self._run(pool, [0], [-5])
    np.testing.assert_array_equal(status, [Status.REF_UNDERFLOW])
    _assert_same(self, before, pool)


class InvariantHolderTest(absltest.TestCase):
  """Item 11: `check_invariants(extra_blocks=)` accounts for `allocate()` holders."""

  def test_allocated_blocks_pass_when_named(self):
    pool, a, b, _ = _filled_pool()
    ids = pool.allocate(2)
    with self.assertRaises(paged_kv.InvariantViolation):
      pool.check_invariants()
    pool.check_invariants(extra_blocks=ids)
    paged_kv.check_invariants(pool.state, extra_blocks=ids)
    with self.assertRaises(paged_kv.InvariantViolation):
      pool.check_invariants(extra_blocks=ids[:1])          # one holder missing
    with self.assertRaises(paged_kv.InvariantViolation):
      pool.check_invariants(extra_blocks=np.r_[ids, ids])  # one counted twice
    with self.assertRaises(InvalidArgument):
      pool.check_invariants(extra_blocks=[0.5])
    pool.apply_ref_deltas(ids, -np.ones(2, np.int64))
    pool.check_invariants()


class GhostCheckTest(absltest.TestCase):
  """Item 11: the snapshot's ghost check looks both ways and counts duplicates."""

  def _with_free_list(self, pool, free_list, num_free):
    meta = dataclasses.replace(pool.state.meta, free_list=jnp.asarray(free_list, jnp.int32),
                               num_free=jnp.asarray(num_free, jnp.int32))
    return dataclasses.replace(pool.state, meta=meta)

  def test_clean_pool_has_no_ghosts(self):
    pool, a, b, _ = _filled_pool()
    self.assertEqual(metrics.snapshot(pool.state, CFG).ghost_block_bytes, 0)

  def test_listed_block_with_references(self):
    pool, a, b, _ = _filled_pool()  # blocks 0..2 used, window = free_list[3:] = [3..7]
    fl = np.asarray(pool.state.meta.free_list).copy()
    fl[2] = 2  # a used block, now inside a window one longer
    state = self._with_free_list(pool, fl, 6)
    snap = metrics.snapshot(state, CFG, assert_no_ghosts=False)
    self.assertEqual(snap.ghost_block_bytes, CFG.block_bytes)
    with self.assertRaises(AssertionError):
      metrics.snapshot(state, CFG)
    self.assertTrue(paged_kv.check_invariants(state, raise_on_error=False))

  def test_duplicate_entries(self):
    pool, a, b, _ = _filled_pool()
    fl = np.asarray(pool.state.meta.free_list).copy()
    fl[2] = 3  # block 3 listed twice, every free block still listed
    state = self._with_free_list(pool, fl, 6)
    snap = metrics.snapshot(state, CFG, assert_no_ghosts=False)
    self.assertEqual(snap.ghost_block_bytes, CFG.block_bytes)

  def test_out_of_range_entries_and_count(self):
    pool, a, b, _ = _filled_pool()
    fl = np.asarray(pool.state.meta.free_list).copy()
    fl[3] = 99
    state = self._with_free_list(pool, fl, 5)
    snap = metrics.snapshot(state, CFG, assert_no_ghosts=False)
    self.assertEqual(snap.ghost_block_bytes, 2 * CFG.block_bytes)  # 99 listed, 3 missing
    self.assertGreater(metrics.ghost_blocks(*(np.asarray(x) for x in (
        pool.state.meta.ref_count, pool.state.meta.region, fl)), 40), 0)

  def test_missing_free_block(self):
    pool, a, b, _ = _filled_pool()
    state = self._with_free_list(pool, np.asarray(pool.state.meta.free_list), 4)
    snap = metrics.snapshot(state, CFG, assert_no_ghosts=False)
    self.assertEqual(snap.ghost_block_bytes, CFG.block_bytes)


if __name__ == "__main__":
  absltest.main()
