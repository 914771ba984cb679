"""cow_split and pack_slots: data moves bit-identically, references follow, failures are atomic."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

import paged_kv
from paged_kv.core import page_copy, slots
from paged_kv.core.errors import Status
from tests.testutil import KVModel, exhaust, give_back, read_segment, small_config

CONFIG = small_config()

_STATIC = ("config", "atomic", "impl", "interpret")


class CowSplitTest(chex.TestCase):

  def _cow(self, state, ids, config, atomic=False, variant=False):
    fn = (self.variant(slots.cow_split.__wrapped__, static_argnames=_STATIC) if variant
          else slots.cow_split)
    return fn(state, jnp.asarray(ids, jnp.int32), config=config, atomic=atomic)

  @chex.variants(with_jit=True, without_jit=True)
  def test_forked_tail_is_copied_and_appends_continue_in_place(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    a = model.open()
    model.append([a], [10])  # blocks: (b0, 0, 8), (b1, 0, 2)
    child = model.fork(a)
    tail_before = pool.segments(child)[-1, 0]
    pool.state, (split, status) = self._cow(pool.state, [child, -1], config, variant=True)
    np.testing.assert_array_equal(np.asarray(status), [Status.OK, Status.OK])
    np.testing.assert_array_equal(np.asarray(split), [True, False])
    blk, start, length = pool.segments(child).T
    self.assertNotEqual(blk[-1], tail_before)
    self.assertEqual((start[-1], length[-1]), (0, 2))
    self.assertEqual(int(pool.state.meta.ref_count[blk[-1]]), 1)
    model.check()
    # The child now appends in place: no new segment for 2 tokens.
    model.append([child], [2])
    self.assertEqual(len(pool.segments(child)), 2)
    model.check()

  def test_no_split_when_tail_is_already_exclusive_or_full(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    a, b, e = model.open(), model.open(), model.open()
    model.append([a, b], [3, 8])  # a: exclusive partial tail, b: full tail, e: empty
    before = jax.tree.map(np.asarray, pool.state)
    pool.state, (split, status) = self._cow(pool.state, [a, b, e], config)
    np.testing.assert_array_equal(np.asarray(split), [False, False, False])
    np.testing.assert_array_equal(np.asarray(status), [0, 0, 0])
    chex.assert_trees_all_equal(before.table, jax.tree.map(np.asarray, pool.state.table))
    model.check()

  def test_out_of_blocks_is_reported_and_atomic(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    a = model.open()
    model.append([a], [10])
    c = model.fork(a)
    taken = exhaust(pool)
    before = jax.tree.map(np.asarray, pool.state)
    pool.state, (split, status) = self._cow(pool.state, [c, a], config, atomic=True)
    self.assertEqual(int(status[0]), Status.NO_FREE_BLOCK)
    self.assertFalse(np.asarray(split).any())
    chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, pool.state))
    pool.state, (split, status) = self._cow(pool.state, [7, -1], config)  # inactive row
    self.assertEqual(int(status[0]), Status.INVALID_SEQUENCE)
    give_back(pool, taken)
    model.check()


# Only the variant without jit (op by op) is slow; chex generates it from the
# method above, so it is marked by its generated name.
pytest.mark.slow(CowSplitTest.test_forked_tail_is_copied_and_appends_continue_in_place__without_jit)


class PackSlotsTest(chex.TestCase):

  def _pack(self, state, rows, config, atomic=False, impl="xla", interpret=False,
            variant=False):
    rows = list(rows) + [(-1, 0, -1, 0, 0)] * (8 - len(rows))  # one shape: K = 8
    owner, col, blk, start, length = (np.asarray([r[i] for r in rows], np.int32)
                                      for i in range(5))
    fn = (self.variant(slots.pack_slots.__wrapped__, static_argnames=_STATIC) if variant
          else slots.pack_slots)
    return fn(state, owner, col, blk, start, length, config=config, atomic=atomic, impl=impl,
              interpret=interpret)

  def _finished_tails(self, model, lengths):
    """Sequences of the given lengths, each inserted in a 'cache' (extra holder) then released."""
    pool = model.pool
    seqs = [model.open() for _ in lengths]
    model.append(seqs, lengths)
    extras = []
    for s in seqs:
      b, st, ln = pool.segments(s).T
      for seg in zip(b, st, ln):
        extras.append(tuple(int(x) for x in seg))
    pool.apply_ref_deltas([e[0] for e in extras], [1] * len(extras))
    data = [read_segment(pool, e) for e in extras]
    model.release(seqs)
    return extras, data

  @chex.variants(with_jit=True, without_jit=True)
  def test_external_short_segments_share_one_fresh_block(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    extras, data = self._finished_tails(model, [3, 2, 3])  # three blocks, 8/24 slots used
    ext = slots.OWNER_EXTERNAL
    pool.state, (nb, ns, status) = self._pack(
        pool.state, [(ext, 0, *e) for e in extras], config, variant=True)
    np.testing.assert_array_equal(np.asarray(status), [0] * 8)
    nb, ns = np.asarray(nb), np.asarray(ns)
    self.assertEqual(len(set(nb[:3].tolist())), 1)  # all in one block
    self.assertEqual(sorted(ns[:3].tolist()), [0, 3, 5])
    new = [(int(nb[i]), int(ns[i]), extras[i][2]) for i in range(3)]
    for seg, want in zip(new, data):
      np.testing.assert_array_equal(read_segment(pool, seg), want)
    ref = np.asarray(pool.state.meta.ref_count)
    self.assertEqual(int((ref > 0).sum()), 1)
    model.check(extra_segments=new)

  def test_table_segments_go_into_partly_used_blocks_best_fit(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    extras, _ = self._finished_tails(model, [5, 6])  # holes of 3 and 2 slots
    ext = slots.OWNER_EXTERNAL
    live = model.open()
    model.append([live], [10])  # (x, 0, 8), (y, 0, 2): the tail (2 tokens) stays growing
    other = model.open()
    model.append([other], [2])
    seg = pool.segments(other)
    # `other`'s only segment is also its tail; packing it is allowed (a finished tail).
    pool.state, (nb, ns, status) = self._pack(
        pool.state, [(other, 0, *seg[0].tolist())], config)
    self.assertEqual(int(status[0]), Status.OK)
    # Best fit: the 2-slot hole of the 6-token block, not the 3-slot one, not `live`'s tail.
    self.assertEqual((int(nb[0]), int(ns[0])), (extras[1][0], 6))
    model.check(extra_segments=extras)
    del ext

  def test_identical_triples_move_together(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    s = model.open()
    model.append([s], [3])
    seg = tuple(pool.segments(s)[0].tolist())
    pool.apply_ref_deltas([seg[0]], [1])  # a cache node holds the same segment
    ext = slots.OWNER_EXTERNAL
    pool.state, (nb, ns, status) = self._pack(pool.state, [(s, 0, *seg), (ext, 0, *seg)],
                                              config)
    np.testing.assert_array_equal(np.asarray(status), [0] * 8)
    self.assertEqual(int(nb[0]), int(nb[1]))
    self.assertEqual(int(ns[0]), int(ns[1]))
    self.assertEqual(int(pool.state.meta.ref_count[seg[0]]), 0)  # old block freed
    self.assertEqual(int(pool.state.meta.ref_count[int(nb[0])]), 2)
    model.check(extra_segments=[(int(nb[1]), int(ns[1]), 3)])

  def test_invalid_entries_and_atomic_refusal(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    s = model.open()
    model.append([s], [10])
    b, st, ln = pool.segments(s).T
    before = jax.tree.map(np.asarray, pool.state)
    ext = slots.OWNER_EXTERNAL
    rows = [(s, 1, int(b[1]), 0, 2),          # fine
            (s, 0, int(b[0]), 0, 8),          # full-length: not packable
            (s, 1, int(b[1]), 0, 1),          # mismatch with the table
            (ext, 0, 30, 0, 2),               # free block
            (5, 0, int(b[1]), 0, 2),          # inactive row
            (s, 1, int(b[1]), 0, 2)]          # the same table entry twice
    pool.state, (nb, ns, status) = self._pack(pool.state, rows, config, atomic=True)
    np.testing.assert_array_equal(
        np.asarray(status)[:6], [Status.ABORTED, Status.INVALID_SEGMENT, Status.INVALID_SEGMENT,
                             Status.INVALID_BLOCK, Status.INVALID_SEQUENCE,
                             Status.INVALID_SEGMENT])
    self.assertTrue((np.asarray(nb) == -1).all())
    chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, pool.state))
    # Non-atomic: the good entry is applied.
    pool.state, (nb, ns, status) = self._pack(pool.state, rows, config)
    self.assertEqual(int(status[0]), Status.OK)
    model.check()

  def test_no_room_anywhere(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    a, b = model.open(), model.open()
    model.append([a, b], [7, 7])  # both tails of live rows: no destination
    taken = exhaust(pool)
    segs = [tuple(pool.segments(r)[0].tolist()) for r in (a, b)]
    pool.state, (nb, _, status) = self._pack(pool.state, [(a, 0, *segs[0])], config)
    self.assertEqual(int(status[0]), Status.NO_FREE_BLOCK)
    give_back(pool, taken)
    model.check()


# Only the variant without jit (op by op) is slow; chex generates it from the
# method above, so it is marked by its generated name.
pytest.mark.slow(PackSlotsTest.test_external_short_segments_share_one_fresh_block__without_jit)


class HostWrapperTest(absltest.TestCase):

  def test_packing_a_shared_segment_into_a_fresh_block_keeps_the_free_list_exact(self):
    # Regression: nothing frees here (the old block stays shared), so the free list must be
    # rebuilt for the fresh destination block taken from it.
    pool = paged_kv.BlockPool(CONFIG)
    model = KVModel(pool)
    a = model.open()
    model.append([a], [3])
    model.fork(a)
    pool.pack_slots(table_segments=[(a, 0)])
    model.check()

  def test_block_pool_pack_and_cow(self):
    config = CONFIG
    pool = paged_kv.BlockPool(config)
    model = KVModel(pool)
    a = model.open()
    model.append([a], [11])
    c = model.fork(a)
    split = pool.cow_split([c])
    self.assertTrue(split[0])
    model.check()
    res = pool.pack_slots(table_segments=[(a, 1)])
    self.assertEqual(res.table_segments.shape, (1, 5))
    ids, deltas = res.ref_deltas
    self.assertEqual(int(deltas.sum()), 0)
    model.check()
    with self.assertRaises(paged_kv.InvalidSegment):
      pool.pack_slots(table_segments=[(a, 0)])  # a full 8-token segment
    with self.assertRaises(paged_kv.InvalidSequence):
      pool.cow_split([5])
    model.check()


def test_pallas_slot_copy_and_block_move_match_xla():
  rng = np.random.default_rng(1)
  shape = (2, 2, 6, 4, 8)
  host = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
  # The kernels donate their input: build fresh pages for every call.
  pages = lambda: paged_kv.KVPages(k=jnp.asarray(host[0]), v=jnp.asarray(host[1]))
  args = [np.array(x, np.int32) for x in ([0, 1, -1], [1, 0, 0], [3, 3, -1], [0, 2, 0],
                                          [2, 1, 0])]
  want = page_copy.copy_slot_ranges(pages(), *args, impl="xla")
  got = page_copy.copy_slot_ranges(pages(), *args, impl="pallas", interpret=True)
  chex.assert_trees_all_equal(want, got)
  src, dst = np.array([4, 5, -1], np.int32), np.array([0, 2, -1], np.int32)
  want = page_copy.move_pages(pages(), src, dst, impl="xla")
  got = page_copy.move_pages(pages(), src, dst, impl="pallas", interpret=True)
  chex.assert_trees_all_equal(want, got)


def test_unknown_impl_is_rejected():
  pages = paged_kv.KVPages(k=jnp.zeros((1, 1, 2, 4, 1)), v=jnp.zeros((1, 1, 2, 4, 1)))
  z = np.zeros(1, np.int32)
  with pytest.raises(ValueError, match="impl"):
    page_copy.copy_slot_ranges(pages, z, z, z, z, z, impl="cuda")
  with pytest.raises(ValueError, match="impl"):
    page_copy.move_pages(pages, z, z, impl="cuda")




class ReclaimSlotsTest(chex.TestCase):
  """Dead slots of a slotted block become reusable once no segment covers them."""

  def _pool_with_dead_slots(self):
    cfg = paged_kv.PoolConfig(num_blocks=8, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=8)
    pool = paged_kv.BlockPool(cfg)
    a, b = pool.open_sequence(), pool.open_sequence()
    slots_ = pool.reserve_tokens([a, b], [3, 2])
    kv = jnp.arange(slots_.size * 2, dtype=jnp.float32).reshape(slots_.shape + (1, 2))
    pool.write_kv(0, slots_, kv, -kv, seq_ids=[a, b])
    # Cache-like outside holders take both short segments; pack them into one block.
    ext = [tuple(pool.segments(s)[0].tolist()) for s in (a, b)]
    pool.apply_ref_deltas([e[0] for e in ext], [1, 1])
    pool.release([a, b])
    packed = pool.pack_slots(extra_segments=ext).extra_segments
    held = [tuple(int(v) for v in row) for row in packed]
    self.assertEqual(held[0][0], held[1][0])  # one slotted block holds both
    # The first holder lets go: its slots are dead but still marked.
    pool.apply_ref_deltas([held[0][0]], [-1])
    return pool, held[1:], held[0]

  @chex.variants(with_jit=True, without_jit=True)
  def test_reclaims_dead_slots_only(self):
    pool, live, dead = self._pool_with_dead_slots()
    fn = self.variant(slots.reclaim_slots.__wrapped__, static_argnames=("config",))
    ext = np.array(live, np.int32)
    k_live = np.asarray(pool.state.pages.k)[0, 0, live[0][0], live[0][1]:live[0][1] + live[0][2]]
    state, (status, reclaimed) = fn(pool.state, ext[:, 0], ext[:, 1], ext[:, 2],
                                    config=pool.config)
    self.assertEqual(int(status), 0)
    self.assertEqual(int(reclaimed), dead[2])
    pool.state = state
    pool.check_invariants(extra_segments=live)
    bits = slots.slot_bits(state.meta.slots[dead[0]], pool.config.block_size)
    self.assertFalse(bool(bits[dead[1]:dead[1] + dead[2]].any()))
    np.testing.assert_array_equal(
        np.asarray(state.pages.k)[0, 0, live[0][0], live[0][1]:live[0][1] + live[0][2]], k_live)

  @chex.variants(with_jit=True, without_jit=True)
  def test_missing_holder_refused_and_nothing_changes(self):
    pool, live, dead = self._pool_with_dead_slots()
    fn = self.variant(slots.reclaim_slots.__wrapped__, static_argnames=("config",))
    before = jax.tree.map(np.asarray, pool.state)
    z = np.zeros((1,), np.int32)
    state, (status, reclaimed) = fn(pool.state, z, z, z, config=pool.config)  # holder omitted
    self.assertEqual(int(status), Status.INVALID_SEGMENT)
    self.assertEqual(int(reclaimed), 0)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))

  def test_host_api_and_reuse_by_pack(self):
    pool, live, dead = self._pool_with_dead_slots()
    with self.assertRaises(paged_kv.InvalidSegment):
      pool.reclaim_slots([])
    self.assertEqual(pool.reclaim_slots(live), dead[2])
    # A new short segment now fits into the reclaimed slots of the slotted block.
    c = pool.open_sequence()
    pool.reserve_tokens([c], [dead[2]])
    seg = tuple(pool.segments(c)[0].tolist())
    pool.apply_ref_deltas([seg[0]], [1])
    pool.release([c])
    moved = pool.pack_slots(extra_segments=[seg]).extra_segments[0]
    self.assertEqual(int(moved[0]), dead[0])
    pool.check_invariants(extra_segments=live + [tuple(int(v) for v in moved)])


class ConsolidationTest(absltest.TestCase):
  """`plan_consolidation` + `pack_slots` free the sparsest slotted blocks, data intact."""

  def _sparse_pool(self):
    cfg = paged_kv.PoolConfig(num_blocks=16, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=8, max_segments=8)
    pool = paged_kv.BlockPool(cfg)
    held = []
    for wave in range(2):  # two waves of four short segments, each packed into slotted blocks
      seqs = [pool.open_sequence() for _ in range(4)]
      slots_ = pool.reserve_tokens(seqs, [3, 3, 2, 2])
      kv = jnp.arange(slots_.size * 2, dtype=jnp.float32).reshape(slots_.shape + (1, 2))
      kv = kv + 100 * wave
      pool.write_kv(0, slots_, kv, -kv, seq_ids=seqs)
      ext = [tuple(pool.segments(q)[0].tolist()) for q in seqs]
      pool.apply_ref_deltas([e[0] for e in ext], [1] * len(ext))
      pool.release(seqs)
      packed = pool.pack_slots(extra_segments=ext).extra_segments
      held += [tuple(int(v) for v in row) for row in packed]
    # Drop most segments of every slotted block: each keeps one, mostly free slots.
    by_block = {}
    for seg in held:
      by_block.setdefault(seg[0], []).append(seg)
    keep = []
    for blk, segs in by_block.items():
      keep.append(segs[0])
      for seg in segs[1:]:
        pool.apply_ref_deltas([seg[0]], [-1])
    pool.reclaim_slots(keep)
    return pool, keep

  def test_plan_frees_blocks_and_keeps_kv(self):
    pool, keep = self._sparse_pool()
    self.assertGreaterEqual(len({s[0] for s in keep}), 2)
    before = {s: np.asarray(pool.state.pages.k)[0, 0, s[0], s[1]:s[1] + s[2]] for s in keep}
    used0 = int((np.asarray(pool.state.meta.ref_count) > 0).sum())
    meta = jax.tree.map(np.asarray, pool.state.meta)
    arr = np.array(keep, np.int32)
    idx = slots.plan_consolidation(meta.ref_count, meta.slots, meta.region, arr[:, 0], arr[:, 2],
                                   block_size=pool.config.block_size)
    self.assertGreater(idx.size, 0)
    moved = pool.pack_slots(extra_segments=[keep[i] for i in idx]).extra_segments
    new = list(keep)
    for i, row in zip(idx, moved):
      new[i] = tuple(int(v) for v in row)
    pool.check_invariants(extra_segments=new)
    used1 = int((np.asarray(pool.state.meta.ref_count) > 0).sum())
    self.assertLess(used1, used0)
    for old, seg in zip(keep, new):
      np.testing.assert_array_equal(
          np.asarray(pool.state.pages.k)[0, 0, seg[0], seg[1]:seg[1] + seg[2]], before[old])

  def test_only_blocks_fully_held_by_the_caller_and_budget(self):
    pool, keep = self._sparse_pool()
    meta = jax.tree.map(np.asarray, pool.state.meta)
    arr = np.array(keep, np.int32)
    # Without naming the holders, nothing is movable.
    idx = slots.plan_consolidation(meta.ref_count, meta.slots, meta.region, arr[:0, 0],
                                   arr[:0, 2], block_size=pool.config.block_size)
    self.assertEqual(idx.size, 0)
    idx = slots.plan_consolidation(meta.ref_count, meta.slots, meta.region, arr[:, 0], arr[:, 2],
                                   block_size=pool.config.block_size, max_moves=1)
    self.assertLessEqual(idx.size, 1)


_SCRUB_CONFIG = paged_kv.PoolConfig(num_blocks=8, block_size=8, num_layers=1, num_kv_heads=1,
                                    head_dim=2, max_seqs=4, max_segments=8,
                                    scrub_freed_blocks=True)


class ReclaimScrubTest(chex.TestCase):
  """Scrubbing covers slots given up inside a live (slotted) block, not just freed blocks.

  Tenant A's 3-token tail and tenant B's 3-token tail end up in one slotted block
  (B's packed behind A's); a sequence of A keeps the block alive through A's
  segment while B's holder lets go. `reclaim_slots` then hands B's slots back to
  the allocator, and an in-place append of A's sequence reserves them: it must read
  zeros there (before its write), never B's K/V.
  """

  def _slotted_block(self, config):
    pool = paged_kv.BlockPool(config)
    a, b = pool.open_sequence(), pool.open_sequence()
    slot_idx = pool.reserve_tokens([a, b], [3, 3])
    tag = np.zeros(slot_idx.shape + (1, 2), np.float32)
    tag[0, :3], tag[1, :3] = 1.0, 2.0  # tenant A's K/V are 1, tenant B's are 2
    pool.write_kv(0, slot_idx, tag, -tag, seq_ids=[a, b])
    seg_a, seg_b = (tuple(int(x) for x in pool.segments(s)[0]) for s in (a, b))
    pool.apply_ref_deltas([seg_a[0], seg_b[0]], [1, 1])  # two cache-like holders
    pool.release([a, b])
    seg_b = tuple(int(x) for x in pool.pack_slots(extra_segments=[seg_b]).extra_segments[0])
    self.assertEqual((seg_b[0], seg_b[1]), (seg_a[0], 3))  # packed behind A's tail
    c = pool.open_sequence(np.array([seg_a], np.int32))    # A's next request shares it
    pool.apply_ref_deltas([seg_a[0]], [-1])                # A's holder lets go
    pool.apply_ref_deltas([seg_b[0]], [-1])                # B's holder lets go
    return pool, c, seg_a, seg_b

  def test_reclaimed_slots_are_zeroed_before_an_in_place_append_reads_them(self):
    pool, c, seg_a, seg_b = self._slotted_block(_SCRUB_CONFIG)
    self.assertEqual(int(pool.state.meta.ref_count[seg_a[0]]), 1)  # alive: c only
    self.assertEqual(pool.reclaim_slots([]), seg_b[2])
    k = np.asarray(pool.state.pages.k)[0, 0, seg_b[0]]
    v = np.asarray(pool.state.pages.v)[0, 0, seg_b[0]]
    np.testing.assert_array_equal(k[:3], 1.0)   # A's live tail untouched
    np.testing.assert_array_equal(v[:3], -1.0)
    np.testing.assert_array_equal(k[3:6], 0.0)  # B's dead tail scrubbed
    np.testing.assert_array_equal(v[3:6], 0.0)
    slot_idx = np.asarray(pool.reserve_tokens([c], [2]))[0, :2]
    np.testing.assert_array_equal(slot_idx, seg_a[0] * 8 + np.array([3, 4]))  # in place
    k_c, v_c = (np.asarray(x)[0, 0] for x in pool.gather_kv(c))
    np.testing.assert_array_equal(k_c, [[1.0, 1.0]] * 3 + [[0.0, 0.0]] * 2)
    np.testing.assert_array_equal(v_c, [[-1.0, -1.0]] * 3 + [[0.0, 0.0]] * 2)
    self.assertFalse(np.any(np.asarray(pool.state.pages.k) == 2.0))
    pool.check_invariants()

  def test_without_scrubbing_the_data_stays(self):
    """The default keeps its cost: reclaiming only clears bits, K/V are untouched."""
    config = dataclasses.replace(_SCRUB_CONFIG, scrub_freed_blocks=False)
    pool, _, _, seg_b = self._slotted_block(config)
    before = np.asarray(pool.state.pages.k)
    self.assertEqual(pool.reclaim_slots([]), seg_b[2])
    np.testing.assert_array_equal(np.asarray(pool.state.pages.k), before)

  @chex.variants(with_jit=True, without_jit=True)
  def test_transition_zeroes_exactly_the_cleared_slots(self):
    pool, _, _, seg_b = self._slotted_block(_SCRUB_CONFIG)
    fn = self.variant(slots.reclaim_slots.__wrapped__, static_argnames=("config",))
    z = np.zeros((2,), np.int32)
    before = jax.tree.map(np.asarray, pool.state)
    # A refused call (a holder missing: the tables + nothing do not account for a fake
    # extra reference) changes neither bits nor K/V.
    bogus = np.array([seg_b[0], 0], np.int32), np.array([0, 0], np.int32), np.array([1, 0],
                                                                                    np.int32)
    state, (status, reclaimed) = fn(pool.state, *bogus, config=_SCRUB_CONFIG)
    self.assertEqual(int(status), Status.INVALID_SEGMENT)
    self.assertEqual(int(reclaimed), 0)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))
    state, (status, reclaimed) = fn(state, z, z, z, config=_SCRUB_CONFIG)
    self.assertEqual((int(status), int(reclaimed)), (Status.OK, seg_b[2]))
    cleared = np.zeros(before.pages.k.shape, bool)
    cleared[:, :, seg_b[0], seg_b[1]:seg_b[1] + seg_b[2]] = True
    for old, new in ((before.pages.k, state.pages.k), (before.pages.v, state.pages.v)):
      new = np.asarray(new)
      np.testing.assert_array_equal(new[cleared], 0.0)
      np.testing.assert_array_equal(new[~cleared], old[~cleared])
      self.assertTrue(np.all(old[cleared] != 0))

  def test_scrubbing_reclaim_still_updates_the_pages_in_place(self):
    state = paged_kv.init_pool(_SCRUB_CONFIG)
    z = jnp.zeros((4,), jnp.int32)
    compiled = slots.reclaim_slots.lower(state, z, z, z, config=_SCRUB_CONFIG).compile()
    pages_bytes = state.pages.k.nbytes + state.pages.v.nbytes
    self.assertGreaterEqual(compiled.memory_analysis().alias_size_in_bytes, pages_bytes)


if __name__ == "__main__":
  absltest.main()
