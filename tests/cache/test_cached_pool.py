"""`CachedPool`: the prefix cache bound to a real `BlockPool`, and the one segment format.

After every step the invariant checker runs with the cache's references counted
(`CachedPool.check_invariants`, the default), and the K/V a match hands to a new
sequence is compared with the K/V first written for those tokens. A hypothesis
state machine drives random match / open / insert / release / evict / GC /
compaction / packing sequences against a plain-Python model of what the cache holds.
`SegmentLayoutTest` checks the typed layout error at every entry point that takes
segments. Examples: 25 by default, `PAGED_KV_HYPOTHESIS_EXAMPLES` raises it.
"""

import os
import tempfile
from unittest import mock

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import paged_kv
from paged_kv.core import segment_format
from paged_kv.runtime import counters
from paged_kv.core.errors import InvalidArgument, InvalidSegmentLayout, InvariantViolation
from paged_kv.cache.cached_pool import CachedPool, CacheView
from paged_kv.telemetry import metrics
from radix.cache import InvalidSegmentsError, PrefixCache
import radix.cache

BLOCK_SIZE = 4
HEAD_DIM = 2
EXAMPLES = max(1, int(os.environ.get("PAGED_KV_HYPOTHESIS_EXAMPLES", "200")) // 8)
CONFIG = paged_kv.PoolConfig(num_blocks=24, block_size=BLOCK_SIZE, num_layers=1,
                             num_kv_heads=1, head_dim=HEAD_DIM, max_seqs=4, max_segments=16)


def kv_values(namespace, tokens):
  """float32[n]: a per-token K value that depends on namespace and whole prefix."""
  out, h = [], hash(("kv", namespace))
  for t in tokens:
    h = hash((h, int(t)))
    out.append(h % 65_521)  # exact in float32
  return np.asarray(out, np.float32)


def host_kv(state, segments) -> tuple[np.ndarray, np.ndarray]:
  """K (dim 0) and V (dim 1) of layer 0, head 0 along `segments`, read from the pages."""
  k, v = np.asarray(state.pages.k), np.asarray(state.pages.v)
  ks = [k[0, 0, b, s:s + n, 0] for b, s, n in segments]
  vs = [v[0, 0, b, s:s + n, 1] for b, s, n in segments]
  cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0,), np.float32)
  return cat(ks), cat(vs)


def write_tokens(pool, seq, namespace, tokens, start):
  """Reserves and writes the K/V of `tokens[start:]` (K = value, V = -value)."""
  rest = len(tokens) - start
  if not rest:
    return
  slots = pool.reserve_tokens([seq], [rest])
  vals = np.zeros((1, slots.shape[1], 1, HEAD_DIM), np.float32)
  vals[0, :rest, 0, 0] = kv_values(namespace, tokens)[start:]
  k = jnp.asarray(vals)
  v = jnp.asarray(np.stack([np.zeros_like(vals[..., 0]), -vals[..., 0]], -1))
  pool.write_kv(0, slots, k, v, seq_ids=seq)


def assert_seq_kv(testcase, pool, seq, namespace, tokens):
  k, v = host_kv(pool.state, pool.segments(seq))
  want = kv_values(namespace, tokens)
  np.testing.assert_array_equal(k, want)
  np.testing.assert_array_equal(v, -want)


def serve(cp, namespace, tokens, *, insert=True):
  """match -> open -> write the rest -> insert -> release; returns (match, outcome)."""
  m = cp.match(namespace, tokens[:-1])
  seq = cp.open(m.segments)
  k, _ = host_kv(cp.pool.state, cp.pool.segments(seq))
  np.testing.assert_array_equal(k, kv_values(namespace, tokens[:m.length]))
  rest = len(tokens) - m.length
  if not cp.ensure_free(-(-rest // BLOCK_SIZE) + 1):
    cp.release([seq])
    if m.node is not None:
      cp.unlock(m.node)
    return m, None
  write_tokens(cp.pool, seq, namespace, tokens, m.length)
  out = cp.insert(namespace, tokens, seq) if insert else None
  cp.release([seq])
  if m.node is not None:
    cp.unlock(m.node)
  return m, out


class CachedPoolTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.now = 0.0
    self.pool = paged_kv.BlockPool(CONFIG)
    self.cp = CachedPool(self.pool, clock=lambda: self.now)

  def probe_kv(self, namespace, tokens):
    """The cached K/V of `tokens` equals what was written for them."""
    m = self.cp.cache.match(namespace, tokens)
    self.assertEqual(m.length, len(tokens))
    k, v = host_kv(self.pool.state, m.segments)
    np.testing.assert_array_equal(k, kv_values(namespace, tokens))
    np.testing.assert_array_equal(v, -kv_values(namespace, tokens))

  def test_cache_against_real_pool(self):
    rng = np.random.default_rng(0)
    system = [9, 9, 9, 9, 9, 9]
    history = []
    for step in range(24):
      self.now = float(step)
      ns = "a" if rng.random() < 0.7 else "b"
      if history and rng.random() < 0.5:  # continue an earlier conversation
        prev_ns, prev = history[rng.integers(len(history))]
        ns, tokens = prev_ns, prev + rng.integers(0, 4, rng.integers(1, 6)).tolist()
      else:
        tokens = system + rng.integers(0, 4, rng.integers(1, 10)).tolist()
      _, out = serve(self.cp, ns, tokens)
      self.cp.check_invariants()
      if out is not None:
        history.append((ns, tokens))
      if step % 7 == 6:
        self.cp.gc_mark(ttl=3.0)
        self.cp.gc_evict(num_blocks=2)
        self.cp.check_invariants()
    self.assertGreater(self.cp.cache.stats().hit_tokens, 0)
    self.assertGreater(self.cp.cache.counters().evicted_nodes, 0)  # pressure was reached
    self.cp.evict(num_tokens=self.cp.cache.num_tokens)
    self.cp.check_invariants()
    self.assertEqual(self.pool.num_free_blocks, CONFIG.num_blocks)
    self.assertEqual(self.cp.cache.num_tokens, 0)

  def test_check_invariants_counts_the_cache_by_default(self):
    serve(self.cp, "a", [1, 2, 3, 4, 5, 6])
    self.cp.check_invariants()
    self.pool.check_invariants()  # the pool under the cache counts the cache's references
    self.pool.check_invariants(extra_segments=self.cp.segment_refs())
    with self.assertRaises(InvariantViolation):  # told that nothing outside holds any
      self.pool.check_invariants(extra_segments=np.zeros((0, 3), np.int32))

  def test_insert_a_prefix_of_the_sequence_cuts_its_segments(self):
    seq = self.cp.open()
    tokens = list(range(10))
    write_tokens(self.pool, seq, "a", tokens, 0)
    out = self.cp.insert("a", tokens[:6], seq)  # 4 + 2 of the second block's 4
    self.assertEqual(out.num_new_tokens, 6)
    self.cp.check_invariants()
    np.testing.assert_array_equal(self.cp.cache.node_segments(out.node)[:, 2], [4, 2])
    self.cp.release([seq])
    self.cp.check_invariants()
    self.probe_kv("a", tokens[:6])

  def test_insert_more_tokens_than_held_changes_nothing(self):
    seq = self.cp.open()
    write_tokens(self.pool, seq, "a", [1, 2, 3], 0)
    before = jax.tree.map(np.asarray, self.pool.state)
    with self.assertRaisesRegex(InvalidArgument, "holds 3"):
      self.cp.insert("a", [1, 2, 3, 4], seq)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, self.pool.state))
    self.assertEqual(self.cp.cache.num_tokens, 0)

  def test_evict_frees_the_blocks_it_reports(self):
    for i in range(3):
      serve(self.cp, "a", [i] * 8)
    free = self.pool.num_free_blocks
    ev = self.cp.evict(num_blocks=3)  # nodes of two blocks: one whole, one's tail block
    self.assertEqual(ev.num_freed_blocks, 3)
    self.assertEqual(self.pool.num_free_blocks - free, 3)
    self.cp.check_invariants()
    self.assertTrue(self.cp.ensure_free(CONFIG.num_blocks))
    self.assertEqual(self.cp.cache.num_tokens, 0)

  def test_a_turn_continues_the_shared_partial_block(self):
    turn1 = [1, 2, 3, 4, 5, 6]  # blocks: 4 + a partial 2
    serve(self.cp, "a", turn1)
    m, _ = serve(self.cp, "a", turn1 + [7, 8])  # matches all of turn 1, ends mid-block
    self.assertTrue(m.continuable)
    self.cp.check_invariants()
    # 8 tokens in 2 blocks: the tail was copied and continued, the old block freed.
    self.assertEqual(CONFIG.num_blocks - self.pool.num_free_blocks, 2)
    self.probe_kv("a", turn1 + [7, 8])
    self.probe_kv("a", turn1)
    # Without continuation the shared partial block keeps its 2 unused slots alive.
    pool = paged_kv.BlockPool(CONFIG)
    cp = CachedPool(pool, clock=lambda: self.now, continue_tails=False)
    serve(cp, "a", turn1)
    serve(cp, "a", turn1 + [7, 8])
    cp.check_invariants()
    self.assertEqual(CONFIG.num_blocks - pool.num_free_blocks, 3)

  def test_continuation_without_a_free_block_for_the_copy(self):
    turn1 = [1, 2, 3, 4, 5, 6]
    serve(self.cp, "a", turn1)
    held = self.pool.allocate(self.pool.num_free_blocks)  # nothing left for the copy
    m = self.cp.match("a", turn1 + [7])
    seq = self.cp.open(m.segments)  # the copy is skipped; the sequence opens as is
    np.testing.assert_array_equal(self.pool.segments(seq), m.segments)
    self.cp.release([seq])
    self.cp.unlock(m.node)
    self.pool.apply_ref_deltas(held, -np.ones_like(held))
    self.cp.check_invariants()

  def test_evict_reads_the_mirror_not_the_device(self):
    """Eviction takes the pool's counts from the host mirror (the array itself, no
    copy and no device read) and frees exactly what it reports."""
    self.pool = paged_kv.BlockPool(CONFIG, debug=False)  # the production path's counts
    self.cp = CachedPool(self.pool, clock=lambda: self.now)
    for i in range(5):
      serve(self.cp, "a", [i] * 8)  # two blocks each
    self.pool.flush()
    before = self.pool.runtime.snapshot()
    free = self.pool.num_free_blocks
    ev = self.cp.evict(num_blocks=3)
    self.assertEqual((ev.num_freed_blocks, self.pool.num_free_blocks - free), (3, 3))
    traffic = self.pool.runtime.snapshot().since(before)
    self.assertEqual((traffic.num_dispatches, traffic.num_host_reads), (0, 0))
    self.assertIs(self.cp._ref_count(), self.pool.host.ref_count)  # the mirror's array
    region = np.asarray(self.pool.state.meta.region)  # the host mask agrees with the pool
    np.testing.assert_array_equal(self.cp._dynamic(), region == 0)
    self.cp.check_invariants()

  @parameterized.parameters("top_down", "merge", None)
  def test_compaction_remaps_the_cache(self, strategy):
    for i in range(4):
      serve(self.cp, "a", [i] * 8)  # blocks 0..7, two per entry
    self.cp.evict(num_tokens=8)  # the LRU entry goes: a hole at the bottom
    self.cp.evict(num_tokens=8)
    ratio = metrics.snapshot(self.pool.state, CONFIG).fragmentation_ratio
    self.assertGreater(ratio, 0)
    if strategy is None:
      remap = self.cp.compact(budget=4)
    else:
      remap = self.cp.compact(policy=paged_kv.CompactionPolicy(budget=4, strategy=strategy))
    self.assertTrue((remap != np.arange(CONFIG.num_blocks)).any())
    self.cp.check_invariants()
    self.assertEqual(metrics.snapshot(self.pool.state, CONFIG).fragmentation_ratio, 0.0)
    for i in (2, 3):
      self.probe_kv("a", [i] * 8)

  def test_promote_remaps_the_cache(self):
    pool = paged_kv.BlockPool(paged_kv.PoolConfig(
        num_blocks=24, block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
        max_seqs=4, max_segments=16, base_pool_fraction=0.25))
    cp = CachedPool(pool)
    serve(cp, "a", [5] * 8)
    cp.check_invariants()
    remap = cp.promote(1)
    self.assertTrue((remap != np.arange(24)).any())
    cp.check_invariants()
    self.assertTrue((cp.segment_refs()[:, 0] < pool.config.num_base_blocks).all())
    m = cp.cache.match("a", [5] * 8)
    np.testing.assert_array_equal(host_kv(pool.state, m.segments)[0], kv_values("a", [5] * 8))

  def test_pack_moves_the_cache_references_once(self):
    cp = CachedPool(self.pool, pack_tails=True)
    outcomes = [serve(cp, "a", [i] * 6)[1] for i in range(3)]  # tails of 2 tokens
    self.assertTrue(all(o.pack for o in outcomes))
    used = CONFIG.num_blocks - self.pool.num_free_blocks
    moved = cp.pack([c for o in outcomes for c in o.pack])
    self.assertGreater(moved, 0)
    cp.check_invariants()
    self.assertLess(CONFIG.num_blocks - self.pool.num_free_blocks, used)  # tails share blocks
    for i in range(3):
      m = cp.cache.match("a", [i] * 6)
      np.testing.assert_array_equal(host_kv(self.pool.state, m.segments)[0],
                                    kv_values("a", [i] * 6))
    self.assertGreaterEqual(cp.reclaim_slots(), 0)
    cp.check_invariants()
    # Stale candidates (their nodes evicted since) are skipped; nothing changes.
    cp.evict(num_tokens=cp.cache.num_tokens)
    before = jax.tree.map(np.asarray, self.pool.state)
    self.assertEqual(cp.pack([c for o in outcomes for c in o.pack]), 0)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, self.pool.state))
    cp.check_invariants()

  def test_split_applies_its_incref(self):
    _, out = serve(self.cp, "a", [1, 2, 3, 4, 5, 6])
    head = self.cp.split(out.node, 3)  # inside the first block: one more segment on it
    self.assertIsNotNone(head)
    self.cp.check_invariants()

  def test_save_and_restore(self):
    for i in range(3):
      serve(self.cp, "a", [i] * 7)
    serve(self.cp, "b", [1, 2, 3])
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "cache.npz")
      self.cp.save(path)
      other = CachedPool(paged_kv.BlockPool(CONFIG))
      other.restore(path)
      with self.assertRaises(InvalidArgument):  # restore needs an empty cache
        other.restore(path)
    other.check_invariants()
    self.assertEqual(other.cache.num_tokens, self.cp.cache.num_tokens)
    for ns, tokens in [("a", [0] * 7), ("a", [2] * 7), ("b", [1, 2, 3])]:
      m = other.cache.match(ns, tokens)
      self.assertEqual(m.length, len(tokens))
      np.testing.assert_array_equal(host_kv(other.pool.state, m.segments)[0],
                                    kv_values(ns, tokens))

  def test_adopting_a_cache_checks_its_references(self):
    cache = PrefixCache(block_size=BLOCK_SIZE)
    seq = self.pool.open_sequence()
    write_tokens(self.pool, seq, "a", [1, 2, 3], 0)
    cache.insert("a", [1, 2, 3], self.pool.segments(seq))  # deltas not applied
    self.pool.release([seq])
    with self.assertRaises(InvariantViolation):
      CachedPool(self.pool, cache)
    with self.assertRaises(InvalidArgument):
      CachedPool(self.pool, PrefixCache(block_size=2 * BLOCK_SIZE))

  def test_the_view_only_reads(self):
    view = self.cp.cache
    self.assertIsInstance(view, CacheView)
    for name in ("insert", "evict", "gc_evict", "split", "apply_remap", "rebind_segment",
                 "rebind_segments", "unlock"):
      self.assertFalse(hasattr(view, name), name)
    with self.assertRaises(InvalidArgument):
      view.match("a", [1], lock=True)


class SegmentLayoutTest(parameterized.TestCase):
  """One `int32[n, 3]` format; a wrong layout raises a typed error naming both shapes."""

  def setUp(self):
    super().setUp()
    self.pool = paged_kv.BlockPool(CONFIG)
    self.cp = CachedPool(self.pool)
    self.seq = self.cp.open()
    write_tokens(self.pool, self.seq, "a", list(range(10)), 0)  # 3 segments
    self.segs = self.pool.segments(self.seq)

  def test_segments_round_trip_between_pool_and_cache(self):
    self.assertEqual(self.segs.dtype, np.int32)
    self.assertEqual(self.segs.shape, (3, 3))
    cache = PrefixCache(block_size=BLOCK_SIZE)
    out = cache.insert("a", list(range(10)), self.segs)  # the pool's segments, as they are
    self.pool.apply_ref_deltas(out.ref_deltas.block_ids, out.ref_deltas.deltas)
    m = cache.match("a", list(range(10)))
    seq = self.pool.open_sequence(m.segments)  # a match's segments, as they are
    np.testing.assert_array_equal(self.pool.segments(seq), self.segs)
    self.pool.check_invariants(extra_segments=cache.segment_refs())

  def test_segments_reads_one_row_at_a_fixed_shape(self):
    """Reading segments touches no device: no program, no dispatch, no host read."""
    other = self.cp.open()
    self.assertEqual(self.pool.segments(other).shape, (0, 3))
    done = 0
    for n in (1, 5, 9, 13):  # 1..4 segments
      write_tokens(self.pool, other, "b", list(range(n)), done)
      done = n
      before, compiles = self.pool.runtime.snapshot(), counters.backend_compiles()
      self.assertLen(self.pool.segments(other), -(-n // BLOCK_SIZE))
      self.assertLen(self.pool.segments(self.seq), 3)
      traffic = self.pool.runtime.snapshot().since(before)
      self.assertEqual((traffic.num_dispatches, traffic.num_host_reads), (0, 0))
      self.assertEqual(counters.backend_compiles(), compiles)

  def _entry_points(self):
    """(name, call taking the bad segments, the error type) for every entry point."""
    cache = PrefixCache(block_size=BLOCK_SIZE)
    state = self.pool.state
    return [
        ("BlockPool.open_sequence", lambda s: self.pool.open_sequence(s), InvalidSegmentLayout),
        ("CachedPool.open", lambda s: self.cp.open(s), InvalidSegmentLayout),
        ("BlockPool.check_invariants",
         lambda s: self.pool.check_invariants(extra_segments=s), InvalidSegmentLayout),
        ("CachedPool.check_invariants",
         lambda s: self.cp.check_invariants(extra_segments=s), InvalidSegmentLayout),
        ("check_invariants", lambda s: paged_kv.check_invariants(state, s), InvalidSegmentLayout),
        ("BlockPool.pack_slots",
         lambda s: self.pool.pack_slots(extra_segments=s), InvalidSegmentLayout),
        ("BlockPool.reclaim_slots", lambda s: self.pool.reclaim_slots(s), InvalidSegmentLayout),
        ("metrics.snapshot",
         lambda s: metrics.snapshot(state, CONFIG, extra_segments=s), InvalidSegmentLayout),
        ("metrics.live_slot_mask", lambda s: metrics.live_slot_mask(state, s),
         InvalidSegmentLayout),
        ("PrefixCache.insert", lambda s: cache.insert("a", list(range(10)), s),
         InvalidSegmentsError),
        ("PrefixCache.rebind_segments", lambda s: cache.rebind_segments(
            cache.insert("z", [1], [[0, 0, 1]]).node, s), InvalidSegmentsError),
    ]

  @parameterized.named_parameters(
      ("columns_3", "columns", 3, r"a tuple of three 1-D arrays \(\(3,\), \(3,\), \(3,\)\)"),
      ("columns_2", "columns", 2, r"a tuple of three 1-D arrays"),
      ("transposed_2", "transposed", 2, r"got shape \(3, 2\) int32"),
      ("floats", "floats", 3, r"got shape \(3, 3\) float32"),
      ("four_fields", "four_fields", 3, r"got shape \(3, 4\) int32"),
      ("flat", "flat", 3, r"got shape \(9,\) int32"),
      ("overflow", "overflow", 3, r"values outside int32"),
  )
  def test_wrong_layout_is_refused_everywhere(self, kind, n, message):
    segs = self.segs[:n]
    bad = {
        "columns": lambda: (segs[:, 0], segs[:, 1], segs[:, 2]),
        "transposed": lambda: segs.T,
        "floats": lambda: segs.astype(np.float32),
        "four_fields": lambda: np.concatenate([segs, segs[:, :1]], axis=1),
        "flat": lambda: segs.reshape(-1),
        "overflow": lambda: segs.astype(np.int64) + np.array([[2**32, 0, 0]] + [[0, 0, 0]] * (n - 1)),
    }[kind]()
    for name, call, error in self._entry_points():
      before = jax.tree.map(np.asarray, self.pool.state)
      with self.subTest(name):
        with self.assertRaisesRegex(error, message) as raised:
          call(bad)
        self.assertIn("int32[n, 3] array of (block, start, length) rows",
                      str(raised.exception))
        jax.tree.map(np.testing.assert_array_equal, before,
                     jax.tree.map(np.asarray, self.pool.state))

  def test_the_two_layout_checks_agree(self):
    """paged_kv's and radix's validators (radix cannot import paged_kv) accept the same."""
    segs = self.segs
    cases = [segs, segs.tolist(), [], (), np.zeros((0, 3), np.int64), jnp.asarray(segs),
             [tuple(r) for r in segs.tolist()], (segs[:, 0], segs[:, 1], segs[:, 2]),
             segs[:2].T, segs.astype(np.float64), segs.astype(bool),
             segs.reshape(-1), segs[None], np.zeros((3, 0), np.int32), "abc", [[1, 2], [3]],
             segs.astype(np.int64) + 2**31]
    for i, case in enumerate(cases):
      with self.subTest(i):
        try:
          ours = segment_format.as_segments(case)
        except InvalidSegmentLayout as e:
          ours = e
        try:
          theirs = radix.cache.as_segments(case, block_size=2**30)
        except InvalidSegmentsError as e:
          theirs = e
        if isinstance(ours, Exception) or isinstance(theirs, Exception):
          self.assertEqual(str(ours), str(theirs))
        else:
          np.testing.assert_array_equal(ours, theirs)
          self.assertEqual((ours.dtype, theirs.dtype), (np.int32, np.int32))


class CachedPoolMachine(RuleBasedStateMachine):
  """Random cache traffic on a `CachedPool` against a plain-Python model.

  The model holds, per namespace, the set of token prefixes the cache must hold
  (every prefix of every inserted sequence, minus what evictions removed), the
  live sequences with their tokens, and the prefixes locked by live sequences.
  After every step: the invariant checker (cache references counted), every live
  sequence's K/V bit for bit, and the cache's token count against the model.
  """

  def __init__(self):
    super().__init__()
    self.now = 0.0
    self.stored: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set()}
    self.live: dict[int, tuple[str, list[int], object, int]] = {}  # seq -> ns, tokens, node, m

  @initialize(pack_tails=st.booleans())
  def setup(self, pack_tails):
    self.cp = CachedPool(paged_kv.BlockPool(CONFIG), pack_tails=pack_tails,
                         clock=lambda: self.now)

  # -- model ---------------------------------------------------------------------
  def _model_match(self, ns, tokens) -> int:
    k = 0
    while k < len(tokens) and tuple(tokens[:k + 1]) in self.stored[ns]:
      k += 1
    return k

  def _resync_after_eviction(self, ev):
    """Removes what the eviction took; checks it was leaves, unlocked, and counted."""
    removed = 0
    for ns, prefixes in self.stored.items():
      gone = {p for p in prefixes if self.cp.cache.match(ns, list(p)).length < len(p)}
      for p in gone:  # prefix-closed: an evicted prefix takes its extensions along
        assert all(q in gone for q in prefixes if len(q) > len(p) and q[:len(p)] == p)
      prefixes -= gone
      removed += len(gone)
    assert removed == ev.num_tokens, (removed, ev.num_tokens)
    for ns, tokens, _, matched in self.live.values():  # locked prefixes stay
      assert self._model_match(ns, tokens) >= matched

  # -- rules ---------------------------------------------------------------------
  @precondition(lambda self: len(self.live) < CONFIG.max_seqs)
  @rule(ns=st.sampled_from(["a", "b"]), head=st.sampled_from([(), (7, 7, 7, 7, 7)]),
        body=st.lists(st.integers(0, 2), min_size=1, max_size=7))
  def start(self, ns, head, body):
    tokens = list(head) + body
    m = self.cp.match(ns, tokens[:-1])
    assert m.length == self._model_match(ns, tokens[:-1]), (m.length, tokens)
    segs = m.segments
    rest = lambda: len(tokens) - int(segs[:, 2].sum())
    while len(segs) and len(segs) + -(-rest() // BLOCK_SIZE) + 1 > CONFIG.max_segments:
      segs = segs[:-1]
    matched = int(segs[:, 2].sum())
    if not self.cp.ensure_free(-(-rest() // BLOCK_SIZE) + 1):
      if m.node is not None:
        self.cp.unlock(m.node)
      return
    seq = self.cp.open(segs)
    write_tokens(self.cp.pool, seq, ns, tokens, matched)
    self.live[seq] = (ns, tokens, m.node, m.length)

  @precondition(lambda self: self.live)
  @rule(data=st.data(), insert=st.booleans())
  def finish(self, data, insert):
    seq = data.draw(st.sampled_from(sorted(self.live)))
    ns, tokens, node, _ = self.live.pop(seq)
    pack = ()
    if insert:
      count = data.draw(st.integers(0, len(tokens)))
      out = self.cp.insert(ns, tokens[:count], seq)
      assert out.prefix_len == self._model_match(ns, tokens[:count])
      self.stored[ns].update(tuple(tokens[:i]) for i in range(1, count + 1))
      pack = out.pack
    self.cp.release([seq])
    if node is not None:
      self.cp.unlock(node)
    if pack:
      try:
        self.cp.pack(pack)
      except paged_kv.PoolExhausted:
        pass

  @rule(num_tokens=st.integers(1, 12))
  def evict_tokens(self, num_tokens):
    self._resync_after_eviction(self.cp.evict(num_tokens=num_tokens))

  @rule(num_blocks=st.integers(1, 4))
  def evict_blocks(self, num_blocks):
    free = self.cp.pool.num_free_blocks
    ev = self.cp.evict(num_blocks=num_blocks)
    assert self.cp.pool.num_free_blocks - free == ev.num_freed_blocks
    self._resync_after_eviction(ev)

  @rule(ttl=st.sampled_from([0.0, 2.0]), num_blocks=st.integers(1, 3))
  def gc(self, ttl, num_blocks):
    self.cp.gc_mark(ttl)
    self._resync_after_eviction(self.cp.gc_evict(num_blocks=num_blocks))

  @rule(strategy=st.sampled_from(["merge", "top_down"]))
  def compact(self, strategy):
    self.cp.compact(policy=paged_kv.CompactionPolicy(budget=4, strategy=strategy))

  @rule()
  def tick(self):
    self.now += 1.0

  @precondition(lambda self: any(self.stored.values()))
  @rule(data=st.data())
  def probe(self, data):
    """A stored prefix reads back the K/V written for it (after moves, packing, GC)."""
    ns = data.draw(st.sampled_from(sorted(n for n, p in self.stored.items() if p)))
    prefix = data.draw(st.sampled_from(sorted(self.stored[ns])))
    m = self.cp.cache.match(ns, list(prefix))
    assert m.length == len(prefix)
    k, v = host_kv(self.cp.pool.state, m.segments)
    np.testing.assert_array_equal(k, kv_values(ns, prefix))
    np.testing.assert_array_equal(v, -kv_values(ns, prefix))

  # -- invariants ------------------------------------------------------------------
  @invariant()
  def consistent(self):
    if not hasattr(self, "cp"):
      return
    self.cp.check_invariants()
    assert self.cp.cache.num_tokens == sum(len(p) for p in self.stored.values())
    assert sorted(self.cp.pool.active_sequences().tolist()) == sorted(self.live)
    for seq, (ns, tokens, _, _) in self.live.items():
      k, v = host_kv(self.cp.pool.state, self.cp.pool.segments(seq))
      np.testing.assert_array_equal(k, kv_values(ns, tokens))
      np.testing.assert_array_equal(v, -kv_values(ns, tokens))


CachedPoolMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestCachedPoolStateful = CachedPoolMachine.TestCase



class IssueJCachedPoolTest(absltest.TestCase):
  """Issue J: split-on-lock matches, recovery after a half-applied call, lost state."""

  def _pool(self):
    cfg = paged_kv.PoolConfig(num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=16)
    return paged_kv.BlockPool(cfg)

  def test_match_splits_and_applies_the_cut(self):
    pool = self._pool()
    cp = CachedPool(pool)
    s = cp.open()
    pool.reserve_tokens([s], [10])
    cp.insert("t", np.arange(10), s)
    cp.release([s])
    m = cp.match("t", np.array([0, 1, 99]))       # 2 of the node's 10 tokens
    self.assertEqual(m.length, 2)
    cp.check_invariants()                          # the cut's incref was applied
    self.assertEqual(cp.cache.tree.node(m.node).num_tokens, 2)
    cp.unlock(m.node)

  def test_recover_drops_a_cache_the_pool_disagrees_with(self):
    from paged_kv.cache import cached_pool as cp_mod
    pool = self._pool()
    cp = CachedPool(pool)
    s = cp.open()
    pool.reserve_tokens([s], [6])
    keep = cp.open()
    pool.reserve_tokens([keep], [3])
    with mock.patch.object(pool, "apply_ref_deltas", side_effect=KeyboardInterrupt):
      with self.assertRaises(KeyboardInterrupt):
        cp.insert("t", np.arange(6), s)            # the tree changed, the pool did not
    with self.assertRaises(paged_kv.InvariantViolation):
      cp.check_invariants()
    self.assertTrue(cp.recover())
    cp.check_invariants()
    self.assertEqual(cp.cache.num_tokens, 0)
    self.assertFalse(cp.recover())                 # consistent now: nothing to do
    cp.release([s, keep])
    self.assertEqual(pool.num_free_blocks, pool.config.num_blocks)
    self.assertFalse(cp_mod.state_lost(pool))
    jax.tree.map(lambda x: x.delete(), pool.state)
    self.assertTrue(cp_mod.state_lost(pool))
    with self.assertRaisesRegex(cp_mod.PoolStateLost, "deleted"):
      cp.recover()


if __name__ == "__main__":
  absltest.main()
