"""The mirror's plain-Python paths for a few blocks against the general, vectorised ones.

`HostState.change_refs` of up to `SMALL_CHANGES` entries runs in plain Python
(`_change_refs_small`); `ChangeRefsTest` applies random changes (repeats, base
blocks, blocks freed and taken) through it and through `_change_refs_general`
on copies of the same state and compares every array and the change log.
`LongRowTest`: a one-row open or release of more than `SMALL_CHANGES` segments
sums its blocks once for the table and reference counts (`HostState.open_row`,
`release_row`); compared with the general batch paths (a row padded with `-1`).
`apply_ref_deltas` of more than `SMALL_DELTAS` distinct entries (an eviction's
decrefs) takes a vectorised fast path: compared with the general path too.

`HostFreeIndex.lowest(k)` and `mark` of up to `SMALL_BLOCKS` blocks run in
plain Python from a hint word (`_lowest_small`, `_mark_small`); here two
indexes follow the same random takes and frees, one through the public calls
(the small paths where they apply), the other through `_mark_general` only,
and every answer of `_lowest_small` is compared with `_lowest_general` and with
the mask itself. The arrays (`bits`, `counts`, `num_free`) must stay equal, and
the hint must stay below every free block. The general paths are compared with
the device in `test_transitions_match.py`.
"""

from __future__ import annotations

import copy

import numpy as np
from absl.testing import absltest, parameterized

from paged_kv.core.config import PoolConfig
from paged_kv.core.state import REGION_DYNAMIC
from paged_kv.pool import free_index
from paged_kv.pool import host_transitions as T
from paged_kv.pool.free_index import HostFreeIndex
from paged_kv.pool.host_state import SMALL_CHANGES, HostState
from tests.pool.test_one_row import _same


def _check(test, fast: HostFreeIndex, general: HostFreeIndex, free: np.ndarray, what: str):
  np.testing.assert_array_equal(fast.bits, general.bits, err_msg=f"{what}: bits")
  np.testing.assert_array_equal(fast.counts, general.counts, err_msg=f"{what}: counts")
  test.assertEqual(fast.num_free, general.num_free, what)
  test.assertEqual(fast.num_free, int(free.sum()), what)
  test.assertFalse(fast.bits[:fast._low].any(), f"{what}: a free block below the hint")


def _mark_general(h: HostFreeIndex, blocks, delta: int) -> None:
  """`mark` by the general path only."""
  b = np.asarray(blocks, np.int64)
  h._mark_general(b, delta)
  h.num_free += delta * int(b.size)


class SmallPathTest(parameterized.TestCase):

  @parameterized.parameters(33, 1025, 5_000, 70_000)
  def test_small_paths_equal_the_general_ones(self, n):
    rng = np.random.default_rng(n)
    free = rng.random(n) < 0.3
    fast, general = HostFreeIndex.from_mask(free), HostFreeIndex.from_mask(free)
    small_answers = 0
    for step in range(400):
      what = f"n {n} step {step}"
      k = int(rng.integers(1, 2 * free_index.SMALL_BLOCKS))
      if rng.random() < 0.5 and free.any():
        k = min(k, int(free.sum()))
        want = np.flatnonzero(free)[:k]
        probe = copy.deepcopy(fast)
        got_small = probe._lowest_small(k) if k <= free_index.SMALL_BLOCKS else None
        if got_small is not None:
          small_answers += 1
          np.testing.assert_array_equal(got_small, want, err_msg=what)
        np.testing.assert_array_equal(fast._lowest_general(k), want, err_msg=what)
        take = fast.lowest(k)
        np.testing.assert_array_equal(take, want, err_msg=what)
        if rng.random() < 0.5:  # some taken from elsewhere: not the lowest
          pick = rng.choice(np.flatnonzero(free), size=k, replace=False)
          take = np.sort(pick)
        fast.mark(take, -1)
        _mark_general(general, take, -1)
        free[take] = False
      elif (~free).any():
        taken = np.flatnonzero(~free)
        if rng.random() < 0.5:  # a scattered set
          b = rng.choice(taken, size=min(k, taken.size), replace=False)
        else:  # a stretch, across words
          start = int(rng.integers(0, n))
          b = np.flatnonzero(~free[start:start + 3 * k]) + start
          b = b[:k]
        if not b.size:
          continue
        fast.mark(b, +1)
        _mark_general(general, b, +1)
        free[b] = True
      _check(self, fast, general, free, what)
    self.assertGreater(small_answers, 10)  # the small path answered (not only fell back)

  def test_the_hint_follows_frees_below_it(self):
    n = 4096
    free = np.zeros(n, bool)
    free[3000:3010] = True
    h = HostFreeIndex.from_mask(free)
    np.testing.assert_array_equal(h.lowest(3), [3000, 3001, 3002])  # the hint moves up
    for b in ([5], [40, 41, 700], list(range(64, 64 + free_index.SMALL_BLOCKS + 1))):
      h.mark(np.array(b), +1)
      free[b] = True
      np.testing.assert_array_equal(h.lowest(2), np.flatnonzero(free)[:2])
      h.mark(np.array(b), -1)
      free[b] = False

  def test_far_free_blocks_fall_back(self):
    n = 1 << 20
    free = np.zeros(n, bool)
    free[[5_000, 600_000, n - 1]] = True
    h = HostFreeIndex.from_mask(free)
    self.assertIsNone(copy.deepcopy(h)._lowest_small(2))
    np.testing.assert_array_equal(h.lowest(1), [5_000])
    np.testing.assert_array_equal(h.lowest(2), [5_000, 600_000])
    np.testing.assert_array_equal(h.lowest(3), [5_000, 600_000, n - 1])


class ChangeRefsTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_small_changes_equal_the_general_path(self, seed):
    cfg = PoolConfig(num_blocks=(40, 300, 2100)[seed], block_size=4, num_layers=1,
                     num_kv_heads=1, head_dim=2, max_seqs=4, max_segments=8,
                     base_pool_fraction=0.2 * (seed != 1), scrub_freed_blocks=seed == 2)
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    n = cfg.num_blocks
    flips = 0
    for step in range(300):
      live = np.flatnonzero(h.ref_count > 0)
      free = np.flatnonzero((h.ref_count == 0) & (h.region == REGION_DYNAMIC))
      if free.size and (live.size < 8 or rng.random() < 0.3):  # take some (as an allocation)
        take = np.sort(rng.choice(free, size=min(int(rng.integers(1, 12)), free.size),
                                  replace=False))
        h.take_blocks(take)
        h.set_slots(take, np.full((take.size, cfg.slot_words), 7, np.uint32))
        h.log.reset(h)
        continue
      k = int(rng.integers(2, SMALL_CHANGES + 1))
      ids = rng.choice(live, size=k)  # repeats allowed
      deltas = rng.integers(-2, 3, size=k)
      if rng.random() < 0.3:
        deltas[:] = -1 if rng.random() < 0.5 else 1
      zero = np.flatnonzero(h.ref_count == 0)  # free dynamic and base blocks
      if zero.size and rng.random() < 0.3:  # a free block taken by the change
        ids[0], deltas[0] = int(rng.choice(zero)), 1
      before = h.ref_count.copy()
      totals = np.zeros(n, np.int64)
      np.add.at(totals, ids, deltas)
      if (before + totals < 0).any():  # the caller's check: counts stay >= 0
        continue
      small, general = copy.deepcopy(h), copy.deepcopy(h)
      one = int(deltas[0]) if rng.random() < 0.3 else None  # one delta for all
      d = np.int64(one) if one is not None else deltas
      if one is not None:
        totals[:] = 0
        np.add.at(totals, ids, one)
        if (before + totals < 0).any():
          continue
      freed_a = small._change_refs_small(np.asarray(ids, np.int64), np.asarray(d, np.int64))
      freed_b = general._change_refs_general(np.asarray(ids, np.int64),
                                             np.asarray(d, np.int64))
      what = f"seed {seed} step {step}"
      self.assertEqual(sorted(freed_a.tolist()), sorted(freed_b.tolist()), what)
      for f in ("ref_count", "slots", "table_refs"):
        np.testing.assert_array_equal(getattr(small, f), getattr(general, f),
                                      err_msg=f"{what}: {f}")
      self.assertEqual((small.num_free_base, small.free.num_free),
                       (general.num_free_base, general.free.num_free), what)
      np.testing.assert_array_equal(small.free.bits, general.free.bits, err_msg=what)
      np.testing.assert_array_equal(small.free.counts, general.free.counts, err_msg=what)
      np.testing.assert_array_equal(np.sort(small.log.touched_blocks(small)),
                                    np.sort(general.log.touched_blocks(general)), err_msg=what)
      self.assertEqual((small.log._zero_before, small.log.num_freed),
                       (general.log._zero_before, general.log.num_freed), what)
      flips += int(freed_a.size > 0) + int(bool(((before == 0) & (small.ref_count > 0)).any()))
      h = small
      h.log.reset(h)
    self.assertGreater(flips, 10)  # blocks freed and taken along the way (the flips ran)

  @parameterized.parameters(0, 1)
  def test_many_reference_deltas_equal_the_general_path(self, seed):
    # More than SMALL_DELTAS distinct entries: the vectorised fast path (decrefs only,
    # or mixed) against the general path (the same entries and a padding -1 entry).
    cfg = PoolConfig(num_blocks=400, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=4, max_segments=64, base_pool_fraction=0.1 * seed,
                     scrub_freed_blocks=bool(seed))
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    T.open_rows(h, np.array([0]), np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64),
                np.zeros((1, 1), np.int64), np.array([0]))
    applied = freed = 0
    for step in range(250):
      free = np.flatnonzero((h.ref_count == 0) & (h.region == REGION_DYNAMIC))
      if free.size > 40 and rng.random() < 0.4:  # the row takes blocks (table references)
        T.reserve(h, np.array([0]), np.array([int(rng.integers(1, 4 * cfg.block_size))]),
                  max_new_tokens=16, atomic=True)
      if h.num_segments[0] > 40 and rng.random() < 0.2:
        T.release(h, np.array([0]), atomic=True)
        T.open_rows(h, np.array([0]), np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64),
                    np.zeros((1, 1), np.int64), np.array([0]))
      h.log.reset(h)
      live = np.flatnonzero(h.ref_count > 0)
      k = int(rng.integers(T.SMALL_DELTAS + 1, 3 * T.SMALL_DELTAS))
      pick = rng.choice(np.arange(cfg.num_blocks), size=k, replace=False)
      if live.size >= k and rng.random() < 0.8:
        pick = rng.choice(live, size=k, replace=False)
      outside = np.flatnonzero(h.ref_count > h.table_refs)
      if outside.size > k and rng.random() < 0.3:  # every outside reference dropped
        pick = rng.choice(outside, size=k, replace=False)  # (frees the unheld blocks)
        d = h.table_refs[pick].astype(np.int64) - h.ref_count[pick]
      elif rng.random() < 0.5:  # an eviction's decrefs
        d = -np.ones(k, np.int64)
      else:
        d = rng.integers(-2, 3, size=k)
      if rng.random() < 0.7:  # the tree's references first (what decrefs may then drop)
        T.apply_ref_deltas(h, pick[h.ref_count[pick] > 0],
                           np.full(int((h.ref_count[pick] > 0).sum()), 2))
        h.log.reset(h)
      fast, general = copy.deepcopy(h), copy.deepcopy(h)
      a = T.apply_ref_deltas(fast, pick, d)
      b = T.apply_ref_deltas(general, np.concatenate([pick, [-1]]),
                             np.concatenate([d, [0]]))[:k]
      what = f"seed {seed} step {step}"
      np.testing.assert_array_equal(a, b, err_msg=what)
      _same(self, fast, general, what)
      applied += int(not a.any())
      freed += int(((h.ref_count[pick] > 0) & (fast.ref_count[pick] == 0)).any())
      h = fast
      h.log.reset(h)
    self.assertGreater(applied, 10)  # the fast path applied ...
    self.assertGreater(freed, 3)  # ... and freed blocks along the way

  def test_reference_deltas_take_the_small_path(self):
    # What a prefix cache hands over: distinct blocks, valid changes. The statuses
    # against the general path on invalid ones are `test_one_row.py`'s.
    cfg = PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=4, max_segments=8)
    h = HostState.empty(cfg)
    h.take_blocks(np.arange(10))
    called = []
    small = h.set_refs_small
    h.set_refs_small = lambda b, *rest: called.append(b.size) or small(b, *rest)
    st = T.apply_ref_deltas(h, np.arange(10), np.array([1, -1] * 5))
    np.testing.assert_array_equal(st, np.zeros(10))
    self.assertEqual(called, [10])
    np.testing.assert_array_equal(h.ref_count[:10], [2, 0] * 5)
    np.testing.assert_array_equal(h.free.lowest(3), [1, 3, 5])


class LongRowTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_long_rows_equal_the_general_path(self, seed):
    cfg = PoolConfig(num_blocks=300, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=6, max_segments=64, scrub_freed_blocks=seed == 1,
                     base_pool_fraction=0.1 * (seed == 2))
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    bs = cfg.block_size
    long_calls = 0
    for step in range(120):
      live, idle = np.flatnonzero(h.active), np.flatnonzero(~h.active)
      kind = str(rng.choice(["open", "reserve", "release"], p=[.45, .3, .25]))
      lean, general = copy.deepcopy(h), copy.deepcopy(h)
      what = f"seed {seed} step {step} {kind}"
      if kind == "open" and idle.size:
        row = int(idle[0])
        segs = np.zeros((0, 3), np.int64)
        if live.size:  # segments of live rows, with repeats, some cut in two
          pool = np.concatenate([np.stack([h.block[r, :h.num_segments[r]],
                                           h.start[r, :h.num_segments[r]],
                                           h.length[r, :h.num_segments[r]]], axis=1)
                                 for r in live])
          if pool.size:
            pick = pool[rng.integers(0, pool.shape[0], int(rng.integers(1, 64)))]
            out = []
            for b, st, ln in pick.tolist():
              if ln > 1 and rng.random() < 0.3:
                cut = int(rng.integers(1, ln))
                out += [(b, st, cut), (b, st + cut, ln - cut)]
              else:
                out.append((b, st, ln))
            segs = np.array(out[:cfg.max_segments], np.int64)
        k = segs.shape[0]
        long_calls += int(k > SMALL_CHANGES)
        grid = np.zeros((3, 2, max(k, 1)), np.int64)
        grid[:, 0, :k] = segs.T
        nums = np.array([k, 0])
        if rng.random() < 0.5:
          a = T.open_rows(lean, np.array([row]), grid[0, :1], grid[1, :1], grid[2, :1], nums[:1])
          b = T.open_rows(general, np.array([row, -1]), *grid, nums)[:1]
        else:
          a, copied = T.open_one_copying_tail(lean, row, *segs.T) if k else (
              T.open_rows(lean, np.array([row]), grid[0, :1], grid[1, :1], grid[2, :1],
                          nums[:1]), False)
          b = T.open_rows(general, np.array([row, -1]), *grid, nums)[:1]
          split = np.zeros(1, bool)
          if b[0] == 0:
            split, _ = T.cow_split(general, np.array([row, -1]), atomic=False)
          self.assertEqual(copied, bool(split[0]), what)
      elif kind == "reserve" and live.size:
        row = int(rng.choice(live))
        n = int(rng.integers(1, 40 * bs))
        t = 1 << n.bit_length()
        a = T.reserve(lean, np.array([row]), np.array([n]), max_new_tokens=t, atomic=True)[1]
        b = T.reserve(general, np.array([row, -1]), np.array([n, 0]), max_new_tokens=t,
                      atomic=True)[1][:1]
      elif kind == "release" and live.size:
        row = int(rng.choice(live))
        long_calls += int(h.num_segments[row] > SMALL_CHANGES)
        a = T.release(lean, np.array([row]), atomic=True)
        b = T.release(general, np.array([row, -1]), atomic=True)[:1]
      else:
        continue
      np.testing.assert_array_equal(a, b, err_msg=what)
      _same(self, lean, general, what)
      h = lean
      h.log.reset(h)
    self.assertGreater(long_calls, 10)  # rows past SMALL_CHANGES opened and released


if __name__ == "__main__":
  absltest.main()
