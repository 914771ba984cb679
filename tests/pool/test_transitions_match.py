"""The host mirror's transitions against the device's, on random operation sequences.

Two pools start equal: a device state driven by the jitted transitions of
`paged_kv.core` and a `HostState` driven by `paged_kv.pool.host_transitions`, plus a
third device state that receives only the mirror's commits. After every
operation the statuses and results must be equal and the mirror must equal the
device bit for bit (every bookkeeping array but `last_use`); after every flush
the committed state must equal the mirror, no commit may report a mismatch, and
the K/V of every handed-out slot of a live block must equal the device's (all
pages, when the pool scrubs freed blocks). Operations: opens on shared prefixes
(some on unwritten slots), reserves (atomic or not), releases, reference deltas
(some invalid), releases with deltas, forks, tail copies, compaction moves and
promotions, with invalid rows mixed in.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

from paged_kv.core import alloc, compact, regions, sequences, slots
from paged_kv.core.commit import commit
from paged_kv.core.config import PoolConfig
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC, KVPages, init_pool
from paged_kv.pool import host_transitions as T
from paged_kv.pool.free_index import HostFreeIndex
from paged_kv.pool.host_state import HostState
from paged_kv.core.state import build_free_index
from paged_kv.telemetry.metrics import largest_free_run

pytestmark = pytest.mark.slow

SEEDS = int(os.environ.get("PAGED_KV_MIRROR_SEEDS", "1"))
STEPS = int(os.environ.get("PAGED_KV_MIRROR_STEPS", "100"))
OPS = ("open", "reserve", "decode", "release", "deltas", "rwr", "fork", "cow", "compact",
       "promote")
WEIGHTS = (.15, .2, .1, .1, .1, .07, .08, .1, .05, .05)


class _Run:
  """One random run: device `D` (transitions), mirror `H`, committed device `C`."""

  def __init__(self, seed: int, scrub: bool, base: float):
    self.cfg = cfg = PoolConfig(num_blocks=48, block_size=4, num_layers=1, num_kv_heads=1,
                                head_dim=2, max_seqs=8, max_segments=8, base_pool_fraction=base,
                                scrub_freed_blocks=scrub)
    self.rng = rng = np.random.default_rng(seed)
    d = init_pool(cfg)
    shape = d.pages.k.shape
    pages = KVPages(k=jnp.asarray(rng.normal(size=shape), jnp.float32),
                    v=jnp.asarray(rng.normal(size=shape), jnp.float32))
    self.D = dataclasses.replace(d, pages=pages)
    self.C = jax.tree.map(lambda x: x.copy(), self.D)
    self.H = HostState.empty(cfg)
    self.step = 0

  def rows(self, k: int, active: bool | None = None) -> np.ndarray:
    s = self.cfg.max_seqs
    if self.rng.random() < 0.1:  # invalid or repeated rows now and then
      return np.array([self.rng.integers(-1, s + 1) for _ in range(k)])
    pool = np.arange(s) if active is None else np.flatnonzero(self.H.active == active)
    if not len(pool):
      return np.full(k, -1)
    return self.rng.choice(pool, size=min(k, len(pool)), replace=False)

  def flush(self) -> None:
    H, cfg = self.H, self.cfg
    for batch in H.log.batches(H):
      self.C, mismatch = commit(self.C, batch, config=cfg)
      assert int(mismatch) == 0, (self.step, "commit mismatch", int(mismatch))
    H.log.reset(H)
    assert not H.differences(self.C), (self.step, "commit", H.differences(self.C))
    for name in ("k", "v"):
      a = np.asarray(getattr(self.D.pages, name))
      b = np.asarray(getattr(self.C.pages, name))
      if cfg.scrub_freed_blocks:
        np.testing.assert_array_equal(a, b, err_msg=f"step {self.step}: pages (scrub)")
      else:
        live = T.slot_bits(H.slots, cfg.block_size) & (H.ref_count > 0)[:, None]
        np.testing.assert_array_equal(a[:, :, live], b[:, :, live],
                                      err_msg=f"step {self.step}: live slots")

  def op(self, name: str):
    rng, cfg, H = self.rng, self.cfg, self.H
    s = cfg.max_seqs
    if name == "open":
      ids = self.rows(int(rng.integers(1, 3)), active=False)
      b, p = len(ids), 4
      grid = np.zeros((3, b, p), np.int32)
      nums = np.zeros(b, np.int32)
      live = np.flatnonzero(H.active)
      for i in range(b):
        if len(live) and rng.random() < 0.6:
          src = rng.choice(live)
          k = int(rng.integers(0, min(int(H.num_segments[src]), p) + 1))
          grid[:, i, :k] = np.stack([H.block[src, :k], H.start[src, :k], H.length[src, :k]])
          nums[i] = k
          if rng.random() < 0.05 and k:
            grid[2, i, 0] += 2  # onto unwritten slots
      self.D, st = sequences.open_sequence(self.D, ids.astype(np.int32), grid[0], grid[1],
                                          grid[2], nums, config=cfg, atomic=True)
      return st, T.open_rows(H, ids.astype(np.int64), grid[0], grid[1], grid[2],
                             nums.astype(np.int64))
    if name == "reserve":
      ids = self.rows(int(rng.integers(1, 4)), active=True)
      cnt = rng.integers(0, 9, size=len(ids))
      atomic = bool(rng.random() < 0.5)
      self.D, (si, st) = sequences.reserve_tokens(self.D, ids.astype(np.int32),
                                                 cnt.astype(np.int32), config=cfg,
                                                 max_new_tokens=8, atomic=atomic)
      hsi, hs = T.reserve(H, ids, cnt, max_new_tokens=8, atomic=atomic)
      np.testing.assert_array_equal(np.asarray(si), hsi, err_msg=f"step {self.step}: slots")
      return st, hs
    if name == "decode":  # a step's prediction: many rows, one token each, not atomic
      live = np.flatnonzero(H.active)
      ids = np.concatenate([live, np.full(int(rng.integers(T.DECODE_FAST_MIN + 1, 16)), -1)])
      if rng.random() < 0.2 and live.size:  # a repeated row
        ids[-1] = rng.choice(live)
      if rng.random() < 0.1:  # an inactive or out-of-range row
        ids[-2] = rng.integers(-1, s + 1)
      ids = rng.permutation(ids)
      cnt = np.where(rng.random(ids.size) < 0.85, 1, rng.integers(0, 3, ids.size))
      self.D, (si, st) = sequences.reserve_tokens(self.D, ids.astype(np.int32),
                                                 cnt.astype(np.int32), config=cfg,
                                                 max_new_tokens=2, atomic=False)
      hsi, hs = T.reserve(H, ids, cnt, max_new_tokens=2, atomic=False)
      np.testing.assert_array_equal(np.asarray(si), hsi, err_msg=f"step {self.step}: slots")
      return st, hs
    if name == "release":
      ids = self.rows(int(rng.integers(1, 3)), active=True)
      self.D, st = sequences.release(self.D, ids.astype(np.int32), config=cfg, atomic=True)
      return st, T.release(H, ids, atomic=True)
    if name in ("deltas", "rwr"):
      live = np.flatnonzero(H.ref_count > 0)
      k = int(rng.integers(1, 4))
      blk = rng.choice(live, size=k) if len(live) else rng.integers(0, cfg.num_blocks, size=k)
      d = rng.integers(-2, 3, size=k)
      if rng.random() < 0.1:
        blk[0] = -1
      if name == "deltas":
        self.D, st = alloc.apply_ref_deltas(self.D, blk.astype(np.int32), d.astype(np.int32),
                                            config=cfg)
        return st, T.apply_ref_deltas(H, blk, d)
      ids = self.rows(int(rng.integers(1, 3)), active=True)
      self.D, (st, rs) = sequences.release_with_refs(self.D, ids.astype(np.int32),
                                                    blk.astype(np.int32), d.astype(np.int32),
                                                    config=cfg)
      hs, hrs = T.release_with_refs(H, ids, blk, d)
      np.testing.assert_array_equal(np.asarray(rs), hrs)
      return st, hs
    if name == "fork":
      src, dst = self.rows(1, active=True), self.rows(1, active=False)
      self.D, st = sequences.fork(self.D, src.astype(np.int32), dst.astype(np.int32), config=cfg,
                                 atomic=True)
      return st, T.fork(H, src, dst)
    if name == "cow":
      ids = self.rows(int(rng.integers(1, 4)), active=True)
      atomic = bool(rng.random() < 0.5)
      tails = H.block[np.clip(ids, 0, s - 1)].reshape(-1)
      if H.log.page_conflict(tails, H.log.free_page_dsts(H)):
        self.flush()
      self.D, (sp, st) = slots.cow_split(self.D, ids.astype(np.int32), config=cfg, atomic=atomic)
      hsp, hs = T.cow_split(H, ids, atomic=atomic)
      np.testing.assert_array_equal(np.asarray(sp), hsp)
      return st, hs
    if name == "compact":
      src, dst = T.plan_compaction(H, budget=4)
      dsrc, ddst = compact.plan_compaction(self.D.meta, budget=4)
      np.testing.assert_array_equal(src, np.asarray(dsrc))
      np.testing.assert_array_equal(dst, np.asarray(ddst))
      if H.log.page_conflict(src[src >= 0], dst[dst >= 0], moves=True):
        self.flush()
      self.D, (remap, st) = compact.compact_permute(self.D, src, dst, config=cfg)
      s_, d_, hs = T.move_blocks(H, src, dst, dst_region=REGION_DYNAMIC)
      np.testing.assert_array_equal(np.asarray(remap), T.remap_of(cfg.num_blocks, s_, d_))
      return st, hs
    assert name == "promote"
    src, dst = T.plan_promotion(H, 2, max_moves=4)
    dsrc, ddst = regions.plan_promotion(self.D.meta, 2, max_moves=4)
    np.testing.assert_array_equal(src, np.asarray(dsrc))
    np.testing.assert_array_equal(dst, np.asarray(ddst))
    if H.log.page_conflict(src[src >= 0], dst[dst >= 0], moves=True):
      self.flush()
    self.D, (remap, st) = regions.promote_blocks(self.D, src, dst, config=cfg)
    _, _, hs = T.move_blocks(H, src, dst, dst_region=REGION_BASE)
    return st, hs

  def run(self, steps: int) -> dict[str, int]:
    applied = {}
    for self.step in range(steps):
      name = str(self.rng.choice(OPS, p=WEIGHTS))
      st, hs = self.op(name)
      np.testing.assert_array_equal(np.asarray(st), hs, err_msg=f"step {self.step}: {name}")
      applied[name] = applied.get(name, 0) + int(np.all(hs == 0))
      diff = self.H.differences(self.D)
      assert not diff, (self.step, name, diff)
      if self.rng.random() < 0.3:
        self.flush()
    self.flush()
    return applied


class TransitionsMatchTest(parameterized.TestCase):

  @parameterized.product(scrub=(False, True), base=(0.0, 0.25))
  def test_random_operations(self, scrub, base):
    for seed in range(SEEDS):
      applied = _Run(seed + 100 * scrub + int(40 * base), scrub, base).run(STEPS)
      # The run exercised the transitions: most calls applied, the common ones each.
      self.assertGreater(sum(applied.values()), STEPS // 4, applied)
      for name in ("reserve", "decode", "release", "cow"):
        self.assertGreater(applied.get(name, 0), 0, (name, applied))


# The other configurations; `make test` keeps the first. absl generates one test per
# configuration, so they are marked by their generated names.
pytest.mark.long(TransitionsMatchTest.test_random_operations1)
pytest.mark.long(TransitionsMatchTest.test_random_operations2)
pytest.mark.long(TransitionsMatchTest.test_random_operations3)


class ChangeLogTest(absltest.TestCase):

  def test_a_window_never_holds_more_copies_than_a_commit(self):
    """Copies of rows reopened on cached tails can pile up in one window (no conflict
    between them): past `max_seqs` the log asks for a flush first."""
    cfg = PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=4, max_segments=8)
    h = HostState.empty(cfg)
    h.copy_slots([1, 2, 3], [0, 0, 0], [10, 11, 12], [0, 0, 0], [2, 2, 2])
    self.assertFalse(h.log.page_conflict([4], [13], copies=1))
    self.assertTrue(h.log.page_conflict([4, 5], [13, 14], copies=2))
    self.assertTrue(h.log.page_conflict([10], [13], copies=1))  # reads a block written


class CommitTest(absltest.TestCase):

  def test_a_mismatched_commit_applies_nothing(self):
    """A commit that finds the device differing from the host's expectations (a wrong
    prediction, a host bug) leaves the device as it was, pages included: the host
    reloads a sound state instead of a mix of the two pictures."""
    cfg = PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                     max_seqs=4, max_segments=8, scrub_freed_blocks=True)
    rng = np.random.default_rng(0)
    d = init_pool(cfg)
    shape = d.pages.k.shape
    state = dataclasses.replace(d, pages=KVPages(
        k=jnp.asarray(rng.normal(size=shape), jnp.float32),
        v=jnp.asarray(rng.normal(size=shape), jnp.float32)))
    h = HostState.empty(cfg)

    def flush(state):
      mismatches = []
      for batch in h.log.batches(h):
        state, mismatch = commit(state, batch, config=cfg)
        mismatches.append(int(mismatch))
      h.log.reset(h)
      return state, mismatches

    T.open_rows(h, np.arange(3), *np.zeros((3, 3, 1), np.int64), np.zeros(3, np.int64))
    T.reserve(h, np.arange(3), np.array([9, 9, 9]), max_new_tokens=16, atomic=True)
    state, mismatches = flush(state)
    self.assertEqual(mismatches, [0])
    T.release(h, np.array([0]), atomic=True)
    state, _ = flush(state)
    # A window with block moves, a reservation and a freed row.
    src, dst = T.plan_compaction(h, budget=4)
    self.assertGreater(int((src >= 0).sum()), 0)
    T.move_blocks(h, src, dst, dst_region=REGION_DYNAMIC)
    T.reserve(h, np.array([1]), np.array([5]), max_new_tokens=16, atomic=True)
    T.release(h, np.array([2]), atomic=True)
    # The device holds one more token on row 1 than the host believes.
    table = dataclasses.replace(state.table, seq_len=state.table.seq_len.at[1].add(1))
    state = dataclasses.replace(state, table=table)
    before = jax.tree.map(np.array, state)
    state, mismatches = flush(state)
    self.assertTrue(any(m & 2 for m in mismatches), mismatches)
    after = jax.tree.map(np.array, state)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(before),
                          jax.tree.leaves(before), jax.tree.leaves(after)):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path[0]))


class FreeIndexTest(parameterized.TestCase):

  @parameterized.parameters(1, 31, 33, 1024, 1025, 40_000, 70_000)
  def test_same_arrays_and_queries_as_the_device(self, n):
    rng = np.random.default_rng(n)
    for p in (0.0, 0.1, 0.5, 1.0):
      free = rng.random(n) < p
      h = HostFreeIndex.from_mask(free)
      bits, counts = build_free_index(jnp.asarray(free))
      np.testing.assert_array_equal(h.bits, np.asarray(bits))
      np.testing.assert_array_equal(h.counts, np.asarray(counts))
      k = int(free.sum())
      for kk in sorted({0, min(1, k), k // 2, k}):
        np.testing.assert_array_equal(h.lowest(kk), np.flatnonzero(free)[:kk])
      self.assertEqual(h.largest_run(), largest_free_run(free))
      take = h.lowest(min(3, k))
      h.mark(take, -1)
      free[take] = False
      again = HostFreeIndex.from_mask(free)
      np.testing.assert_array_equal(h.bits, again.bits)
      np.testing.assert_array_equal(h.counts, again.counts)
      self.assertEqual(h.num_free, again.num_free)

  @parameterized.parameters(1, 33, 1000, 5000, 70_000)
  def test_largest_run_follows_the_marks(self, n):
    rng = np.random.default_rng(n + 1)
    free = rng.random(n) < 0.5
    h = HostFreeIndex.from_mask(free)
    self.assertEqual(h.largest_run(), largest_free_run(free))
    for _ in range(30):
      k = int(rng.integers(1, 40))
      if rng.random() < 0.5 and free.any():
        b = rng.choice(np.flatnonzero(free), size=min(k, int(free.sum())), replace=False)
        h.mark(b, -1)
        free[b] = False
      elif (~free).any():
        start = int(rng.integers(0, n))  # free a whole stretch: runs across words
        b = np.flatnonzero(~free[start:start + 5 * k]) + start
        h.mark(b, +1)
        free[b] = True
      self.assertEqual(h.largest_run(), largest_free_run(free))

  @parameterized.parameters(33, 1025, 40_000, 1 << 20)
  def test_the_lowest_free_block_alone(self, n):
    # `lowest(1)` descends the count levels: one free block anywhere, and sparse masks.
    rng = np.random.default_rng(n)
    for where in [0, n - 1, *rng.integers(0, n, 6).tolist()]:
      free = np.zeros(n, bool)
      free[where] = True
      np.testing.assert_array_equal(HostFreeIndex.from_mask(free).lowest(1), [where])
    for p in (1e-4, 1e-2):
      free = rng.random(n) < p
      free[-1] = True
      np.testing.assert_array_equal(HostFreeIndex.from_mask(free).lowest(1),
                                    np.flatnonzero(free)[:1])

  def test_asking_for_more_than_free_is_an_error(self):
    h = HostFreeIndex.from_mask(np.array([True, False, True]))
    with self.assertRaises(ValueError):
      h.lowest(3)


if __name__ == "__main__":
  absltest.main()
