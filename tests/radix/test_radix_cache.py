"""Tests of radix.cache: nodes bound to pool segments, ref deltas, eviction, GC, remap.

The pool here is ``SimPool``, a plain-numpy stand-in that stores one int64 "KV value"
per token slot, so a test can check that the segments a match returns hold exactly the
KV originally written for those tokens. Freed blocks are poisoned.

Hypothesis budget: ``PAGED_KV_HYPOTHESIS_EXAMPLES`` (default 100) examples.
"""

import os
from unittest import mock

import numpy as np
from absl.testing import absltest, parameterized
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule)

from radix import cache as radix_cache
from radix import eviction, segments
from radix.cache import (InvalidSegmentsError, PrefixCache, RefCountMismatchError, RefDeltas)
from radix.tree import InvalidTokensError, StaleNodeError

POISON = -7
_EXAMPLES = int(os.environ.get("PAGED_KV_HYPOTHESIS_EXAMPLES", "100"))


def kv_of(namespace, tokens):
  """int64[n]: the KV 'written' for each token: a function of namespace and prefix."""
  out, h = [], hash(("kv", namespace))
  for t in tokens:
    h = hash((h, int(t)))
    out.append(h & 0x7FFF_FFFF_FFFF)
  return np.asarray(out, np.int64)


class Clock:

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class SimPool:
  """Host-numpy block pool: ref counts, segment tables and one KV value per slot."""

  def __init__(self, num_blocks, block_size):
    self.block_size = block_size
    self.ref_count = np.zeros(num_blocks, np.int64)
    self.kv = np.full((num_blocks, block_size), POISON, np.int64)
    self.tables = {}  # seq_id -> int32[n, 3]
    self.tree_ledger = np.zeros(num_blocks, np.int64)  # sum of cache deltas
    self.generation = np.zeros(num_blocks, np.int64)  # bumped on each allocation
    self._next = 0

  @property
  def num_free(self):
    return int(np.count_nonzero(self.ref_count == 0))

  def apply_tree_deltas(self, deltas: RefDeltas):
    np.add.at(self.ref_count, deltas.block_ids, deltas.deltas)
    np.add.at(self.tree_ledger, deltas.block_ids, deltas.deltas)
    assert (self.ref_count >= 0).all()
    self.kv[self.ref_count == 0] = POISON

  def open_sequence(self, segments):
    seq = self._next
    self._next += 1
    segs = np.asarray(segments, np.int32).reshape(-1, 3)
    np.add.at(self.ref_count, segs[:, 0], 1)
    self.tables[seq] = segs.copy()
    return seq

  def append(self, seq, values):
    """Writes KV values for new tokens into fresh blocks; False if out of blocks."""
    n = len(values)
    need = -(-n // self.block_size)
    free = np.flatnonzero(self.ref_count == 0)[:need]
    if free.shape[0] < need:
      return False
    rows = []
    for i, b in enumerate(free):
      chunk = values[i * self.block_size : (i + 1) * self.block_size]
      self.kv[b, : len(chunk)] = chunk
      rows.append([b, 0, len(chunk)])
    self.ref_count[free] += 1
    self.generation[free] += 1
    self.tables[seq] = np.concatenate([self.tables[seq], np.asarray(rows, np.int32).reshape(-1, 3)])
    return True

  def release(self, seq):
    segs = self.tables.pop(seq)
    np.add.at(self.ref_count, segs[:, 0], -1)
    assert (self.ref_count >= 0).all()
    self.kv[self.ref_count == 0] = POISON

  def read(self, segments):
    segs = np.asarray(segments).reshape(-1, 3)
    parts = [self.kv[b, s : s + l] for b, s, l in segs]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int64)

  def table_refs(self):
    refs = np.zeros_like(self.ref_count)
    for segs in self.tables.values():
      np.add.at(refs, segs[:, 0], 1)
    return refs

  def compact(self, rng, max_moves=4):
    """Moves up to max_moves live blocks from high to low free addresses.

    Returns remap int32[num_blocks] (a permutation: remap[old] = new).
    """
    live = np.flatnonzero(self.ref_count > 0)[::-1]
    free = np.flatnonzero(self.ref_count == 0)
    moves = []
    for src, dst in zip(live, free):
      if dst >= src or len(moves) >= max_moves:
        break
      if rng.random() < 0.8:
        moves.append((src, dst))
    remap = np.arange(self.ref_count.shape[0], dtype=np.int32)
    for src, dst in moves:
      remap[src], remap[dst] = dst, src
    inv = np.argsort(remap)
    self.kv = self.kv[inv]
    self.ref_count = self.ref_count[inv]
    self.tree_ledger = self.tree_ledger[inv]
    self.generation = self.generation[inv]
    for seq, segs in self.tables.items():
      segs = segs.copy()
      segs[:, 0] = remap[segs[:, 0]]
      self.tables[seq] = segs
    return remap

  def pack(self, segment, target):
    """Copies a short segment into a slotted block; returns the new segment."""
    b, s, l = segment
    tb, ts = target
    self.kv[tb, ts : ts + l] = self.kv[b, s : s + l]
    return (tb, ts, l)

  def check(self, cache):
    tree = cache.tree_ref_counts(self.ref_count.shape[0])
    np.testing.assert_array_equal(self.ref_count, self.table_refs() + tree)
    np.testing.assert_array_equal(self.tree_ledger, tree)
    assert cache.num_segments == cache.segment_refs().shape[0]


def _fill(pool, cache, ns, tokens):
  """Runs one request through pool + cache: match, compute the rest, insert, release."""
  m = cache.match(ns, tokens)
  seq = pool.open_sequence(m.segments)
  kv = kv_of(ns, tokens)
  assert pool.append(seq, kv[m.length :])
  out = cache.insert(ns, tokens, pool.tables[seq])
  pool.apply_tree_deltas(out.ref_deltas)
  if m.node is not None:
    cache.unlock(m.node)
  pool.release(seq)
  return m, out


class PrefixCacheTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.clock = Clock()
    self.pool = SimPool(num_blocks=64, block_size=4)
    self.cache = PrefixCache(block_size=4, clock=self.clock)

  def test_match_returns_inserted_kv_for_every_prefix_length(self):
    tokens = list(range(10, 21))  # 11 tokens: segments 4 + 4 + 3
    _fill(self.pool, self.cache, "ns", tokens)
    for n in range(len(tokens) + 1):
      m = self.cache.match("ns", tokens[:n] + [999], lock=False)
      self.assertEqual(m.length, n)
      self.assertEqual(int(m.segments[:, 2].sum()), n)
      np.testing.assert_array_equal(self.pool.read(m.segments), kv_of("ns", tokens)[:n])
      self.assertLen(m.ref_deltas, 0)
    self.pool.check(self.cache)

  def test_split_at_every_token_cuts_segments_and_increfs(self):
    base = list(range(100, 111))  # 11 tokens
    for t in range(1, len(base) + 1):
      with self.subTest(t=t):
        pool, cache = SimPool(64, 4), PrefixCache(block_size=4, clock=Clock())
        _fill(pool, cache, "ns", base)
        refs_before = cache.num_segments
        other = base[:t] + [1, 2, 3]
        m, out = _fill(pool, cache, "ns", other)
        self.assertEqual((m.length, out.prefix_len, out.num_new_tokens), (t, t, 3))
        cut = t % 4 != 0 and t < len(base)
        # New leaf: one segment (3 tokens) + one more ref if a segment was cut.
        self.assertEqual(out.ref_deltas.total, 1 + int(cut))
        self.assertEqual(cache.num_segments, refs_before + 1 + int(cut))
        for seq in (base, other):
          mm = cache.match("ns", seq, lock=False)
          self.assertEqual(mm.length, len(seq))
          np.testing.assert_array_equal(pool.read(mm.segments), kv_of("ns", seq))
        pool.check(cache)

  def test_explicit_split_at_every_token(self):
    tokens = list(range(11))  # segments 4 + 4 + 3
    for t in range(1, len(tokens)):
      with self.subTest(t=t):
        pool, cache = SimPool(16, 4), PrefixCache(block_size=4, clock=Clock())
        leaf = _fill(pool, cache, "ns", tokens)[1].node
        head, deltas = cache.split(leaf, t)
        pool.apply_tree_deltas(deltas)
        self.assertEqual(deltas.total, int(t % 4 != 0))
        pool.check(cache)
        self.assertEqual(int(cache.node_segments(head)[:, 2].sum()), t)
        m = cache.match("ns", tokens, lock=False)
        np.testing.assert_array_equal(pool.read(m.segments), kv_of("ns", tokens))
        with self.assertRaises(ValueError):
          cache.split(leaf, 0)

  def test_insert_refs_only_new_part_and_straddling_segment(self):
    _fill(self.pool, self.cache, "ns", [1, 2, 3, 4, 5, 6])
    # A sequence computed from scratch whose segments duplicate the cached prefix.
    seq = self.pool.open_sequence(np.zeros((0, 3)))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    self.pool.append(seq, kv_of("ns", tokens))
    segs = self.pool.tables[seq]  # 4 + 4 + 1, block of tokens 5..8 straddles 6
    out = self.cache.insert("ns", tokens, segs)
    self.assertEqual((out.prefix_len, out.num_new_tokens), (6, 3))
    # Tree takes (b1, 2, 2) and (b2, 0, 1): one ref each; none on b0. The sequence's
    # block b1 straddles the held prefix, so the node's partial tail (old block,
    # tokens 5..6) moves onto it: (b1, 0, 2), +1 on b1, -1 on the old block.
    old_tail = 1  # _fill's blocks: 0 (tokens 1..4), 1 (tokens 5..6)
    self.assertEqual(
        dict(zip(out.ref_deltas.block_ids.tolist(), out.ref_deltas.deltas.tolist())),
        {int(segs[1, 0]): 2, int(segs[2, 0]): 1, old_tail: -1})
    self.pool.apply_tree_deltas(out.ref_deltas)
    self.assertEqual(self.pool.ref_count[old_tail], 0)  # the partial block is free
    self.pool.release(seq)
    self.pool.check(self.cache)
    m = self.cache.match("ns", tokens, lock=False)
    np.testing.assert_array_equal(self.pool.read(m.segments), kv_of("ns", tokens))

  @parameterized.named_parameters(
      ("short", [[0, 0, 2]]),
      ("long", [[0, 0, 4], [1, 0, 4]]),
      ("beyond_block", [[0, 2, 4]]),
      ("zero_length", [[0, 0, 3], [1, 0, 0]]),
      ("negative_block", [[-1, 0, 3]]),
      ("bad_shape", [[0, 0]]),
      ("floats", [[0.0, 0.0, 3.0]]),
      ("columns", (np.array([0]), np.array([0]), np.array([3]))),
      ("columns_of_three", (np.array([0, 1, 2]), np.array([0, 0, 0]), np.array([1, 1, 1]))),
      ("transposed", np.array([[0, 0, 2], [1, 0, 1]]).T),
  )
  def test_insert_rejects_bad_segments_atomically(self, segments):
    _fill(self.pool, self.cache, "ns", [5, 6])
    before = (len(self.cache.tree), self.cache.num_tokens, self.cache.num_segments)
    with self.assertRaises(InvalidSegmentsError):
      self.cache.insert("ns", [5, 6, 7], segments)
    self.assertEqual(before, (len(self.cache.tree), self.cache.num_tokens, self.cache.num_segments))
    with self.assertRaises(InvalidTokensError):
      self.cache.insert("ns", [[5, 6, 7]], [[0, 0, 3]])
    self.pool.check(self.cache)

  @parameterized.named_parameters(
      ("columns", (np.array([0, 1]), np.array([0, 0]), np.array([2, 1])),
       "a tuple of three 1-D arrays"),
      ("transposed", np.array([[0, 0, 2], [1, 0, 1]]).T, r"got shape \(3, 2\)"),
  )
  def test_wrong_layout_message_names_the_expected_rows(self, segments, message):
    with self.assertRaisesRegex(InvalidSegmentsError, message) as raised:
      self.cache.insert("ns", [5, 6, 7], segments)
    self.assertIn("must be an int32[n, 3] array of (block, start, length) rows",
                  str(raised.exception))

  def test_namespaces_never_hit_each_other(self):
    tokens = [3, 1, 4, 1, 5, 9, 2]
    _fill(self.pool, self.cache, "tenant_a", tokens)
    m_b, out_b = _fill(self.pool, self.cache, "tenant_b", tokens)
    self.assertEqual((m_b.length, out_b.prefix_len), (0, 0))
    m_a = self.cache.match("tenant_a", tokens, lock=False)
    m_b = self.cache.match("tenant_b", tokens, lock=False)
    self.assertEqual((m_a.length, m_b.length), (7, 7))
    # Different KV (namespaces model different adapters), different blocks.
    np.testing.assert_array_equal(self.pool.read(m_a.segments), kv_of("tenant_a", tokens))
    np.testing.assert_array_equal(self.pool.read(m_b.segments), kv_of("tenant_b", tokens))
    self.assertFalse(set(m_a.segments[:, 0]) & set(m_b.segments[:, 0]))
    a, b = self.cache.stats("tenant_a"), self.cache.stats("tenant_b")
    self.assertEqual((a.num_queries, a.hit_tokens, a.query_tokens), (2, 7, 14))
    self.assertEqual((b.num_queries, b.hit_tokens, b.query_tokens), (2, 7, 14))
    self.assertEqual(self.cache.stats().hit_tokens, 14)
    self.assertEqual(self.cache.stats("tenant_c").num_queries, 0)
    self.pool.check(self.cache)

  def _three_leaves(self):
    ids = {}
    for i, name in enumerate("abc"):
      self.clock.now = float(i)
      _, out = _fill(self.pool, self.cache, "ns", [100 + i] * 8)
      ids[name] = out.node
    return ids

  def _evict(self, **kw):
    ev = self.cache.evict(ref_count=self.pool.ref_count, **kw)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    self.pool.check(self.cache)
    return ev

  def test_lru_evicts_least_recently_used_first(self):
    ids = self._three_leaves()
    self.clock.now = 10.0
    self.cache.match("ns", [100] * 8, lock=False)  # touch a
    ev = self._evict(num_blocks=2)
    self.assertEqual(ev.nodes, (ids["b"],))
    self.assertEqual((ev.num_freed_blocks, ev.num_tokens, ev.num_segments), (2, 8, 2))
    ev = self._evict(num_blocks=3)
    # c whole, then a's tail block only: a's head (block granularity) stays cached.
    self.assertEqual(ev.nodes, (ids["c"], ids["a"]))
    self.assertEqual((ev.num_freed_blocks, ev.num_tokens), (3, 12))
    self.assertEqual(self.pool.num_free, 63)
    self.assertEqual(self.cache.match("ns", [100] * 8, lock=False).length, 4)
    self.assertEqual(self._evict(num_blocks=1).num_tokens, 4)
    self.assertEqual(self.pool.num_free, 64)
    self.assertEqual(self._evict(num_blocks=1).nodes, ())

  def test_block_granularity_trims_the_lru_leaf_from_its_tail(self):
    self.clock.now = 0.0
    _fill(self.pool, self.cache, "ns", list(range(1, 17)))  # one leaf, 4 blocks
    self.clock.now = 1.0
    _fill(self.pool, self.cache, "ns", [50, 51, 52, 53])  # more recent
    ev = self._evict(num_blocks=1)
    self.assertEqual((ev.num_freed_blocks, ev.num_tokens, ev.num_segments), (1, 4, 1))
    self.assertEqual(self.cache.match("ns", list(range(1, 17)), lock=False).length, 12)
    self.assertEqual(self.cache.match("ns", [50, 51, 52, 53], lock=False).length, 4)
    ev = self._evict(num_tokens=5)  # whole segments, tail first: 8 tokens go
    self.assertEqual(ev.num_tokens, 8)
    self.assertEqual(self.cache.match("ns", list(range(1, 17)), lock=False).length, 4)
    # "node": the whole LRU leaf goes for one block.
    pool, cache = SimPool(64, 4), PrefixCache(block_size=4, clock=self.clock,
                                              granularity="node")
    _fill(pool, cache, "ns", list(range(1, 17)))
    ev = cache.evict(num_blocks=1, ref_count=pool.ref_count)
    pool.apply_tree_deltas(ev.ref_deltas)
    self.assertEqual((ev.num_freed_blocks, ev.num_tokens), (4, 16))
    pool.check(cache)
    with self.assertRaises(ValueError):
      PrefixCache(block_size=4, granularity="token")

  def test_eviction_asks_a_ref_count_lookup_for_few_blocks(self):
    ids = self._three_leaves()  # a, b, c: two blocks each, LRU order a, b, c
    rng = np.random.default_rng(0)
    for _ in range(20):  # other cached entries the eviction never needs
      _fill(self.pool, self.cache, "other", [int(x) for x in rng.integers(0, 9, 8)])
    asked = []

    def lookup(block_ids):
      asked.append(np.asarray(block_ids).copy())
      return self.pool.ref_count[block_ids]

    b_segments = self.cache.match("ns", [101] * 8, lock=False, record=False).segments
    seq = self.pool.open_sequence(b_segments)  # b's blocks are read by a sequence
    ev = self.cache.evict(num_blocks=3, ref_count=lookup)  # a (2), b (0), c's tail (1)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    self.assertEqual(ev.nodes, (ids["a"], ids["b"], ids["c"]))
    self.assertEqual(ev.num_freed_blocks, 3)
    self.assertLessEqual(len(asked), 2)
    self.assertLess(sum(a.size for a in asked), np.count_nonzero(self.pool.ref_count) + 6)
    self.pool.release(seq)
    self.pool.check(self.cache)
    with self.assertRaises(RefCountMismatchError):
      self.cache.evict(num_blocks=1, ref_count=lambda b: np.zeros(0, np.int64))

  def test_continuing_a_shared_partial_tail_moves_the_tree_reference(self):
    _fill(self.pool, self.cache, "ns", [1, 2, 3, 4, 5, 6])  # blocks 0: 1..4, 1: 5..6
    self.assertFalse(self.cache.match("ns", [1, 2, 3], lock=False).continuable)  # mid-segment
    self.assertFalse(self.cache.match("ns", [1, 2, 3, 4], lock=False).continuable)  # full block
    m = self.cache.match("ns", [1, 2, 3, 4, 5, 6, 7])
    self.assertTrue(m.continuable)
    np.testing.assert_array_equal(m.segments[-1], [1, 0, 2])
    # The pool copies the tail (5, 6) into a fresh block and appends 7, 8 after it.
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    seq = self.pool.open_sequence(m.segments[:-1])
    self.pool.append(seq, kv_of("ns", tokens)[4:])
    copy = int(self.pool.tables[seq][-1, 0])
    out = self.cache.insert("ns", tokens, self.pool.tables[seq])
    self.assertEqual(
        dict(zip(out.ref_deltas.block_ids.tolist(), out.ref_deltas.deltas.tolist())),
        {copy: 2, 1: -1})
    self.pool.apply_tree_deltas(out.ref_deltas)
    self.cache.unlock(m.node)
    self.pool.release(seq)
    self.pool.check(self.cache)
    self.assertEqual(self.pool.ref_count[1], 0)  # the old partial block is free
    self.assertEqual(np.count_nonzero(self.pool.ref_count), 2)  # 8 tokens, 2 blocks
    m = self.cache.match("ns", tokens, lock=False)
    np.testing.assert_array_equal(self.pool.read(m.segments), kv_of("ns", tokens))
    self.assertFalse(m.continuable)

  def test_cost_policy_evicts_fewest_hits_per_token_first(self):
    ids = self._three_leaves()
    self.clock.now = 10.0
    for _ in range(3):
      self.cache.match("ns", [100] * 8, lock=False)  # a: 24 hit tokens / 8
    self.cache.match("ns", [101] * 4, lock=False)  # b: 4 / 8
    self.clock.now = 20.0
    self.cache.match("ns", [102] * 1, lock=False)  # c: 1 / 8, most recent
    ev = self._evict(num_tokens=8, policy="cost")
    self.assertEqual(ev.nodes, (ids["c"],))
    lru = PrefixCache(block_size=4, clock=self.clock)
    self.assertEqual(lru.policy, "lru")
    self.assertEqual(self._evict(num_tokens=16, policy="cost").nodes, (ids["b"], ids["a"]))
    with self.assertRaises(ValueError):
      self.cache.evict(num_tokens=1, policy="fifo")

  def test_locked_nodes_and_ancestors_survive(self):
    _fill(self.pool, self.cache, "ns", [1, 2, 3, 4, 5, 6, 7, 8])
    _fill(self.pool, self.cache, "ns", [1, 2, 3, 4, 9, 9, 9, 9])
    m = self.cache.match("ns", [1, 2, 3, 4, 5, 6])  # locks leaf [5..8] + head
    seq = self.pool.open_sequence(m.segments)
    ev = self._evict(num_tokens=100)
    self.assertEqual(ev.num_tokens, 4)  # only the unlocked [9, 9, 9, 9] leaf
    self.assertEqual(self.cache.match("ns", [1, 2, 3, 4, 5, 6, 7, 8], lock=False).length, 8)
    report = self.cache.evictable(bytes_per_token=10, ref_count=self.pool.ref_count)
    self.assertEqual((report.num_tokens, report.num_bytes, report.num_blocks), (0, 0, 0))
    self.cache.unlock(m.node)
    report = self.cache.evictable(bytes_per_token=10, ref_count=self.pool.ref_count)
    # Blocks 0 and 1 are still held by the running sequence: nothing would be freed.
    self.assertEqual((report.num_tokens, report.num_bytes, report.num_blocks), (8, 80, 0))
    ev = self._evict(num_blocks=1)
    self.assertEqual((ev.num_tokens, ev.num_freed_blocks), (8, 0))  # fell short
    self.pool.release(seq)
    self.pool.check(self.cache)
    with self.assertRaises(StaleNodeError):
      self.cache.unlock(m.node)

  def test_pin_with_ttl(self):
    system = [7] * 8
    self.clock.now = 0.0
    seq = self.pool.open_sequence(np.zeros((0, 3)))
    self.pool.append(seq, kv_of("ns", system))
    out = self.cache.insert("ns", system, self.pool.tables[seq], pin_ttl=100.0)
    self.pool.apply_tree_deltas(out.ref_deltas)
    self.pool.release(seq)
    _fill(self.pool, self.cache, "ns", system + [1, 2])
    self.clock.now = 50.0
    ev = self._evict(num_tokens=100)
    self.assertEqual(ev.num_tokens, 2)  # only the unpinned suffix
    self.assertEqual(self.cache.evictable().num_tokens, 0)
    self.clock.now = 100.0  # TTL expired
    self.assertEqual(self.cache.evictable().num_tokens, 8)
    self.assertEqual(self._evict(num_tokens=100).num_tokens, 8)
    # pin() on an existing prefix, then unpin().
    _fill(self.pool, self.cache, "ns", system)
    self.assertEqual(self.cache.pin("ns", system + [5], ttl=10.0), 8)
    self.assertEqual(self._evict(num_tokens=100).num_tokens, 0)
    self.cache.unpin("ns", system)
    self.assertEqual(self._evict(num_tokens=100).num_tokens, 8)
    with self.assertRaises(ValueError):
      self.cache.pin("ns", system, ttl=-1.0)

  def test_two_phase_gc(self):
    self.cache.granularity = "node"  # whole marked nodes (block granularity: below)
    ids = self._three_leaves()  # a @0, b @1, c @2; blocks a: 0-1, b: 2-3, c: 4-5
    self.clock.now = 10.0
    self.cache.match("ns", [102] * 8, lock=False)  # c touched at 10
    self.clock.now = 15.0
    mark = self.cache.gc_mark(ttl=10.0)  # a and b idle >= 10
    self.assertEqual((mark.num_nodes, mark.num_tokens), (2, 16))
    self.assertEqual(self.cache.evictable().num_gc_marked_tokens, 16)
    # Phase 1 alone frees nothing.
    self.assertEqual(self.pool.num_free, 58)
    # Phase 2 only evicts as much as needed, highest address first: b before a.
    ev = self.cache.gc_evict(num_blocks=1, ref_count=self.pool.ref_count)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    self.assertEqual(ev.nodes, (ids["b"],))
    # A touch after marking unmarks a node.
    self.cache.match("ns", [100] * 8, lock=False)
    ev = self.cache.gc_evict(num_blocks=10, ref_count=self.pool.ref_count)
    self.assertEqual(ev.nodes, ())
    self.assertEqual(self.cache.gc_mark(ttl=0.0).num_nodes, 2)
    ev = self.cache.gc_evict(num_tokens=100, order="low_first")
    self.pool.apply_tree_deltas(ev.ref_deltas)
    self.assertEqual(ev.nodes, (ids["a"], ids["c"]))
    self.assertIsNone(ev.num_freed_blocks)
    self.pool.check(self.cache)
    with self.assertRaises(ValueError):
      self.cache.gc_evict(num_tokens=1, order="random")

  def test_gc_evicts_marked_parent_after_children(self):
    _fill(self.pool, self.cache, "ns", [1] * 4 + [2] * 4)
    _fill(self.pool, self.cache, "ns", [1] * 4 + [3] * 4)
    self.clock.now = 5.0
    self.assertEqual(self.cache.gc_mark(ttl=1.0).num_nodes, 3)
    ev = self.cache.gc_evict(num_tokens=100)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    self.assertLen(ev.nodes, 3)
    self.assertEqual(len(self.cache.tree), 0)
    self.pool.check(self.cache)

  def test_eviction_argument_errors_change_nothing(self):
    self._three_leaves()
    before = len(self.cache.tree)
    with self.assertRaises(ValueError):
      self.cache.evict()
    with self.assertRaises(ValueError):
      self.cache.evict(num_blocks=1)  # no ref_count
    with self.assertRaises(RefCountMismatchError):
      self.cache.evict(num_blocks=100, ref_count=np.zeros(64, np.int64))
    with self.assertRaises(RefCountMismatchError):
      self.cache.evict(num_blocks=100, ref_count=np.ones(3, np.int64))
    self.assertEqual(len(self.cache.tree), before)
    self.pool.check(self.cache)

  def test_apply_remap_follows_compaction(self):
    _fill(self.pool, self.cache, "ns", list(range(12)))
    _fill(self.pool, self.cache, "ns", [0, 1, 2, 3, 4, 50, 51])
    self._evict(num_tokens=0)
    rng = np.random.default_rng(0)
    # Free the low blocks by evicting nothing; shuffle via a permutation instead.
    remap = rng.permutation(64).astype(np.int32)
    inv = np.argsort(remap)
    self.pool.kv = self.pool.kv[inv]
    self.pool.ref_count = self.pool.ref_count[inv]
    self.pool.tree_ledger = self.pool.tree_ledger[inv]
    self.cache.apply_remap(remap)
    self.pool.check(self.cache)
    for seq in (list(range(12)), [0, 1, 2, 3, 4, 50, 51]):
      m = self.cache.match("ns", seq, lock=False)
      np.testing.assert_array_equal(self.pool.read(m.segments), kv_of("ns", seq))

  @parameterized.named_parameters(
      ("too_short", np.arange(2, dtype=np.int32)),
      ("not_injective", np.zeros(64, np.int32)),
      ("out_of_range", np.r_[64, np.arange(1, 64)].astype(np.int32)),
      ("negative", np.r_[-1, np.arange(1, 64)].astype(np.int32)),
      ("floats", np.arange(64, dtype=np.float32)),
      ("two_d", np.arange(64, dtype=np.int32).reshape(8, 8)),
  )
  def test_apply_remap_rejects_bad_remap_atomically(self, remap):
    _fill(self.pool, self.cache, "ns", list(range(12)))
    refs = self.cache.segment_refs()
    with self.assertRaises(RefCountMismatchError):
      self.cache.apply_remap(remap)
    np.testing.assert_array_equal(self.cache.segment_refs(), refs)

  def test_pack_tails_and_rebind(self):
    cache = PrefixCache(block_size=4, pack_tails=True, clock=self.clock)
    tokens = list(range(10))  # 4 + 4 + 2: one short tail
    _, out = _fill(self.pool, cache, "ns", tokens)
    self.assertLen(out.pack, 1)
    cand = out.pack[0]
    self.assertEqual(cand.segment[2], 2)
    # The pool packs the tail into slots 1..2 of a fresh block 40.
    new = self.pool.pack(cand.segment, (40, 1))
    d = cache.rebind_segment(cand.node, cand.segment, new)
    np.testing.assert_array_equal(d.block_ids, sorted([cand.segment[0], 40]))
    self.assertEqual(d.total, 0)
    self.pool.apply_tree_deltas(d)
    self.pool.check(cache)
    m = cache.match("ns", tokens, lock=False)
    self.assertEqual(tuple(m.segments[-1]), (40, 1, 2))
    np.testing.assert_array_equal(self.pool.read(m.segments), kv_of("ns", tokens))
    with self.assertRaises(InvalidSegmentsError):
      cache.rebind_segment(cand.node, cand.segment, new)  # old one is gone
    with self.assertRaises(InvalidSegmentsError):
      cache.rebind_segments(cand.node, [[1, 0, 4]])  # wrong token count
    with self.assertRaises(StaleNodeError):
      cache.rebind_segments(10_000, [[1, 0, 4]])
    # Without pack_tails nothing is named.
    self.assertEqual(_fill(self.pool, self.cache, "x", tokens)[1].pack, ())

  def test_ref_deltas_aggregate(self):
    d = RefDeltas.from_pairs([3, 1, 3, 2, 2], [1, 1, 1, 1, -1])
    np.testing.assert_array_equal(d.block_ids, [1, 3])
    np.testing.assert_array_equal(d.deltas, [1, 2])
    self.assertEqual((d + RefDeltas.from_pairs([1], -1)).total, 2)
    self.assertEqual(d.block_ids.dtype, np.int32)
    self.assertLen(RefDeltas.empty(), 0)

  def test_increfs_of_distinct_blocks_equal_from_pairs(self):
    rng = np.random.default_rng(0)
    for k in (1, 3, 70):  # the dict path and the sorting path of from_pairs
      ids = rng.permutation(200)[:k].astype(np.int32)
      got, want = RefDeltas.increfs(ids[::-1][::-1]), RefDeltas.from_pairs(ids, 1)
      for a, b in ((got.block_ids, want.block_ids), (got.deltas, want.deltas)):
        np.testing.assert_array_equal(a, b)
        self.assertEqual(a.dtype, b.dtype)
    self.assertIsNone(RefDeltas.increfs(np.array([4, 2, 4], np.int32)))  # a repeat
    # An insert hands the tree's references as one incref per new segment's block.
    tokens = np.arange(10, dtype=np.int32)
    out = self.cache.insert("n", tokens, [[7, 0, 4], [3, 0, 4], [9, 0, 2]])
    np.testing.assert_array_equal(out.ref_deltas.block_ids, [3, 7, 9])
    np.testing.assert_array_equal(out.ref_deltas.deltas, [1, 1, 1])

  def test_constructor_validation(self):
    with self.assertRaises(ValueError):
      PrefixCache(block_size=0)
    with self.assertRaises(ValueError):
      PrefixCache(block_size=16, policy="mru")


class LruIndexTest(parameterized.TestCase):
  """LRU eviction from the tree's lazy index (`RadixTree.lru_pop`) against a heap
  over every eligible leaf built per call (the old way): same nodes in the same
  order, under locks held across evictions, pins, split matches, trims, and a
  clock that sometimes goes back."""

  @parameterized.parameters(0, 1, 2, 3)
  def test_same_choice_as_a_heap_over_every_leaf(self, seed):
    rng = np.random.default_rng(seed)
    clock = Clock()
    pool = SimPool(num_blocks=48, block_size=4)
    cache = PrefixCache(block_size=4, clock=clock)
    prefixes = [rng.integers(0, 50, int(rng.integers(2, 12))) for _ in range(5)]
    held = []  # (node, seq) locked matches kept across evictions
    compared = chosen_total = 0
    for step in range(400):
      clock.now += float(rng.choice([0.0, 0.5, 1.0, -2.0], p=[.2, .5, .28, .02]))
      ns = str(rng.choice(["a", "b"]))
      tokens = np.concatenate([prefixes[int(rng.integers(5))],
                               rng.integers(0, 50, int(rng.integers(0, 10)))])
      m = cache.match(ns, tokens, split=bool(rng.random() < 0.3))
      pool.apply_tree_deltas(m.ref_deltas)
      seq = pool.open_sequence(m.segments)
      need = -(-(tokens.shape[0] - m.length) // 4) + 1
      if pool.num_free < need:
        target = need - pool.num_free
        now = clock()
        eligible = lambda n: n.lock_ref == 0 and not n.is_pinned(now)
        args = (eligible, eviction.lru_key, target, pool.ref_count, None, None, "block")
        a = cache._planner.select(*args, lru_index=False)  # pylint: disable=protected-access
        b = cache._planner.select(*args, lru_index=True)  # pylint: disable=protected-access
        self.assertEqual([(n.node_id, f) for n, f in a[0]], [(n.node_id, f) for n, f in b[0]],
                         f"seed {seed} step {step}")
        self.assertEqual(a[1], b[1])
        compared += 1
        chosen_total += len(b[0])
        ev = cache.evict(num_blocks=target, ref_count=pool.ref_count)
        self.assertEqual(ev.nodes, tuple(n.node_id for n, _ in b[0]))
        pool.apply_tree_deltas(ev.ref_deltas)
      if pool.append(seq, kv_of(ns, tokens)[m.length:]):
        out = cache.insert(ns, tokens, pool.tables[seq])
        pool.apply_tree_deltas(out.ref_deltas)
        if rng.random() < 0.1:
          cache.pin(ns, tokens, float(rng.uniform(0.5, 3)))
      if m.node is not None and rng.random() < 0.3:
        held.append((m.node, seq))  # keep the lock (and the sequence) for a while
      else:
        if m.node is not None:
          cache.unlock(m.node)
        pool.release(seq)
      while held and (len(held) > 3 or rng.random() < 0.2):
        node, s = held.pop(0)
        cache.unlock(node)
        pool.release(s)
      pool.check(cache)
    self.assertGreater(compared, 30)
    self.assertGreater(chosen_total, 60)


class PlainSelectTest(parameterized.TestCase):
  """Eviction with a host `ref_count` array (each node's segments in plain Python,
  `EvictionPlanner._take_plain`) against the same eviction through a lookup (numpy per
  node): the same nodes, trims, tokens and freed blocks, with a `countable` mask,
  token targets, and blocks a node holds twice."""

  @parameterized.parameters((0, 64), (1, 64), (2, 64), (0, 2), (1, 3))
  def test_same_choice_as_a_lookup(self, seed, small):
    for module in (radix_cache, segments, eviction):
      self.enter_context(mock.patch.object(module, "SMALL_SEGMENTS", small))
    rng = np.random.default_rng(seed)
    clock = Clock()
    pool = SimPool(num_blocks=40, block_size=4)
    cache = PrefixCache(block_size=4, clock=clock)
    countable = rng.random(40) < 0.8
    prefixes = [rng.integers(0, 50, int(rng.integers(2, 12))) for _ in range(5)]
    compared = 0
    for step in range(300):
      clock.now += 1.0
      ns = str(rng.choice(["a", "b"]))
      tokens = np.concatenate([prefixes[int(rng.integers(5))],
                               rng.integers(0, 50, int(rng.integers(0, 10)))])
      m = cache.match(ns, tokens, split=bool(rng.random() < 0.3))
      pool.apply_tree_deltas(m.ref_deltas)
      seq = pool.open_sequence(m.segments)
      need = -(-(tokens.shape[0] - m.length) // 4) + 1
      now = clock()
      eligible = lambda n: n.lock_ref == 0 and not n.is_pinned(now)
      for target, num_tokens, mask in ((need + int(rng.integers(0, 4)), None, None),
                                       (need, None, countable),
                                       (None, int(rng.integers(1, 30)), countable)):
        for trim in ("block", "node"):
          rc = pool.ref_count if target is not None or rng.random() < 0.5 else None
          a = cache._planner.select(eligible, eviction.lru_key, target, rc, num_tokens, mask,  # pylint: disable=protected-access
                            trim, lru_index=rc is not None)
          lookup = (lambda ids: pool.ref_count[ids]) if rc is not None else None
          if lookup is None:  # no counts: the plain path too; compare with the heap order
            b = cache._planner.select(eligible, eviction.lru_key, target, None, num_tokens, mask,  # pylint: disable=protected-access
                              trim)
          else:
            b = cache._planner.select(eligible, eviction.lru_key, target, lookup, num_tokens, mask,  # pylint: disable=protected-access
                              trim)
          what = f"seed {seed} step {step} {target} {num_tokens} {trim}"
          self.assertEqual([(n.node_id, f) for n, f in a[0]], [(n.node_id, f) for n, f in b[0]],
                           what)
          self.assertEqual(a[1], b[1], what)
          compared += bool(a[0])
      if pool.num_free < need:
        ev = cache.evict(num_blocks=need - pool.num_free, ref_count=pool.ref_count)
        pool.apply_tree_deltas(ev.ref_deltas)
      if pool.append(seq, kv_of(ns, tokens)[m.length:]):
        out = cache.insert(ns, tokens, pool.tables[seq])
        pool.apply_tree_deltas(out.ref_deltas)
      if m.node is not None:
        cache.unlock(m.node)
      pool.release(seq)
      pool.check(cache)
    self.assertGreater(compared, 300)

  def test_counts_below_the_tree_are_refused(self):
    pool = SimPool(num_blocks=16, block_size=4)
    cache = PrefixCache(block_size=4, clock=Clock())
    _fill(pool, cache, "ns", list(range(10)))
    low = pool.ref_count.copy()
    low[low > 0] -= 1
    low[cache.segment_refs()[0, 0]] = 0
    for rc in (low, lambda ids: low[ids]):
      with self.assertRaisesRegex(RefCountMismatchError, "below the tree"):
        cache.evict(num_blocks=1, ref_count=rc)
    with self.assertRaisesRegex(RefCountMismatchError, "but ref_count has"):
      cache.evict(num_blocks=1, ref_count=np.zeros(1, np.int64))
    self.assertEqual(len(cache.tree), 1)  # nothing changed


class CacheMachine(RuleBasedStateMachine):
  """Random requests, finishes, evictions, GC, compactions and packing vs a model.

  Model: per namespace, the set of token tuples ever inserted, plus the tuples
  guaranteed to be still cached (inserted since the last eviction). Checks: a match
  returns exactly the KV written for its tokens, its length equals a brute-force
  longest common prefix over the tree's own sequences (which must all be prefixes of
  inserted sequences of that namespace), guaranteed sequences match in full, a
  running sequence's locked prefix survives, and ref counts equal table refs + tree
  refs with the tree's refs equal to the sum of the deltas it returned.
  """

  BLOCK_SIZE = 4
  NUM_BLOCKS = 10

  def __init__(self):
    super().__init__()
    self.clock = Clock()
    self.pool = SimPool(self.NUM_BLOCKS, self.BLOCK_SIZE)
    self.cache = PrefixCache(block_size=self.BLOCK_SIZE, pack_tails=True, clock=self.clock)
    self.rng = np.random.default_rng(0)
    self.inserted = {}  # ns -> set of tuples
    self.guaranteed = {}  # ns -> set of tuples
    self.running = []  # (seq, ns, tokens, locked node, matched length)
    self.pack_target = None  # (block, next free slot, generation) for packing

  def _evicted(self):
    self.guaranteed = {}

  def _make_room(self, need_blocks):
    free = self.pool.num_free
    if free >= need_blocks:
      return True
    ev = self.cache.evict(num_blocks=need_blocks - free, ref_count=self.pool.ref_count)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    if ev.nodes:
      event("evicted under pressure")
      self._evicted()
    assert ev.num_freed_blocks == self.pool.num_free - free
    return self.pool.num_free >= need_blocks

  @rule(ns=st.sampled_from(["a", "b"]), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
  def request(self, ns, tokens):
    m = self.cache.match(ns, tokens)
    np.testing.assert_array_equal(self.pool.read(m.segments), kv_of(ns, tokens[: m.length]))
    lcp = 0
    for s in self.cache.tree.sequences(ns):
      s = s.tolist()
      k = 0
      while k < min(len(s), len(tokens)) and s[k] == tokens[k]:
        k += 1
      lcp = max(lcp, k)
    assert m.length == lcp, (m.length, lcp)
    for g in self.guaranteed.get(ns, ()):
      assert m.length >= len(g) or tuple(tokens[: len(g)]) != g
    if m.length:
      event("partial hit" if m.length < len(tokens) else "full hit")
    seq = self.pool.open_sequence(m.segments)
    rest = len(tokens) - m.length
    need = -(-rest // self.BLOCK_SIZE)
    if not self._make_room(need):
      if m.node is not None:
        self.cache.unlock(m.node)
      self.pool.release(seq)
      return
    assert self.pool.append(seq, kv_of(ns, tokens)[m.length :])
    self.running.append((seq, ns, tuple(tokens), m.node, m.length))

  @rule(
      ns=st.sampled_from(["a", "b"]),
      batch=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=14), min_size=2, max_size=5),
      pack=st.booleans(),
  )
  def burst(self, ns, batch, pack):
    """Several requests served back to back: fills the cache, forces eviction."""
    for tokens in batch:
      before = len(self.running)
      self.request(ns, tokens)
      if len(self.running) > before:
        self._finish(len(self.running) - 1, pack, False)

  @precondition(lambda self: self.running)
  @rule(data=st.data(), pack=st.booleans(), pin=st.booleans())
  def finish(self, data, pack, pin):
    self._finish(data.draw(st.integers(0, len(self.running) - 1)), pack, pin)

  def _finish(self, i, pack, pin):
    seq, ns, tokens, node, _ = self.running.pop(i)
    out = self.cache.insert(ns, tokens, self.pool.tables[seq], pin_ttl=5.0 if pin else None)
    self.pool.apply_tree_deltas(out.ref_deltas)
    leaf_refs = 0 if out.node is None else self.cache.node_segments(out.node).shape[0]
    if out.ref_deltas.total > leaf_refs:
      event("split cut a segment")
    if node is not None:
      self.cache.unlock(node)
    self.pool.release(seq)
    self.inserted.setdefault(ns, set()).add(tokens)
    self.guaranteed.setdefault(ns, set()).add(tokens)
    if pack:
      for cand in out.pack:
        b, s, l = cand.segment
        tb, ts, gen = self.pack_target or (None, self.BLOCK_SIZE, -1)
        # A slotted block stays ours only while it was never freed since.
        if (
            tb is None
            or self.pool.ref_count[tb] == 0
            or self.pool.generation[tb] != gen
            or ts + l > self.BLOCK_SIZE
        ):
          if not self._make_room(1):
            break
          tb, ts = int(np.flatnonzero(self.pool.ref_count == 0)[0]), 0
          self.pool.generation[tb] += 1
          gen = int(self.pool.generation[tb])
        if cand.node not in self.cache.tree:
          break
        new = self.pool.pack(cand.segment, (tb, ts))
        self.pool.apply_tree_deltas(self.cache.rebind_segment(cand.node, cand.segment, new))
        self.pack_target = (tb, ts + l, gen)
        event("packed a tail")

  @rule(n=st.integers(0, 8), policy=st.sampled_from(["lru", "cost"]))
  def evict(self, n, policy):
    free = self.pool.num_free
    ev = self.cache.evict(num_blocks=n, ref_count=self.pool.ref_count, policy=policy)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    assert ev.num_freed_blocks == self.pool.num_free - free
    if ev.nodes:
      self._evicted()

  @rule(ttl=st.floats(0, 5), n=st.integers(0, 8))
  def gc(self, ttl, n):
    self.cache.gc_mark(ttl)
    ev = self.cache.gc_evict(num_blocks=n, ref_count=self.pool.ref_count)
    self.pool.apply_tree_deltas(ev.ref_deltas)
    if ev.nodes:
      self._evicted()

  @rule(dt=st.floats(0, 3))
  def advance(self, dt):
    self.clock.now += dt

  @rule()
  def compact(self):
    remap = self.pool.compact(self.rng)
    self.cache.apply_remap(remap)
    if self.pack_target is not None:
      tb, ts, gen = self.pack_target
      self.pack_target = (int(remap[tb]), ts, gen)

  @invariant()
  def refs_never_drift(self):
    self.pool.check(self.cache)

  @invariant()
  def tree_holds_original_kv(self):
    for ns in self.cache.tree.namespaces():
      for s in self.cache.tree.sequences(ns):
        t = tuple(s.tolist())
        assert any(t == full[: len(t)] for full in self.inserted.get(ns, ())), t
        m = self.cache.match(ns, s, lock=False, record=False)
        assert m.length == len(t)
        np.testing.assert_array_equal(self.pool.read(m.segments), kv_of(ns, t))

  @invariant()
  def running_sequences_intact(self):
    for seq, ns, tokens, node, length in self.running:
      np.testing.assert_array_equal(self.pool.read(self.pool.tables[seq]), kv_of(ns, tokens))
      if node is not None:  # the locked prefix can't be evicted
        m = self.cache.match(ns, tokens, lock=False, record=False)
        assert m.length >= length


CacheMachine.TestCase.settings = settings(
    max_examples=_EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


if __name__ == "__main__":
  absltest.main()
