"""Slotted blocks: `cow_split` (copy-on-write of a tail) and `pack_slots` (packing).

`pack_slots` copies segments shorter than a block into free slots of partly used
blocks. A moved reference's owner is a table row (`owner >= 0`, `col` its
column), an outside holder (`OWNER_EXTERNAL`, vouching for one reference) or
padding (`-1`); the pool transfers every reference itself, so an outside
holder's rebind deltas must not be applied again. Slot bits stay set until the
block frees or `reclaim_slots` (which knows every holder) finds the slot
uncovered, so a destination slot was never referenced.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.alloc import change_refs, grant_prefix, rebuild_free_list, take_blocks
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import Status
from paged_kv.core.page_copy import copy_slot_ranges
from paged_kv.core.sequences import (finish_status, first_occurrence, range_mask, row_status,
                               slot_bits)
from paged_kv.core.state import REGION_DYNAMIC, KVPages, PoolState

OWNER_EXTERNAL = -2  # `pack_slots` owner id of a holder outside the segment tables
OWNER_PADDING = -1


def _tail_blocks_mask(state: PoolState, n: int) -> jax.Array:
  """`bool[n]`: blocks holding the tail segment of an active row (may still grow)."""
  t = state.table
  m = t.block.shape[1]
  tail = jnp.clip(t.num_segments - 1, 0, m - 1)
  tb = jnp.take_along_axis(t.block, tail[:, None], axis=1)[:, 0]
  has = t.active & (t.num_segments > 0)
  return jnp.zeros((n,), bool).at[jnp.where(has, tb, n)].set(True, mode="drop")


@functools.partial(jax.jit, static_argnames=("config", "atomic", "impl", "interpret"),
                   donate_argnames=("state",))
def cow_split(state: PoolState, seq_ids: jax.Array, *, config: PoolConfig, atomic: bool = False,
              impl: str = "xla",
              interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Copies each row's tail segment into a fresh block it owns, when appending in place cannot.

  That is when the tail block is shared, in the base region, the tail does not
  start at slot 0, or a slot after it was handed out; the row then owns slots
  `[0, l)` of the lowest free block and drops its reference on the old one.
  `impl`/`interpret` as in `page_copy`. Returns `(state, (split: bool[B],
  status: i32[B]))`, `NO_FREE_BLOCK` when no block was free for the copy.
  """
  n, bs, m = config.num_blocks, config.block_size, config.max_segments
  table, meta = state.table, state.meta
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  real = seq_ids != -1
  status = row_status(table, seq_ids, want_active=True)
  row = jnp.clip(seq_ids, 0, config.max_seqs - 1)
  ns = table.num_segments[row]
  tail = jnp.clip(ns - 1, 0, m - 1)
  tb = table.block[row, tail]
  ts = table.start[row, tail]
  tl = table.length[row, tail]
  pos = ts + tl
  i = jnp.arange(bs)[None, :]
  after_busy = jnp.any(slot_bits(meta.slots[tb], bs) & (i >= pos[:, None]), axis=1)
  blocked = (meta.ref_count[tb] > 1) | (meta.region[tb] != REGION_DYNAMIC) | (ts > 0) | after_busy
  wants = (status == Status.OK) & real & (ns > 0) & (tl < bs) & blocked
  valid = (status == Status.OK) & real
  if atomic:
    valid = valid & jnp.all(status == Status.OK)
  need = jnp.where(wants & valid, 1, 0)
  granted = grant_prefix(need, valid, meta.num_free, atomic=atomic)
  status = jnp.where(valid & ~granted, Status.NO_FREE_BLOCK, status)
  split = granted & (need > 0)
  meta, new_ids = take_blocks(meta, need, granted, max_per_request=1, step=state.step)
  fresh = jnp.where(split, new_ids[:, 0], -1)

  pages = copy_slot_ranges(state.pages, jnp.where(split, tb, -1), ts, fresh,
                           jnp.zeros_like(ts), jnp.where(split, tl, 0), impl=impl,
                           interpret=interpret)
  safe_fresh = jnp.where(split, fresh, n)
  meta = dataclasses.replace(
      meta, slots=meta.slots.at[safe_fresh].set(range_mask(jnp.zeros_like(tl), tl,
                                                           config.slot_words), mode="drop"))
  rows = jnp.where(split, row, config.max_seqs)
  table = dataclasses.replace(
      table,
      block=table.block.at[rows, tail].set(fresh, mode="drop"),
      start=table.start.at[rows, tail].set(0, mode="drop"),
  )
  state = dataclasses.replace(state, pages=pages, meta=meta, table=table)
  state = change_refs(state, jnp.where(split, tb, n), -jnp.ones_like(tb), config=config)
  return state, (split, finish_status(status, granted | ~real))


def _place_segments(occ: jax.Array, eligible: jax.Array, lengths: jax.Array, leader: jax.Array,
                    free_list: jax.Array, num_free: jax.Array, group: jax.Array,
                    block_group: jax.Array, *,
                    block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Best-fit placement: `(dest_block, dest_start, occ)`, fullest same-group block first."""
  n, bs = occ.shape
  s_idx = jnp.arange(bs + 1, dtype=jnp.int32)

  def body(carry, x):
    occ, elig, used_fresh, block_group = carry
    length, go, g = x
    cum = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), jnp.cumsum(occ, axis=1,
                                                                      dtype=jnp.int32)], axis=1)
    end = jnp.clip(s_idx[:bs] + length, 0, bs)
    clear = (cum[:, end] - cum[:, :bs] == 0) & (s_idx[None, :bs] + length <= bs)
    fits = elig & (block_group == g) & jnp.any(clear, axis=1)
    free_slots = bs - cum[:, bs]
    score = jnp.where(fits, free_slots * n + jnp.arange(n, dtype=jnp.int32), jnp.iinfo(jnp.int32).max)
    best = jnp.argmin(score).astype(jnp.int32)
    have_partial = jnp.any(fits)
    start_partial = jnp.argmax(clear[best]).astype(jnp.int32)
    has_fresh = used_fresh < num_free
    fresh = free_list[jnp.clip(free_list.shape[0] - num_free + used_fresh, 0, n - 1)]
    blk = jnp.where(have_partial, best, jnp.where(has_fresh, fresh, -1))
    start = jnp.where(have_partial, start_partial, 0)
    placed = go & (blk >= 0)
    blk = jnp.where(placed, blk, -1)
    start = jnp.where(placed, start, -1)
    took_fresh = placed & ~have_partial
    row_mask = (jnp.arange(bs) >= start) & (jnp.arange(bs) < start + length)
    safe = jnp.where(placed, blk, n)
    occ = occ.at[safe].set(occ[jnp.clip(safe, 0, n - 1)] | row_mask, mode="drop")
    elig = elig.at[jnp.where(took_fresh, blk, n)].set(True, mode="drop")
    block_group = block_group.at[jnp.where(took_fresh, blk, n)].set(g, mode="drop")
    return (occ, elig, used_fresh + took_fresh.astype(jnp.int32), block_group), (blk, start)

  (occ, _, _, _), (dest_block, dest_start) = jax.lax.scan(
      body, (occ, eligible, jnp.zeros((), jnp.int32), block_group), (lengths, leader, group))
  return dest_block, dest_start, occ


@functools.partial(jax.jit, static_argnames=("config", "atomic", "impl", "interpret"),
                   donate_argnames=("state",))
def pack_slots(state: PoolState, owner: jax.Array, col: jax.Array, seg_block: jax.Array,
               seg_start: jax.Array, seg_length: jax.Array, seg_group: jax.Array | None = None,
               block_group: jax.Array | None = None, *, config: PoolConfig,
               atomic: bool = False, impl: str = "xla",
               interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array, jax.Array]]:
  """Copies short segments into free slot ranges of partly used blocks (or fresh ones).

  Each segment (`length < block_size`, dynamic) goes, in order and best fit, to a
  live dynamic block with a slot handed out that is neither an active row's tail
  nor a source of this call; the reference moves and table rows are rewritten.
  With `seg_group: i32[K]` / `block_group: i32[N]` (-1: no destination) a segment
  only joins its own group's blocks. Returns `(state, (new_block, new_start,
  status))`, each `i32[K]`, `-1` where not moved.
  """
  n, bs, m = config.num_blocks, config.block_size, config.max_segments
  table, meta = state.table, state.meta
  owner, col, seg_block, seg_start, seg_length = (
      jnp.asarray(a, jnp.int32) for a in (owner, col, seg_block, seg_start, seg_length))
  k = owner.shape[0]
  pad = owner == OWNER_PADDING
  ext = owner == OWNER_EXTERNAL
  in_tab = owner >= 0
  row = jnp.clip(owner, 0, config.max_seqs - 1)
  c = jnp.clip(col, 0, m - 1)
  row_ok = (owner < config.max_seqs) & table.active[row] & (col >= 0) & (
      col < table.num_segments[row])
  # A table entry named twice: every occurrence after the first is refused.
  key = jnp.where(in_tab, row * m + c, -1 - jnp.arange(k))
  dup_entry = in_tab & ~first_occurrence(key)
  matches = ((table.block[row, c] == seg_block) & (table.start[row, c] == seg_start)
             & (table.length[row, c] == seg_length))
  blk_ok = (seg_block >= 0) & (seg_block < n)
  cb = jnp.clip(seg_block, 0, n - 1)
  live = meta.ref_count[cb] > 0
  dynamic = meta.region[cb] == REGION_DYNAMIC
  shape_ok = (seg_start >= 0) & (seg_length >= 1) & (seg_length < bs) & (
      seg_start + seg_length <= bs)
  mask = range_mask(seg_start, seg_length, config.slot_words)
  written = jnp.all((meta.slots[cb] & mask) == mask, axis=-1)
  status = jnp.full((k,), Status.OK, jnp.int32)
  status = jnp.where(~pad & ~ext & ~in_tab, Status.INVALID_SEQUENCE, status)
  status = jnp.where(in_tab & ~row_ok, Status.INVALID_SEQUENCE, status)
  status = jnp.where((status == Status.OK) & in_tab & (dup_entry | ~matches),
                     Status.INVALID_SEGMENT, status)
  status = jnp.where((status == Status.OK) & ~pad & ~(blk_ok & live & dynamic),
                     Status.INVALID_BLOCK, status)
  status = jnp.where((status == Status.OK) & ~pad & ~(shape_ok & written),
                     Status.INVALID_SEGMENT, status)
  valid = (status == Status.OK) & ~pad
  if atomic:
    valid = valid & jnp.all(status == Status.OK)

  # Identical triples move together: the first valid one is the leader.
  same = ((seg_block[:, None] == seg_block[None, :]) & (seg_start[:, None] == seg_start[None, :])
          & (seg_length[:, None] == seg_length[None, :]) & valid[None, :])
  lead_idx = jnp.argmax(same, axis=1).astype(jnp.int32)  # first valid equal entry
  leader = valid & (lead_idx == jnp.arange(k))

  occ = slot_bits(meta.slots, bs)
  sources = jnp.zeros((n,), bool).at[jnp.where(valid, seg_block, n)].set(True, mode="drop")
  eligible = ((meta.ref_count > 0) & (meta.region == REGION_DYNAMIC) & jnp.any(occ, axis=1)
              & ~_tail_blocks_mask(state, n) & ~sources)
  seg_group = (jnp.zeros((k,), jnp.int32) if seg_group is None
               else jnp.asarray(seg_group, jnp.int32))
  block_group = (jnp.zeros((n,), jnp.int32) if block_group is None
                 else jnp.asarray(block_group, jnp.int32))
  dest_block, dest_start, _ = _place_segments(occ, eligible, seg_length, leader, meta.free_list,
                                              meta.num_free, seg_group, block_group,
                                              block_size=bs)
  new_block = jnp.where(valid, dest_block[lead_idx], -1)
  new_start = jnp.where(valid, dest_start[lead_idx], -1)
  placed = valid & (new_block >= 0)
  status = jnp.where(valid & ~placed, Status.NO_FREE_BLOCK, status)
  applied = placed
  if atomic:
    applied = applied & jnp.all(placed == valid)
  new_block = jnp.where(applied, new_block, -1)
  new_start = jnp.where(applied, new_start, -1)
  copy_lead = applied & leader

  pages = copy_slot_ranges(state.pages, jnp.where(copy_lead, seg_block, -1), seg_start,
                           jnp.where(copy_lead, new_block, -1), new_start,
                           jnp.where(copy_lead, seg_length, 0), impl=impl, interpret=interpret)
  dst_safe = jnp.where(copy_lead, new_block, n)
  dmask = range_mask(jnp.maximum(new_start, 0), seg_length, config.slot_words)
  slots = meta.slots.at[dst_safe].add(jnp.where(copy_lead[:, None], dmask, 0), mode="drop")
  last_use = meta.last_use.at[dst_safe].max(meta.last_use[cb], mode="drop")
  meta = dataclasses.replace(meta, slots=slots, last_use=last_use)
  tab_rows = jnp.where(applied & in_tab, row, config.max_seqs)
  table = dataclasses.replace(
      table,
      block=table.block.at[tab_rows, c].set(new_block, mode="drop"),
      start=table.start.at[tab_rows, c].set(new_start, mode="drop"),
  )
  state = dataclasses.replace(state, pages=pages, meta=meta, table=table)
  ids = jnp.concatenate([jnp.where(applied, new_block, n), jnp.where(applied, seg_block, n)])
  deltas = jnp.concatenate([jnp.ones((k,), jnp.int32), -jnp.ones((k,), jnp.int32)])
  state = change_refs(state, ids, deltas, config=config)
  # Fresh destination blocks went from free to referenced: change_refs only rebuilds the
  # free list when a block frees, so rebuild it here (O(num_blocks), like the placement).
  # A refused call keeps the list bit-identical.
  took_fresh = jnp.any(copy_lead & (meta.ref_count[jnp.clip(new_block, 0, n - 1)] == 0))
  free_list, num_free = rebuild_free_list(state.meta.ref_count, state.meta.region)
  free_list = jnp.where(took_fresh, free_list, state.meta.free_list)
  num_free = jnp.where(took_fresh, num_free, state.meta.num_free)
  state = dataclasses.replace(state, meta=dataclasses.replace(state.meta, free_list=free_list,
                                                               num_free=num_free))
  return state, (new_block, new_start, finish_status(status, applied | pad))



def _zero_slots(pages: KVPages, cleared: jax.Array) -> KVPages:
  """Zeroes the K/V of the slots `cleared: bool[N, bs]`, looping over the touched blocks only."""
  n = cleared.shape[0]
  hit = jnp.any(cleared, axis=1)
  num_hit = jnp.sum(hit, dtype=jnp.int32)
  (ids,) = jnp.nonzero(hit, size=n, fill_value=0)

  def body(i, kv: KVPages) -> KVPages:
    b = ids[i]
    drop = cleared[b][None, None, None, :, None]  # [1, 1, 1, bs, 1]

    def zero(p: jax.Array) -> jax.Array:
      blk = jax.lax.dynamic_slice_in_dim(p, b, 1, axis=2)
      return jax.lax.dynamic_update_slice_in_dim(p, jnp.where(drop, jnp.zeros_like(blk), blk),
                                                 b, axis=2)

    return KVPages(k=zero(kv.k), v=zero(kv.v))

  return jax.lax.fori_loop(0, num_hit, body, pages)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def reclaim_slots(state: PoolState, ext_block: jax.Array, ext_start: jax.Array,
                  ext_length: jax.Array, *,
                  config: PoolConfig) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Clears the slot bits no live segment covers, so packing can reuse them.

  `ext_*: i32[E]` are every segment held outside the tables (`length == 0` =
  padding); if tables plus them do not account for every `ref_count`, nothing
  changes (`INVALID_SEGMENT`). O(num_blocks * block_size): between steps. Cleared
  slots are zeroed when the pool scrubs. Returns `(state, (status, reclaimed))`.
  """
  n, bs, m = config.num_blocks, config.block_size, config.max_segments
  t = state.table
  used = t.active[:, None] & (jnp.arange(m)[None, :] < t.num_segments[:, None])
  blk = jnp.concatenate([jnp.where(used, t.block, 0).reshape(-1), ext_block])
  start = jnp.concatenate([jnp.where(used, t.start, 0).reshape(-1), ext_start])
  length = jnp.concatenate([jnp.where(used, t.length, 0).reshape(-1), ext_length])
  real = length > 0
  ok_shape = ~real | ((blk >= 0) & (blk < n) & (start >= 0) & (start + length <= bs))
  safe_blk = jnp.where(real & ok_shape, blk, n)
  refs = jnp.zeros((n,), jnp.int32).at[safe_blk].add(1, mode="drop")
  consistent = jnp.all(ok_shape) & jnp.all(refs == state.meta.ref_count)
  first = jnp.where(real & ok_shape, blk * bs + start, n * bs)
  diff = (jnp.zeros((n * bs + 1,), jnp.int32).at[first].add(1, mode="drop")
          .at[first + jnp.where(real & ok_shape, length, 0)].add(-1, mode="drop"))
  covered = (jnp.cumsum(diff[:-1]) > 0).reshape(n, bs)
  words = config.slot_words
  pad = words * 32 - bs
  bits = jnp.pad(covered, ((0, 0), (0, pad))).reshape(n, words, 32).astype(jnp.uint32)
  new_slots = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  # Never set a bit that was clear: covered slots are always marked (invariant 3).
  new_slots = new_slots & state.meta.slots
  before = jnp.sum(slot_bits(state.meta.slots, bs), dtype=jnp.int32)
  after = jnp.sum(slot_bits(new_slots, bs), dtype=jnp.int32)
  slots_out = jnp.where(consistent, new_slots, state.meta.slots)
  meta = dataclasses.replace(state.meta, slots=slots_out)
  pages = state.pages
  if config.scrub_freed_blocks:
    # Exactly the slots whose bit goes from set to clear (none when refused).
    pages = _zero_slots(pages, slot_bits(state.meta.slots, bs) & ~slot_bits(slots_out, bs))
  status = jnp.where(consistent, Status.OK, Status.INVALID_SEGMENT).astype(jnp.int32)
  return (dataclasses.replace(state, pages=pages, meta=meta),
          (status, jnp.where(consistent, before - after, 0)))


def plan_consolidation(ref_count, slots, region, seg_block, seg_length, *, block_size: int,
                       max_moves: int = 64):
  """Held segments whose re-packing frees the sparsest slotted blocks: `i64[K]` indices.

  Picks partly used dynamic blocks whose every reference is among the given
  segments (one each), sparsest first, while their live slots fit in the blocks
  that stay. Call it right after `reclaim_slots` (older bits are conservative).
  """
  ref = np.asarray(ref_count)
  words = np.asarray(slots).astype(np.uint64)
  n = ref.shape[0]
  i = np.arange(block_size)
  occ = ((words[:, i // 32] >> (i % 32).astype(np.uint64)) & 1).sum(axis=1)
  seg_block = np.asarray(seg_block, np.int64)
  seg_length = np.asarray(seg_length, np.int64)
  real = (seg_length > 0) & (seg_block >= 0) & (seg_block < n)
  held = np.bincount(seg_block[real], minlength=n)[:n]
  partial = (ref > 0) & (np.asarray(region) == REGION_DYNAMIC) & (occ > 0) & (occ < block_size)
  movable = partial & (held == ref)
  cand = np.flatnonzero(movable)
  cand = cand[np.lexsort((-cand, occ[cand]))]  # sparsest first, then highest address
  room = int((block_size - occ[partial]).sum())  # free slots in partly used blocks
  need, picked, count = 0, [], 0
  for b in cand:
    nseg = int(held[b])
    if count + nseg > max_moves:
      break
    free_here = block_size - int(occ[b])
    if need + int(occ[b]) > room - free_here:
      break
    room -= free_here
    need += int(occ[b])
    picked.append(b)
    count += nseg
  if not picked:
    return np.zeros(0, np.int64)
  rank = np.full(n, -1, np.int64)
  rank[np.asarray(picked)] = np.arange(len(picked))
  idx = np.flatnonzero(real & (rank[np.clip(seg_block, 0, n - 1)] >= 0))
  return idx[np.argsort(rank[seg_block[idx]], kind="stable")]
