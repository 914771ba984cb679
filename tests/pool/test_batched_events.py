"""A step's opens and releases in one mirror pass against one row at a time.

`open_row.held_counts_many` / `open_many_held` (the rows a step admits, opened
together) and `HostState.release_rows` (the rows a step finishes, released
together with the cache's reference changes) on random host-only states where a
holder outside the tables (a cache, via `apply_ref_deltas`) holds some rows'
segments. Each batched call is compared with the one-row calls it replaces
(`held_counts` + `open_held` per row; `apply_ref_deltas` then `release_row`
per row): the same refusals, the same mirror and the same change log.
"""

from __future__ import annotations

import copy

import numpy as np
from absl.testing import absltest, parameterized

from paged_kv.core.config import PoolConfig
from paged_kv.pool import open_row
from paged_kv.pool import host_transitions as T
from paged_kv.pool.host_state import HostState
from tests.pool.test_one_row import _same


class _World:
  """A random mirror with rows and an outside holder of some rows' segments."""

  def __init__(self, cfg: PoolConfig, seed: int):
    self.cfg, self.rng = cfg, np.random.default_rng(seed)
    self.h = HostState.empty(cfg)
    self.held: list[np.ndarray] = []

  def churn(self) -> None:
    """One random change: a row opened and grown, the holder taking or dropping a
    row's segments, a row released."""
    h, rng, bs = self.h, self.rng, self.cfg.block_size
    act = np.flatnonzero(h.active)
    r = rng.random()
    if r < 0.3 and (~h.active).any():
      row = int(np.flatnonzero(~h.active)[0])
      T.open_rows(h, np.array([row]), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)),
                  np.array([0]))
      T.reserve(h, np.array([row]), np.array([int(rng.integers(1, 3 * bs))]),
                max_new_tokens=4 * bs, atomic=True)
    elif r < 0.6 and act.size:
      src = int(rng.choice(act))
      k = int(h.num_segments[src])
      segs = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]], 1)
      if k and T.apply_ref_deltas(h, *np.unique(segs[:, 0], return_counts=True))[0] == 0:
        self.held.append(segs.astype(np.int32))
    elif r < 0.85 and act.size:
      T.release(h, np.array([int(rng.choice(act))]), atomic=True)
    elif self.held:
      segs = self.held.pop(int(self.rng.integers(len(self.held))))
      T.apply_ref_deltas(h, *np.unique(segs[:, 0], return_counts=True) * np.array([[1], [-1]]))

  def segments(self) -> np.ndarray:
    """Segments to open a row on: a held slice (sometimes a block twice, a shorter
    tail, unwritten slots, a block off range or one only the tables hold, too many
    segments), or none."""
    h, rng = self.h, self.rng
    if not self.held or rng.random() < 0.1:
      return np.zeros((0, 3), np.int32)
    segs = self.held[int(rng.integers(len(self.held)))]
    segs = segs[:int(rng.integers(1, segs.shape[0] + 1))].copy()
    if rng.random() < 0.3 and segs[-1, 2] > 1:
      segs[-1, 2] -= int(rng.integers(1, segs[-1, 2]))
    if rng.random() < 0.15:
      segs = np.concatenate([segs, segs[:1]])
    if rng.random() < 0.05:
      segs[0, 2] += 1
    if rng.random() < 0.03:
      segs[-1, 0] = int(rng.choice([-1, self.cfg.num_blocks]))  # off range
    if rng.random() < 0.03:  # more segments than a row holds
      segs = np.concatenate([segs] * (self.cfg.max_segments // segs.shape[0] + 1))
    act = np.flatnonzero(h.active)
    if rng.random() < 0.03 and act.size:
      src = int(rng.choice(act))
      k = int(h.num_segments[src])
      if k:
        segs = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]], 1)
    return np.ascontiguousarray(segs, np.int32)


_CONFIGS = [dict(num_blocks=40, block_size=4, max_segments=8),
            dict(num_blocks=64, block_size=16, max_segments=8, base_pool_fraction=0.25,
                 scrub_freed_blocks=True),
            dict(num_blocks=200, block_size=8, max_segments=64)]


def _config(i: int) -> PoolConfig:
  return PoolConfig(num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=8, **_CONFIGS[i])


class BatchedEventsTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_opens_together_equal_opens_in_turn(self, i):
    w = _World(_config(i), i)
    opened = refused = shared = 0
    for step in range(600):
      w.churn()
      h = w.h
      free = np.flatnonzero(~h.active)
      if free.size < 2 or w.rng.random() < 0.5:
        continue
      what = f"config {i} step {step}"
      segs = [w.segments() for _ in range(int(w.rng.integers(2, min(free.size, 4) + 1)))]
      rows = free[:len(segs)]
      alone = [x.shape[0] == 0 or open_row.held_counts(h, x) is not None for x in segs]
      counts = open_row.held_counts_many(h, segs)
      self.assertEqual(counts is not None, all(alone), what)
      if counts is None:
        refused += 1
        continue
      h.log.reset(h)
      together, in_turn = copy.deepcopy(h), copy.deepcopy(h)
      open_row.open_many_held(together, rows, segs, *counts)
      for row, x in zip(rows.tolist(), segs):
        if x.shape[0]:
          self.assertFalse(open_row.open_held(in_turn, row, x, *open_row.held_counts(in_turn, x),
                                              copy_tail=False), what)
        else:
          self.assertEqual(int(T.open_rows(in_turn, np.array([row]), np.zeros((1, 1)),
                                           np.zeros((1, 1)), np.zeros((1, 1)),
                                           np.array([0]))[0]), 0, what)
      _same(self, together, in_turn, what)
      blocks = np.concatenate([x[:, 0] for x in segs])
      shared += int(np.unique(blocks).size < blocks.size)
      opened += 1
      w.h = together
    self.assertGreater(opened, 20)
    self.assertGreater(refused, 1)
    self.assertGreater(shared, 5)  # rows sharing a block (the counts summed across rows)

  @parameterized.parameters(0, 1, 2)
  def test_release_together_equals_deltas_then_releases(self, i):
    w = _World(_config(i), 10 + i)
    released = freed = 0
    for step in range(600):
      w.churn()
      h = w.h
      act = np.flatnonzero(h.active)
      if act.size < 1 or w.rng.random() < 0.5:
        continue
      what = f"config {i} step {step}"
      rows = w.rng.choice(act, size=int(w.rng.integers(1, min(act.size, 4) + 1)), replace=False)
      # The cache's changes: increfs of the rows' own blocks (an insert), decrefs of
      # blocks it holds (a rebind), distinct blocks, every change valid.
      used = np.concatenate([h.block[r, :h.num_segments[r]] for r in rows]).astype(np.int64)
      cand = np.unique(np.concatenate([used, np.flatnonzero(h.ref_count > h.table_refs)]))
      blocks = w.rng.permutation(cand)[:int(w.rng.integers(0, cand.size + 1))]
      room = h.ref_count[blocks].astype(np.int64) - h.table_refs[blocks]
      deltas = np.where((room > 0) & (w.rng.random(blocks.size) < 0.4), -room,
                        w.rng.integers(1, 3, blocks.size)).astype(np.int64)
      if w.rng.random() < 0.2:  # no change on a block (a free one, or a held one)
        extra = np.setdiff1d(np.flatnonzero(h.ref_count == 0), blocks)[:1]
        if w.rng.random() < 0.5 and blocks.size:
          deltas[0] = 0
        blocks, deltas = np.concatenate([blocks, extra]), np.concatenate([deltas, extra * 0])
      if blocks.size:
        self.assertIsNotNone(T._apply_ref_deltas_fast(h, blocks, deltas, apply=False), what)
      h.log.reset(h)
      together, in_turn = copy.deepcopy(h), copy.deepcopy(h)
      out = together.release_rows(rows.astype(np.int64), blocks, deltas)
      if blocks.size:
        in_turn.change_refs(blocks, deltas)
      for r in rows.tolist():
        in_turn.release_row(r)
      _same(self, together, in_turn, what)
      np.testing.assert_array_equal(np.sort(out), np.flatnonzero((h.ref_count > 0)
                                                                 & (together.ref_count == 0)),
                                    err_msg=what)
      freed += int(out.size > 0)
      released += 1
      w.h = together
    self.assertGreater(released, 50)
    self.assertGreater(freed, 10)

  def test_release_with_refs_takes_the_one_pass(self):
    # What a step's finishing rows hand the pool: one `release_rows` for all of them.
    w = _World(_config(2), 5)
    for _ in range(200):
      w.churn()
    h = w.h
    rows = np.flatnonzero(h.active)[:3].astype(np.int64)
    self.assertGreaterEqual(rows.size, 2)
    calls = []
    one = h.release_rows
    h.release_rows = lambda *a: calls.append(a[0].tolist()) or one(*a)
    h.release_row = lambda r: self.fail("a row released alone")
    b = np.unique(h.block[rows[0], :h.num_segments[rows[0]]]).astype(np.int64)
    rs, refs = T.release_with_refs(h, rows, b, np.ones(b.size, np.int64))
    self.assertFalse(rs.any() or refs.any())
    self.assertEqual(calls, [rows.tolist()])
    self.assertFalse(h.active[rows].any())


if __name__ == "__main__":
  absltest.main()
