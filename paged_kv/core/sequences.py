"""Sequence transitions over segment tables: open, reserve, fork, release.

Each takes a batch of rows (`-1` = padding: OK, nothing done) with `state`
donated and static `config`, and returns an `i32` status per row. Failed rows
leave the state untouched; with `atomic=True` one failure leaves all of it
untouched (the other rows report ABORTED).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_kv.core.alloc import apply_ref_deltas as alloc_apply_ref_deltas
from paged_kv.core.alloc import (change_refs, first_occurrence, grant_prefix, reads_before_writes,
                                 table_refs_at, take_blocks)
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import Status
from paged_kv.core.state import REGION_DYNAMIC, PoolState, SegmentTable


def _cdiv(a, b):
  return (a + b - 1) // b


def row_status(table: SegmentTable, seq_ids: jax.Array, *, want_active: bool) -> jax.Array:
  """Validates sequence rows: in range, (in)active as wanted, not repeated."""
  max_seqs = table.active.shape[0]
  in_range = (seq_ids >= 0) & (seq_ids < max_seqs)
  active = table.active[jnp.clip(seq_ids, 0, max_seqs - 1)]
  good = in_range & (active == want_active) & first_occurrence(seq_ids)
  return jnp.where(seq_ids == -1, Status.OK, jnp.where(good, Status.OK, Status.INVALID_SEQUENCE))


def finish_status(status: jax.Array, applied: jax.Array) -> jax.Array:
  """Marks valid rows that were not applied (atomic refusal) as ABORTED."""
  return jnp.where((status == Status.OK) & ~applied, Status.ABORTED, status).astype(jnp.int32)


def slot_bits(words: jax.Array, block_size: int) -> jax.Array:
  """Unpacks `u32[..., W]` slot words into `bool[..., block_size]`."""
  i = jnp.arange(block_size)
  w = words[..., i // 32]
  return ((w >> (i % 32).astype(jnp.uint32)) & 1).astype(bool)


def range_mask(start: jax.Array, length: jax.Array, words: int) -> jax.Array:
  """`u32[..., words]` with bits `[start, start + length)` set."""
  base = 32 * jnp.arange(words)
  lo = jnp.clip(start[..., None] - base, 0, 32).astype(jnp.uint32)
  hi = jnp.clip(start[..., None] + length[..., None] - base, 0, 32).astype(jnp.uint32)
  full = jnp.uint32(0xFFFFFFFF)
  ones = lambda k: jnp.where(k >= 32, full, (jnp.uint32(1) << jnp.minimum(k, 31)) - 1)
  return ones(hi) & ~ones(lo)


# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "atomic"), donate_argnames=("state",))
def open_sequence(state: PoolState, seq_ids: jax.Array, seg_block: jax.Array,
                  seg_start: jax.Array, seg_length: jax.Array, num_segments: jax.Array, *,
                  config: PoolConfig, atomic: bool = False) -> tuple[PoolState, jax.Array]:
  """Activates inactive rows `seq_ids`, each optionally from shared segments (a cached prefix).

  Row `b` starts with `(seg_block, seg_start, seg_length)[b, :num_segments[b]]`
  (`i32[B, P]`), each on a live block and written slots, each increfing its
  block. Returns `(state, status: i32[B])`.
  """
  n, bs = config.num_blocks, config.block_size
  table, meta = state.table, state.meta
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  b, p = seg_block.shape
  status = row_status(table, seq_ids, want_active=False)
  count_bad = (num_segments < 0) | (num_segments > min(p, config.max_segments))
  status = jnp.where((status == Status.OK) & count_bad & (seq_ids != -1), Status.INVALID_COUNT,
                     status)
  used = jnp.arange(p)[None, :] < num_segments[:, None]
  blk_ok = (seg_block >= 0) & (seg_block < n)
  cb = jnp.clip(seg_block, 0, n - 1)
  live = meta.ref_count[cb] > 0
  # No `start + length` (it could wrap around int32): compare against `bs - start`.
  shape_ok = (seg_start >= 0) & (seg_start < bs) & (seg_length >= 1) & (
      seg_length <= bs - seg_start)
  mask = range_mask(seg_start, seg_length, config.slot_words)
  written = jnp.all((meta.slots[cb] & mask) == mask, axis=-1)
  bad_block = jnp.any(used & ~(blk_ok & live), axis=1)
  bad_seg = jnp.any(used & ~(shape_ok & written), axis=1)
  real = seq_ids != -1
  status = jnp.where((status == Status.OK) & real & bad_block, Status.INVALID_BLOCK, status)
  status = jnp.where((status == Status.OK) & real & bad_seg, Status.INVALID_SEGMENT, status)
  ok = (status == Status.OK) & real
  if atomic:
    ok = ok & jnp.all((status == Status.OK))
  # The checks' reads of the per-block arrays first: the updates below are then in place.
  (ok, status), state = reads_before_writes((ok, status), state)
  table = state.table
  rows = jnp.where(ok, seq_ids, config.max_seqs)
  m = config.max_segments
  width = min(p, m)
  used_w = used[:, :width] & ok[:, None]
  pad = lambda x: jnp.where(used_w, x[:, :width], 0)
  seg_len_total = jnp.sum(jnp.where(used_w, seg_length[:, :width], 0), axis=1)
  table = dataclasses.replace(
      table,
      block=table.block.at[rows, :width].set(pad(seg_block), mode="drop"),
      start=table.start.at[rows, :width].set(pad(seg_start), mode="drop"),
      length=table.length.at[rows, :width].set(pad(seg_length), mode="drop"),
      num_segments=table.num_segments.at[rows].set(num_segments, mode="drop"),
      seq_len=table.seq_len.at[rows].set(seg_len_total, mode="drop"),
      active=table.active.at[rows].set(True, mode="drop"),
  )
  inc_ids = jnp.where(used_w, seg_block[:, :width], n)
  state = change_refs(dataclasses.replace(state, table=table), inc_ids,
                      jnp.ones_like(inc_ids), config=config, may_free=False)
  meta = dataclasses.replace(state.meta,
                             last_use=state.meta.last_use.at[inc_ids].set(state.step, mode="drop"))
  return dataclasses.replace(state, meta=meta), finish_status(status, ok | ~real)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "atomic"),
                   donate_argnames=("state",))
def reserve_tokens(state: PoolState, seq_ids: jax.Array, num_new: jax.Array, *,
                   config: PoolConfig, max_new_tokens: int,
                   atomic: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Makes room for the next `num_new[i]` tokens of each active row in a batch.

  Tokens go in place after the tail segment while the row owns its tail block
  (ref_count 1, dynamic) with free slots after it; the rest go to fresh blocks,
  lowest address first, granted first come first served. O(B * (max_new_tokens +
  block_size)). Returns `(state, (slot_idx, status))`: `slot_idx: i32[B,
  max_new_tokens]` the flat slot (`block * block_size + offset`) of each new
  token, `-1` beyond `num_new[i]` and for failed rows.
  """
  n, bs, m = config.num_blocks, config.block_size, config.max_segments
  table, meta = state.table, state.meta
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  num_new = jnp.asarray(num_new, jnp.int32)
  real = seq_ids != -1
  status = row_status(table, seq_ids, want_active=True)
  count_bad = (num_new < 0) | (num_new > max_new_tokens)
  status = jnp.where((status == Status.OK) & real & count_bad, Status.INVALID_COUNT, status)
  row = jnp.clip(seq_ids, 0, config.max_seqs - 1)
  ns = table.num_segments[row]
  tail = jnp.clip(ns - 1, 0, m - 1)
  tb = table.block[row, tail]
  pos = table.start[row, tail] + table.length[row, tail]
  exclusive = (ns > 0) & (meta.ref_count[tb] == 1) & (meta.region[tb] == REGION_DYNAMIC)
  busy = slot_bits(meta.slots[tb], bs) | (jnp.arange(bs)[None, :] < pos[:, None])
  first_busy_after = jnp.min(jnp.where(busy & (jnp.arange(bs)[None, :] >= pos[:, None]),
                                       jnp.arange(bs)[None, :], bs), axis=1)
  room = jnp.where(exclusive, first_busy_after - pos, 0)
  n_tok = jnp.clip(num_new, 0, max_new_tokens)
  in_place = jnp.minimum(n_tok, room)
  rest = n_tok - in_place
  need = _cdiv(rest, bs)
  status = jnp.where((status == Status.OK) & real & (ns + need > m), Status.TABLE_FULL, status)
  valid = (status == Status.OK) & real
  if atomic:
    valid = valid & jnp.all(status == Status.OK)
  max_blocks = _cdiv(max_new_tokens, bs)
  granted = grant_prefix(need, valid, meta.num_free, atomic=atomic)
  status = jnp.where(valid & ~granted, Status.NO_FREE_BLOCK, status)
  # Reads of the per-block arrays first: the updates below are then in place.
  (tb, pos, tail, row, ns, n_tok, in_place, rest, need, granted, status), meta = \
      reads_before_writes((tb, pos, tail, row, ns, n_tok, in_place, rest, need, granted, status),
                          meta)
  meta, new_ids = take_blocks(meta, need, granted, max_per_request=max_blocks, step=state.step)

  # Slot index of every new token.
  j = jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :]
  k = j - in_place[:, None]
  blk_new = jnp.take_along_axis(new_ids, jnp.clip(k // bs, 0, max_blocks - 1), axis=1)
  slot_in_place = tb[:, None] * bs + pos[:, None] + j
  slot_new = blk_new * bs + k % bs
  tok_ok = granted[:, None] & (j < n_tok[:, None])
  slot_idx = jnp.where(tok_ok, jnp.where(j < in_place[:, None], slot_in_place, slot_new), -1)

  # Mark the slots used (each was free, so adding its bit sets it).
  flat = slot_idx.reshape(-1)
  blk = jnp.where(flat >= 0, flat // bs, n)
  off = flat % bs
  slots = meta.slots.at[blk, off // 32].add(jnp.uint32(1) << (off % 32).astype(jnp.uint32),
                                            mode="drop")
  touched_tail = jnp.where(granted & (in_place > 0), tb, n)
  meta = dataclasses.replace(meta, slots=slots,
                             last_use=meta.last_use.at[touched_tail].set(state.step, mode="drop"))

  # Segment table: extend the tail, then one new segment per new block.
  rows = jnp.where(granted, row, config.max_seqs)
  q = jnp.arange(max_blocks, dtype=jnp.int32)[None, :]
  q_used = granted[:, None] & (q < need[:, None])
  seg_col = jnp.where(q_used, ns[:, None] + q, m)
  seg_len = jnp.minimum(bs, rest[:, None] - q * bs)
  rows2 = jnp.broadcast_to(rows[:, None], seg_col.shape)
  table = dataclasses.replace(
      table,
      length=table.length.at[rows, tail].add(jnp.where(granted, in_place, 0), mode="drop")
      .at[rows2, seg_col].set(seg_len, mode="drop"),
      block=table.block.at[rows2, seg_col].set(new_ids, mode="drop"),
      start=table.start.at[rows2, seg_col].set(0, mode="drop"),
      num_segments=table.num_segments.at[rows].add(need, mode="drop"),
      seq_len=table.seq_len.at[rows].add(n_tok, mode="drop"),
  )
  # The clock advances only when something was reserved: a refused call changes nothing.
  step = state.step + jnp.any(granted & (n_tok > 0)).astype(jnp.int32)
  state = dataclasses.replace(state, meta=meta, table=table, step=step)
  return state, (slot_idx, finish_status(status, granted | ~real))


@functools.partial(jax.jit, static_argnames=("config", "atomic"), donate_argnames=("state",))
def release(state: PoolState, seq_ids: jax.Array, *, config: PoolConfig,
            atomic: bool = False) -> tuple[PoolState, jax.Array]:
  """Ends rows: every segment drops its reference; blocks reaching zero are freed.

  Returns `(state, status: i32[B])`; an inactive row is `INVALID_SEQUENCE`.
  """
  n, m = config.num_blocks, config.max_segments
  table = state.table
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  real = seq_ids != -1
  status = row_status(table, seq_ids, want_active=True)
  ok = (status == Status.OK) & real
  if atomic:
    ok = ok & jnp.all(status == Status.OK)
  row = jnp.clip(seq_ids, 0, config.max_seqs - 1)
  used = ok[:, None] & (jnp.arange(m)[None, :] < table.num_segments[row][:, None])
  dec_ids = jnp.where(used, table.block[row], n)
  state = change_refs(state, dec_ids, -jnp.ones_like(dec_ids), config=config)
  rows = jnp.where(ok, row, config.max_seqs)
  t = state.table
  table = dataclasses.replace(
      t,
      block=t.block.at[rows].set(0, mode="drop"),
      start=t.start.at[rows].set(0, mode="drop"),
      length=t.length.at[rows].set(0, mode="drop"),
      num_segments=t.num_segments.at[rows].set(0, mode="drop"),
      seq_len=t.seq_len.at[rows].set(0, mode="drop"),
      active=t.active.at[rows].set(False, mode="drop"),
  )
  return dataclasses.replace(state, table=table), finish_status(status, ok | ~real)


@functools.partial(jax.jit, static_argnames=("config", "atomic"), donate_argnames=("state",))
def fork(state: PoolState, src_ids: jax.Array, dst_ids: jax.Array, *, config: PoolConfig,
         atomic: bool = False) -> tuple[PoolState, jax.Array]:
  """Starts each inactive `dst` row as a copy of active `src` (may repeat), sharing its segments.

  The shared tail then has `ref_count >= 2`, so the next append starts a fresh
  block (or `cow_split` copies the tail first). Returns `(state, status: i32[B])`.
  """
  n, m = config.num_blocks, config.max_segments
  table = state.table
  src_ids = jnp.asarray(src_ids, jnp.int32)
  dst_ids = jnp.asarray(dst_ids, jnp.int32)
  real = dst_ids != -1
  max_seqs = config.max_seqs
  src_ok = (src_ids >= 0) & (src_ids < max_seqs) & table.active[jnp.clip(src_ids, 0, max_seqs - 1)]
  status = row_status(table, dst_ids, want_active=False)
  status = jnp.where(real & ~src_ok, Status.INVALID_SEQUENCE, status)
  ok = (status == Status.OK) & real
  if atomic:
    ok = ok & jnp.all(status == Status.OK)
  src = jnp.clip(src_ids, 0, max_seqs - 1)
  rows = jnp.where(ok, dst_ids, max_seqs)
  used = ok[:, None] & (jnp.arange(m)[None, :] < table.num_segments[src][:, None])
  table = dataclasses.replace(
      table,
      block=table.block.at[rows].set(table.block[src], mode="drop"),
      start=table.start.at[rows].set(table.start[src], mode="drop"),
      length=table.length.at[rows].set(table.length[src], mode="drop"),
      num_segments=table.num_segments.at[rows].set(table.num_segments[src], mode="drop"),
      seq_len=table.seq_len.at[rows].set(table.seq_len[src], mode="drop"),
      active=table.active.at[rows].set(True, mode="drop"),
  )
  inc_ids = jnp.where(used, table.block[src], n)
  state = change_refs(dataclasses.replace(state, table=table), inc_ids, jnp.ones_like(inc_ids),
                      config=config, may_free=False)
  return state, finish_status(status, ok | ~real)


@functools.partial(jax.jit, static_argnames=("config", "check_dead"), donate_argnames=("state",))
def open_checked(state: PoolState, seq_ids: jax.Array, seg_block: jax.Array,
                 seg_start: jax.Array, seg_length: jax.Array, num_segments: jax.Array, *,
                 config: PoolConfig,
                 check_dead: bool = True) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """`open_sequence` (atomic), refusing segments that may lie on dead slots.

  A dead slot was handed out but no live holder covers it, so it may be handed out
  again. With `check_dead`, a segment on a live block held only by table segments
  is flagged; any flag refuses the call (`INVALID_SEGMENT`, others `ABORTED`) and
  `suspect: bool[B, P]` names them for the host to check. Prefix-cache segments
  are never flagged. Returns `(state, (status, suspect))`.
  """
  n, bs = config.num_blocks, config.block_size
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  b, p = seg_block.shape
  real = seq_ids != -1
  if check_dead:
    used = real[:, None] & (jnp.arange(p)[None, :] < num_segments[:, None])
    in_range = (seg_block >= 0) & (seg_block < n)
    ref = state.meta.ref_count[jnp.clip(seg_block, 0, n - 1)]
    table_refs = table_refs_at(state, jnp.where(used & in_range, seg_block, -1).reshape(-1))
    shape_ok = (seg_start >= 0) & (seg_start < bs) & (seg_length >= 1) & (
        seg_length <= bs - seg_start)
    suspect = used & in_range & shape_ok & (ref > 0) & (ref <= table_refs.reshape(b, p))
  else:
    suspect = jnp.zeros((b, p), bool)
  refuse = jnp.any(suspect)
  state, status = open_sequence(state, jnp.where(refuse, -1, seq_ids), seg_block, seg_start,
                                seg_length, num_segments, config=config, atomic=True)
  refused = jnp.where(jnp.any(suspect, axis=1), Status.INVALID_SEGMENT, Status.ABORTED)
  status = jnp.where(refuse & real, refused, status).astype(jnp.int32)
  return state, (status, suspect)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def release_with_refs(state: PoolState, seq_ids: jax.Array, block_ids: jax.Array,
                      deltas: jax.Array, *,
                      config: PoolConfig) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """`apply_ref_deltas(block_ids, deltas)` then `release(seq_ids)`, in one atomic call.

  The deltas are checked against the state before the release. Returns `(state,
  (row_status: i32[B], ref_status: i32[K]))`.
  """
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  block_ids = jnp.asarray(block_ids, jnp.int32)
  rows = row_status(state.table, seq_ids, want_active=True)
  rows_ok = jnp.all(rows == Status.OK)
  state, ref_status = alloc_apply_ref_deltas(state, jnp.where(rows_ok, block_ids, -1), deltas,
                                             config=config)
  refs_ok = jnp.all(ref_status == Status.OK)
  ref_status = jnp.where(rows_ok | (block_ids == -1), ref_status, Status.ABORTED)
  state, row_st = release(state, jnp.where(refs_ok & rows_ok, seq_ids, -1), config=config,
                          atomic=True)
  row_st = jnp.where(refs_ok & rows_ok, row_st,
                     jnp.where((rows == Status.OK) & (seq_ids != -1), Status.ABORTED, rows))
  return state, (row_st.astype(jnp.int32), ref_status.astype(jnp.int32))
