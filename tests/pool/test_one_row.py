"""The one-row lean paths of the mirror's transitions against their general paths.

`paged_kv.pool.host_transitions` routes a one-row `open_rows`, `reserve`, `release`
and `cow_split`, and `apply_ref_deltas` of a few entries, to a lean path; here
each is compared with the general path on the same state (a one-row call padded
with a `-1` row takes the general path):
same statuses, same results, same mirror afterwards, same change log. The
states come from random host-only runs (the general paths are compared with the
device in `test_transitions_match.py`), and the calls include the edge cases:
inactive and out-of-range rows, counts past the table, too few free blocks,
shared tails, and exclusive tails with written slots after them (a row opened on
a shortened prefix whose other holder left).
"""

from __future__ import annotations

import copy

import numpy as np
from absl.testing import absltest, parameterized

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import Status
from paged_kv.pool import host_transitions as T
from paged_kv.pool.host_state import HostState

FIELDS = ("ref_count", "slots", "region", "block", "start", "length", "num_segments",
          "seq_len", "active", "table_refs")


def _same(test, a, b, what):
  for f in FIELDS:
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f"{what}: {f}")
  test.assertEqual((a.step, a.num_table_blocks, a.num_free_base, a.free.num_free),
                   (b.step, b.num_table_blocks, b.num_free_base, b.free.num_free), what)
  np.testing.assert_array_equal(a.free.bits, b.free.bits, err_msg=what)
  np.testing.assert_array_equal(np.sort(a.log.touched_blocks(a)),
                                np.sort(b.log.touched_blocks(b)), err_msg=f"{what}: log")
  test.assertEqual(a.log.num_rows, b.log.num_rows, what)
  test.assertEqual(a.log.num_copies, b.log.num_copies, what)


class OneRowTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2, 3)
  def test_lean_paths_equal_the_general_ones(self, seed):
    cfg = PoolConfig(num_blocks=(24, 32, 40, 14)[seed], block_size=4, num_layers=1, num_kv_heads=1,
                     head_dim=2, max_seqs=6, max_segments=6, base_pool_fraction=0.25 * (seed == 2),
                     scrub_freed_blocks=bool(seed % 2))
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    s, bs = cfg.max_seqs, cfg.block_size
    applied = 0
    for step in range(300):
      kind = str(rng.choice(["open", "reserve", "release", "cow", "deltas"],
                            p=[.25, .4, .1, .15, .1]))
      want = np.flatnonzero(h.active != (kind == "open"))  # rows the call applies to
      row = (int(rng.choice(want)) if want.size and rng.random() < 0.85
             else int(rng.integers(-1, s + 1)))
      lean, general = copy.deepcopy(h), copy.deepcopy(h)
      what = f"seed {seed} step {step} {kind} row {row}"
      shortened = None
      if kind == "open":
        live = np.flatnonzero(h.active)
        k = 0
        grid = np.zeros((3, 2, 4), np.int64)
        if live.size:
          src = int(rng.choice(live))
          k = int(rng.integers(0, min(int(h.num_segments[src]), 4) + 1))
          grid[:, 0, :k] = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]])
          if k and grid[2, 0, k - 1] > 1 and rng.random() < 0.4:
            grid[2, 0, k - 1] -= int(rng.integers(1, grid[2, 0, k - 1]))  # a shorter tail
            shortened = src
          if k and rng.random() < 0.1:
            grid[2, 0, 0] += 1  # onto unwritten slots, or past the block
        nums = np.array([k, 0])
        if rng.random() < 0.5:
          a = T.open_rows(lean, np.array([row]), grid[0, :1], grid[1, :1], grid[2, :1],
                          nums[:1])
          b = T.open_rows(general, np.array([row, -1]), *grid, nums)[:1]
        else:  # the open and the tail copy in one pass, against the two calls
          a, copied = T.open_one_copying_tail(lean, row, grid[0, 0, :k], grid[1, 0, :k],
                                              grid[2, 0, :k])
          b = T.open_rows(general, np.array([row, -1]), *grid, nums)[:1]
          split = np.zeros(1, bool)
          if b[0] == 0 and row != -1:
            split, _ = T.cow_split(general, np.array([row, -1]), atomic=False)
          self.assertEqual(copied, bool(split[0]), what)
      elif kind == "reserve":
        n = int(rng.integers(-1, 3 * bs)) if rng.random() < 0.7 else int(rng.integers(0, 3))
        t = 1 << max(n, 1).bit_length()
        a = T.reserve(lean, np.array([row]), np.array([n]), max_new_tokens=t, atomic=True)
        b = T.reserve(general, np.array([row, -1]), np.array([n, 0]), max_new_tokens=t,
                      atomic=True)
        np.testing.assert_array_equal(a[0], b[0][:1], err_msg=what)
        a, b = a[1], b[1][:1]
      elif kind == "release":
        a = T.release(lean, np.array([row]), atomic=True)
        b = T.release(general, np.array([row, -1]), atomic=True)[:1]
      elif kind == "deltas":  # a few entries (the small path) vs padded past it
        k = int(rng.integers(1, 6))
        live = np.flatnonzero(h.ref_count > 0)
        blk = (rng.choice(live, size=k) if live.size and rng.random() < 0.9
               else rng.integers(-1, cfg.num_blocks + 1, size=k))
        d = rng.integers(-2, 3, size=k)
        if rng.random() < 0.05:
          d[0] = np.iinfo(np.int32).max  # overflow
        pad = np.full(T.SMALL_DELTAS + 1, -1)
        a = T.apply_ref_deltas(lean, blk, d)
        b = T.apply_ref_deltas(general, np.concatenate([blk, pad]),
                               np.concatenate([d, np.zeros_like(pad)]))[:k]
      else:
        sa, a = T.cow_split(lean, np.array([row]), atomic=True)
        sb, b = T.cow_split(general, np.array([row, -1]), atomic=True)
        np.testing.assert_array_equal(sa, sb[:1], err_msg=what)
        b = b[:1]
      np.testing.assert_array_equal(a, b, err_msg=what)
      _same(self, lean, general, what)
      applied += int(np.all(a == 0))
      h = lean
      if shortened is not None and np.all(a == 0) and rng.random() < 0.8:
        T.release(h, np.array([shortened]), atomic=True)  # the tail may be the row's alone now
      h.log.reset(h)
    self.assertGreater(applied, 100)  # most calls applied something


class DecodeBatchTest(parameterized.TestCase):
  """The non-atomic reservation's short path for one-token rows (`_decode_fast`)
  against the general path, on batches a decode step makes: many rows, padding,
  full tails, shared tails, and pools with fewer free blocks than rows need."""

  @parameterized.parameters(0, 1, 2)
  def test_decode_batches_equal_the_general_path(self, seed):
    cfg = PoolConfig(num_blocks=(20, 28, 64)[seed], block_size=4, num_layers=1,
                     num_kv_heads=1, head_dim=2, max_seqs=12, max_segments=5)
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    fast = 0
    for step in range(200):
      inactive, live = np.flatnonzero(~h.active), np.flatnonzero(h.active)
      if inactive.size and (live.size < 4 or rng.random() < 0.3):
        src = int(rng.choice(live)) if live.size and rng.random() < 0.5 else None
        segs = (np.stack([h.block[src, :h.num_segments[src]], h.start[src, :h.num_segments[src]],
                          h.length[src, :h.num_segments[src]]])[:, None, :]
                if src is not None and h.num_segments[src] else np.zeros((3, 1, 1), np.int64))
        T.open_rows(h, inactive[:1], *segs, np.array([segs.shape[2] if src is not None else 0]))
      if live.size and rng.random() < 0.15:
        T.release(h, np.array([int(rng.choice(live))]), atomic=True)
      live = np.flatnonzero(h.active)
      ids = np.concatenate([live, np.full(int(rng.integers(T.DECODE_FAST_MIN, 14)), -1)])
      ids = rng.permutation(ids)
      cnt = np.where(rng.random(ids.size) < 0.95, 1, rng.integers(0, 6, ids.size))
      lean, general = copy.deepcopy(h), copy.deepcopy(h)
      a = T.reserve(lean, ids, cnt, max_new_tokens=8, atomic=False)
      general_path = T._reserve  # pylint: disable=protected-access
      b = general_path(general, ids, cnt, max_new_tokens=8, atomic=False)
      what = f"seed {seed} step {step}"
      np.testing.assert_array_equal(a[0], b[0], err_msg=what)
      np.testing.assert_array_equal(a[1], b[1], err_msg=what)
      _same(self, lean, general, what)
      fast += int(np.all(cnt[ids >= 0] == 1))
      h = lean
      h.log.reset(h)
    self.assertGreater(fast, 50)


if __name__ == "__main__":
  absltest.main()


class ReserveRowsTest(parameterized.TestCase):
  """The row-at-a-time path of a non-atomic reservation (`_reserve_rows`, what the
  rows a decode step's short path leaves take: prompt chunks, rows needing blocks)
  against the general path: many tokens per row, repeated, inactive and
  out-of-range rows, full tables and too few free blocks for every row."""

  @parameterized.parameters(0, 1, 2)
  def test_rows_equal_the_general_path(self, seed):
    cfg = PoolConfig(num_blocks=(16, 24, 28)[seed], block_size=4, num_layers=1,
                     num_kv_heads=1, head_dim=2, max_seqs=10, max_segments=5,
                     base_pool_fraction=0.2 * (seed == 1))
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    applied = refused = 0
    for step in range(300):
      inactive, live = np.flatnonzero(~h.active), np.flatnonzero(h.active)
      if inactive.size and (live.size < 5 or rng.random() < 0.3):
        src = int(rng.choice(live)) if live.size and rng.random() < 0.6 else None
        k = int(rng.integers(0, h.num_segments[src] + 1)) if src is not None else 0
        segs = (np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]])[:, None, :]
                if k else np.zeros((3, 1, 1), np.int64))
        T.open_rows(h, inactive[:1], *segs, np.array([k]))
      if live.size and rng.random() < 0.2:
        T.release(h, np.array([int(rng.choice(live))]), atomic=True)
      live = np.flatnonzero(h.active)
      k = int(rng.integers(1, T.SMALL_RESERVE + 1))
      ids = rng.choice(np.concatenate([live, [-1]]), size=k)
      if rng.random() < 0.2:
        ids[0] = rng.integers(-1, cfg.max_seqs + 1)  # inactive or out of range
      cnt = rng.integers(-1 if rng.random() < 0.05 else 0, 14, size=k)
      lean, general = copy.deepcopy(h), copy.deepcopy(h)
      a_slots, a_status = T._reserve_rows(lean, ids.tolist(), cnt.tolist(), 12)  # pylint: disable=protected-access
      b_slots, b_status = T._reserve(general, ids, cnt, max_new_tokens=12, atomic=False)  # pylint: disable=protected-access
      what = f"seed {seed} step {step}"
      np.testing.assert_array_equal(a_slots, b_slots, err_msg=what)
      np.testing.assert_array_equal(np.asarray(a_status, np.int32), b_status, err_msg=what)
      if general.step != h.step:  # the general path moves the clock itself
        lean.step += 1
      _same(self, lean, general, what)
      applied += int(np.any((b_status == 0) & (cnt > 0) & (ids >= 0)))
      refused += int(np.any(b_status == int(Status.NO_FREE_BLOCK)))
      h = lean
      h.log.reset(h)
    self.assertGreater(applied, 60)
    self.assertGreater(refused, 5)

  def test_a_decode_step_with_chunks_takes_the_short_paths(self):
    """Decode rows (in place or into a fresh block) before prompt chunks: the decode
    rows are applied by `_decode_fast`, the chunks row by row; the general path is
    not called, and the result is the general path's."""
    cfg = PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=16, max_segments=8)
    h = HostState.empty(cfg)
    T.open_rows(h, np.arange(16), np.zeros((16, 1), np.int64), np.zeros((16, 1), np.int64),
                np.zeros((16, 1), np.int64), np.zeros(16, np.int64))
    T.reserve(h, np.arange(16), np.array([4] * 6 + [2] * 6 + [0] * 4), max_new_tokens=4,
              atomic=False)
    h.log.reset(h)
    ids = np.arange(16)
    cnt = np.array([1] * 12 + [3, 7, 0, 5])  # 6 fresh-block decodes, 6 in place, chunks
    general = copy.deepcopy(h)
    calls = []
    real = T._reserve  # pylint: disable=protected-access
    T._reserve = lambda *a, **k: calls.append(1) or real(*a, **k)  # pylint: disable=protected-access
    try:
      a = T.reserve(h, ids, cnt, max_new_tokens=8, atomic=False)
    finally:
      T._reserve = real  # pylint: disable=protected-access
    b = real(general, ids, cnt, max_new_tokens=8, atomic=False)
    self.assertEqual(calls, [])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    _same(self, h, general, "decode step with chunks")
