"""`open_row.held_counts` / `open_held` against `transitions`' one-row open (+ tail copy).

Random host-only states where a holder outside the tables (a cache, via
`apply_ref_deltas`) holds some rows' segments; each call opens a row on a slice
of such segments (sometimes with a block repeated, a shortened tail, a segment
on unwritten slots, a block out of range or only the tables hold) and compares:
`held_counts` refuses exactly when the held check or the open's own checks
refuse, and `open_held` leaves the same mirror and change log as `open_rows` (or
`open_one_copying_tail` with `copy_tail`).
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


def _held_before(h: HostState, segs: np.ndarray) -> bool:
  """The checks `held_counts` stands for, as separate calls."""
  blk = segs[:, 0].astype(np.int64)
  if segs.shape[0] > h.config.max_segments or blk.min() < 0 or blk.max() >= h.config.num_blocks:
    return False
  if (h.ref_count[blk] <= h.table_refs[blk]).any():
    return False
  return T.open_segments_status(h, blk, segs[:, 1], segs[:, 2]) == 0


class OpenRowTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2, 3)
  def test_equals_the_transitions(self, seed):
    cfg = PoolConfig(num_blocks=(24, 40, 64, 14)[seed], block_size=(4, 8, 16, 64)[seed],
                     num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=6, max_segments=8,
                     base_pool_fraction=0.25 * (seed == 2), scrub_freed_blocks=bool(seed % 2))
    h = HostState.empty(cfg)
    rng = np.random.default_rng(seed)
    bs = cfg.block_size
    held: list[np.ndarray] = []  # segments an outside holder took references on
    opened = refused = copied_any = 0
    for step in range(1200):
      what = f"seed {seed} step {step}"
      act = np.flatnonzero(h.active)
      r = rng.random()
      if r < 0.35 and (~h.active).any():  # a fresh row with some tokens
        row = int(np.flatnonzero(~h.active)[0])
        T.open_rows(h, np.array([row]), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)),
                    np.array([0]))
        T.reserve(h, np.array([row]), np.array([int(rng.integers(1, 3 * bs))]),
                  max_new_tokens=4 * bs, atomic=True)
        continue
      if r < 0.5 and act.size:  # the holder takes a row's segments
        src = int(rng.choice(act))
        k = int(h.num_segments[src])
        segs = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]], 1)
        if k and T.apply_ref_deltas(h, *np.unique(segs[:, 0], return_counts=True))[0] == 0:
          held.append(segs.astype(np.int32))
        continue
      if r < 0.6 and act.size:
        T.release(h, np.array([int(rng.choice(act))]), atomic=True)
        continue
      if r < 0.65 and held:  # the holder lets go
        segs = held.pop(int(rng.integers(len(held))))
        T.apply_ref_deltas(h, *np.unique(segs[:, 0], return_counts=True) * np.array([[1], [-1]]))
        continue
      if not held or h.active.all():
        continue
      segs = held[int(rng.integers(len(held)))]
      if rng.random() < 0.1 and act.size:  # a live row's own segments: only the tables hold them
        src = int(rng.choice(act))
        k = int(h.num_segments[src])
        segs = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]], 1) if k else segs
      segs = segs[:int(rng.integers(1, segs.shape[0] + 1))].copy()
      if rng.random() < 0.3 and segs[-1, 2] > 1:
        segs[-1, 2] -= int(rng.integers(1, segs[-1, 2]))  # a shorter tail
      if rng.random() < 0.15:
        segs = np.concatenate([segs, segs[:1]])  # a block twice
      if rng.random() < 0.1:
        segs[0, 2] += 1  # onto unwritten slots, or past the block
      if rng.random() < 0.05:
        segs[-1, 0] = int(rng.integers(-1, cfg.num_blocks + 1))  # off range or unheld
      segs = np.ascontiguousarray(segs, np.int32)
      row = int(np.flatnonzero(~h.active)[0])
      copy_tail = bool(rng.random() < 0.6)
      counts = open_row.held_counts(h, segs)
      self.assertEqual(counts is not None, _held_before(h, segs), what)
      if counts is None:
        refused += 1
        continue
      h.log.reset(h)  # the call's touches only
      lean, general = copy.deepcopy(h), copy.deepcopy(h)
      copied = open_row.open_held(lean, row, segs, *counts, copy_tail=copy_tail)
      b = segs.T.astype(np.int64)
      if copy_tail:
        status, want = T.open_one_copying_tail(general, row, *b)
      else:
        status, want = T.open_rows(general, np.array([row]), *b[:, None], np.array([len(segs)])), False
      self.assertEqual(int(np.asarray(status)[0]), 0, what)
      self.assertEqual(copied, want, what)
      _same(self, lean, general, what)
      opened += 1
      copied_any += copied
      h = lean
    self.assertGreater(opened, 20)
    self.assertGreater(refused, 1)
    self.assertGreater(copied_any, 0)


if __name__ == "__main__":
  absltest.main()
