"""Stateful test: open/reserve/write/fork/release interleaved with pack, cow_split,
compaction, promotion and shrink/grow, against a plain-Python model.

After every step: `paged_kv.check_invariants` holds (tables + the segments a
pretend prefix cache holds outside the pool), every live sequence's logical K/V
(`paged_kv.gather_kv`) is bit-identical to the model, and so is every cached
segment's K/V. More examples: `PAGED_KV_HYPOTHESIS_EXAMPLES=200`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import paged_kv
from tests.testutil import KVModel, small_config

CONFIG = small_config(base_pool_fraction=0.125)  # blocks 0..3: base pool
SHRUNK = 24
_EXAMPLES = int(os.environ.get("PAGED_KV_HYPOTHESIS_EXAMPLES", "8"))


class FragmentationMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    self.pool = paged_kv.BlockPool(CONFIG)
    self.model = KVModel(self.pool, seed=0)
    # The pretend prefix cache: segments (block, start, length) with their K and V.
    self.cache: list[tuple[tuple[int, int, int], np.ndarray, np.ndarray]] = []

  # -- helpers ------------------------------------------------------------------
  def _live(self) -> list[int]:
    return sorted(self.model.kv)

  def _segment_kv(self, seg):
    b, s, ln = seg
    p = self.pool.state.pages
    return np.asarray(p.k[:, :, b, s:s + ln]), np.asarray(p.v[:, :, b, s:s + ln])

  def _remap_cache(self, remap):
    self.cache = [((int(remap[b]), s, ln), k, v) for (b, s, ln), k, v in self.cache]

  # -- sequence rules -------------------------------------------------------------
  @precondition(lambda self: len(self.model.kv) < CONFIG.max_seqs)
  @rule(from_cache=st.booleans(), data=st.data())
  def open(self, from_cache, data):
    if from_cache and self.cache:
      i = data.draw(st.integers(0, len(self.cache) - 1))
      seg, k, v = self.cache[i]
      seq = self.pool.open_sequence([seg])
      self.model.kv[seq] = (k.copy(), v.copy())
    else:
      self.model.open()

  @precondition(lambda self: self.model.kv)
  @rule(data=st.data(), count=st.integers(1, 12))
  def append(self, data, count):
    seq = data.draw(st.sampled_from(self._live()))
    try:
      self.model.append([seq], [count])
    except paged_kv.PoolExhausted:
      pass  # refused atomically: the model is unchanged too

  @precondition(lambda self: self.model.kv and len(self.model.kv) < CONFIG.max_seqs)
  @rule(data=st.data())
  def fork(self, data):
    self.model.fork(data.draw(st.sampled_from(self._live())))

  @precondition(lambda self: self.model.kv)
  @rule(data=st.data())
  def release(self, data):
    self.model.release([data.draw(st.sampled_from(self._live()))])

  # -- prefix-cache rules -----------------------------------------------------------
  @precondition(lambda self: self.model.kv)
  @rule(data=st.data())
  def cache_insert(self, data):
    seq = data.draw(st.sampled_from(self._live()))
    b, s, ln = self.pool.segments(seq).T
    if len(b) == 0:
      return
    j = data.draw(st.integers(0, len(b) - 1))
    seg = (int(b[j]), int(s[j]), int(ln[j]))
    self.pool.apply_ref_deltas([seg[0]], [1])
    self.cache.append((seg, *self._segment_kv(seg)))

  @precondition(lambda self: self.cache)
  @rule(data=st.data())
  def cache_evict(self, data):
    i = data.draw(st.integers(0, len(self.cache) - 1))
    seg, _, _ = self.cache.pop(i)
    self.pool.apply_ref_deltas([seg[0]], [-1])

  # -- fragmentation rules ------------------------------------------------------------
  @rule(data=st.data())
  def pack(self, data):
    bs = CONFIG.block_size
    table = []
    region = np.asarray(self.pool.state.meta.region)
    dynamic = lambda b: region[b] == paged_kv.core.state.REGION_DYNAMIC  # base blocks are pinned
    for seq in self._live():
      blk, _, ln = self.pool.segments(seq).T
      table += [(seq, c) for c in range(len(ln)) if ln[c] < bs and dynamic(blk[c])]
    extra_idx = [i for i, (seg, _, _) in enumerate(self.cache) if seg[2] < bs and dynamic(seg[0])]
    pick_t = data.draw(st.lists(st.sampled_from(table), unique=True, max_size=3)) if table else []
    pick_e = (data.draw(st.lists(st.sampled_from(extra_idx), unique=True, max_size=3))
              if extra_idx else [])
    if not pick_t and not pick_e:
      return
    try:
      res = self.pool.pack_slots(table_segments=pick_t,
                                 extra_segments=[self.cache[i][0] for i in pick_e])
    except paged_kv.PoolExhausted:
      return
    for i, new in zip(pick_e, res.extra_segments):
      _, k, v = self.cache[i]
      self.cache[i] = (tuple(int(x) for x in new), k, v)

  @rule(omit_one=st.booleans())
  def reclaim_slots(self, omit_one):
    """Dead slots become reusable; with a holder left out, nothing may change."""
    held = [seg for seg, _, _ in self.cache]
    if omit_one and held:
      before = jax.tree.map(np.asarray, self.pool.state)
      with pytest.raises(paged_kv.InvalidSegment):
        self.pool.reclaim_slots(held[1:])
      jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray,
                                                                       self.pool.state))
      return
    self.pool.reclaim_slots(held)

  @precondition(lambda self: self.model.kv)
  @rule(data=st.data())
  def cow_split(self, data):
    seq = data.draw(st.sampled_from(self._live()))
    try:
      self.pool.cow_split([seq])
    except paged_kv.PoolExhausted:
      pass

  @rule(budget=st.sampled_from([1, 4, 32]))
  def compact(self, budget):
    self._remap_cache(self.pool.compact(budget=budget))

  @rule(min_readers=st.integers(2, 3))
  def promote(self, min_readers):
    self._remap_cache(self.pool.promote(min_readers=min_readers, max_moves=2))

  @rule()
  def shrink_and_grow(self):
    for _ in range(4):
      self._remap_cache(self.pool.compact(budget=32))
    ref = np.asarray(self.pool.state.meta.ref_count)
    if ref[SHRUNK:].any():
      return
    self.pool.resize(SHRUNK)
    self.check()
    self.pool.resize(CONFIG.num_blocks)
    grown = self.pool.config
    assert (grown.num_blocks, grown.num_base_blocks) == (CONFIG.num_blocks, CONFIG.num_base_blocks)
    self.pool.config = CONFIG  # same sizes and base region: reuse the compiled code

  # -- invariants ---------------------------------------------------------------
  @invariant()
  def check(self):
    self.model.check(extra_segments=[seg for seg, _, _ in self.cache] or None)
    for seg, k, v in self.cache:
      gk, gv = self._segment_kv(seg)
      np.testing.assert_array_equal(gk, k)
      np.testing.assert_array_equal(gv, v)


FragmentationMachine.TestCase.settings = settings(
    max_examples=_EXAMPLES, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestFragmentation = FragmentationMachine.TestCase
