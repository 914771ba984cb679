"""Opening sequence rows: `BlockPool.open_sequence(s)` (bound as its methods).

On segments a prefix cache holds, one gather of the blocks' counts and slot
words serves both the checks and the update (`held_counts` decides, `open_held`
applies), with the results of `host_transitions.open_rows`.
"""
# pylint: disable=protected-access

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from paged_kv.core.errors import (InternalInconsistency, InvalidArgument, InvalidBlock,
                                  InvalidSegment, PoolExhausted)
from paged_kv.core.segment_format import Segments, as_segments, empty_segments
from paged_kv.pool import host_transitions as T
from paged_kv.pool.arguments import as_int_array, fast_segments, raise_for_status
from paged_kv.pool.host_state import HostState
from paged_kv.pool.ids import aggregate

if TYPE_CHECKING:
  from paged_kv.pool.block_pool import BlockPool


def open_sequence(pool: BlockPool, segments: Segments | None = None,
                  seq_id: int | None = None, *, copy_tail: bool = False) -> int:
  """Activates a row (the lowest free one unless `seq_id` is given): one row of
  `open_sequences`, same checks and errors.

  Args:
    segments: `i32[n, 3]` `(block, start, length)` rows of a shared prefix (e.g. a
      `PrefixCache.match`'s), each gaining a reference; they must lie on live
      blocks and written slots. None or empty: an empty sequence.
    seq_id: the row to open; default the lowest free one.
    copy_tail: then copy the row's tail into a fresh exclusive block when it is
      shared or slotted and a block is free, so appends continue in place
      (`cow_split([row], skip_exhausted=True)` in the same call).

  Returns:
    The row.

  Raises:
    InvalidSegmentLayout: `segments` is not `i32[n, 3]`.
    InvalidBlock / InvalidSegment: a segment off a live block, on unwritten slots,
      or on dead slots (a block only the tables hold, on slots none covers).
    PoolExhausted: no free row, or more than `max_segments` segments.
    InvalidSequence: `seq_id` out of range or active.
  """
  if seq_id is None:
    row = pool._open_one(segments, copy_tail=copy_tail)
    if row is not None:
      return row
  rows = pool.open_sequences([segments], None if seq_id is None else [seq_id])
  if copy_tail:
    pool.cow_split(rows, skip_exhausted=True)
  return int(rows[0])

def open_sequences(pool: BlockPool, segments: Sequence[Segments | None],
                   seq_ids=None) -> np.ndarray:
  """Activates one row per entry of `segments`, atomically.

  Args:
    segments: per new row, `i32[n, 3]` `(block, start, length)` rows of a shared
      prefix (each gaining a reference), or None / empty for an empty sequence.
    seq_ids: the rows to open (`int[B]`, distinct, inactive); default the `B`
      lowest free rows, in order.

  Returns:
    `i64[B]` the rows, in the order of `segments`.

  Raises:
    The errors of `open_sequence`, for the first row that fails; nothing is
    opened then (atomic).
  """
  if len(segments) == 1 and seq_ids is None:
    row = pool._open_one(segments[0])
    if row is not None:
      return np.array([row], np.int64)
  segs = [empty_segments() if s is None else as_segments(s) for s in segments]
  k = len(segs)
  h = pool.host
  if seq_ids is None:
    free = np.flatnonzero(~h.active)
    if free.size < k:
      raise PoolExhausted(f"all {pool.config.max_seqs} sequence rows are in use"
                          if free.size == 0 else
                          f"{k} rows wanted, {free.size} of {pool.config.max_seqs} free",
                          reason="no_free_row")
    ids = free[:k].astype(np.int64)
  else:
    ids = as_int_array(seq_ids, "seq_ids")
    if ids.size != k:
      raise InvalidArgument(f"{ids.size} seq_ids for {k} rows of segments")
    pool._check_ids(ids, active=False)
  if k == 0:
    return ids
  nums = np.array([len(x) for x in segs], np.int64)
  p = int(nums.max())
  if p > pool.config.max_segments:
    raise PoolExhausted(f"{p} segments > max_segments {pool.config.max_segments}",
                        reason="table_full")
  flat = np.concatenate(segs) if p else np.zeros((0, 3), np.int32)
  if p and (flat[:, 0].min() < 0 or flat[:, 0].max() >= pool.config.num_blocks):
    raise InvalidBlock(f"segment blocks {flat[:, 0].tolist()} outside "
                       f"[0, {pool.config.num_blocks})")
  grid = np.zeros((3, k, max(p, 1)), np.int64)
  if p:
    rows = np.repeat(np.arange(k), nums)
    cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(nums) - nums, nums)
    grid[:, rows, cols] = flat.T
    used = np.arange(grid.shape[2])[None, :] < nums[:, None]
    dead = T.dead_segments(h, grid[0], grid[1], grid[2], used)
    if dead.any():
      r, c = (int(x[0]) for x in np.nonzero(dead))
      b, start, length = (int(x) for x in grid[:, r, c])
      raise InvalidSegment(
          f"open_sequence: row {r}'s segment ({b}, {start}, {length}) lies on dead "
          f"slots of block {b} (handed out, but no live segment covers them and nothing "
          "outside the tables holds the block); nothing was applied")
  status = T.open_rows(h, ids, grid[0], grid[1], grid[2], nums)
  raise_for_status(status, "open_sequence")
  pool._done()
  return ids

def open_one(pool: BlockPool, segments, *, copy_tail: bool = False) -> int | None:
  """`open_sequences` of one row in the lowest free row without the batch work (and
  `open_sequence`'s tail copy); None, with nothing changed, when the general path
  must decide (a problem to report, or blocks no outside holder vouches for)."""
  segs = empty_segments() if segments is None else fast_segments(segments)
  if segs is None:
    return None
  h = pool.host
  free = ~h.active
  row = int(free.argmax())
  if not free[row]:
    return None
  if not segs.shape[0]:
    status = T.open_rows(h, np.array([row]), segs[None, :, 0], segs[None, :, 1],
                                segs[None, :, 2], np.array([0]))
    if status[0]:
      return None
    pool._done()
    return row
  counts = held_counts(h, segs)
  if counts is None:
    return None
  if (copy_tail and int(segs[-1, 2]) < pool.config.block_size and h.free.num_free
      and pool._log.page_conflict(segs[-1:, 0], h.free.lowest(1), copies=1)):
    pool.flush()  # the copy (into the lowest free block) must wait for the window's pages
  open_held(h, row, segs, *counts, copy_tail=copy_tail)
  pool._done()
  return row

def open_few(pool: BlockPool, segments: Sequence,
             copy_tails: Sequence[bool]) -> np.ndarray | None:
  """`open_sequences(segments)` in the lowest free rows, then the tail copies of
  the rows marked in `copy_tails`: all rows checked in one pass, those without a
  copy opened in one pass, the others one at a time in row order (an open changes
  nothing another row's checks read, so the result is that of one open after
  the other). None when a row needs the general path (nothing changed)."""
  h = pool.host
  rows = np.flatnonzero(~h.active)[:len(segments)]
  if rows.size < len(segments):
    return None
  segs = [empty_segments() if x is None else fast_segments(x) for x in segments]
  if any(x is None for x in segs):
    return None
  counts = held_counts_many(h, segs)
  if counts is None:
    return None
  if any(copy_tails):  # those rows after the others, in order (the lowest free rows left)
    alone = np.array(copy_tails, bool)
    blocks, ref, tr = counts
    keep = np.repeat(~alone, [x.shape[0] for x in segs])
    batch = [x for x, a in zip(segs, copy_tails) if not a]
    if batch:
      open_many_held(h, rows[~alone], batch, blocks[keep], ref[keep], tr[keep])
    for x in itertools.compress(segs, copy_tails):
      if pool._open_one(x, copy_tail=True) is None:
        raise InternalInconsistency("open: a row checked to open was refused")
  else:
    open_many_held(h, rows, segs, *counts)
  pool._done()
  return rows.astype(np.int64)


_MASKS: dict[int, np.ndarray] = {}


def _masks(block_size: int) -> np.ndarray:
  """`i64[(bs + 1) ** 2]`: entry `s * (bs + 1) + l` has bits `[s, s + l)` set (cached)."""
  m = _MASKS.get(block_size)
  if m is None:
    s = np.arange(block_size + 1, dtype=np.int64)
    m = ((((np.int64(1) << s[None, :]) - 1) << s[:, None]) & 0xFFFFFFFF).reshape(-1)
    m.setflags(write=False)
    _MASKS[block_size] = m
  return m


def held_counts(h: HostState,
                segs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """`(blocks i64[k], ref_count, table_refs)` of the blocks of `segs` (`i32[k, 3]`,
  `k >= 1`) when a row may open on them without the general path: at most
  `max_segments`, every block held outside the tables (so live), every segment
  on written slots. None otherwise (the general path decides; nothing changed)."""
  if segs.shape[0] > h.config.max_segments:
    return None
  return _held(h, segs)


def held_counts_many(h: HostState, segs: list[np.ndarray]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """`held_counts` of several rows' segments (`i32[k_i, 3]`, `k_i >= 0`) in one
  gather, concatenated; None when any row would be refused alone. The same as one
  `held_counts` per row: an open changes neither `ref_count - table_refs` nor a
  slot word, which is all the checks read."""
  m = h.config.max_segments
  if any(x.shape[0] > m for x in segs):
    return None
  flat = np.concatenate(segs) if len(segs) > 1 else segs[0]
  if not flat.shape[0]:
    e = np.zeros(0, np.intp)
    return e, e, e
  return _held(h, flat)


def _held(h: HostState, segs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """`held_counts` without the row-length check (`segs`: `k >= 1` segments)."""
  c = h.config
  # One contiguous intp copy of the ids: numpy indexes with it without a cast per use.
  blk = segs[:, 0].astype(np.intp)
  st, ln = segs[:, 1], segs[:, 2]
  if blk.min() < 0 or blk.max() >= c.num_blocks:
    return None
  ref = h.ref_count[blk]
  tr = h.table_refs[blk]
  if (ref <= tr).any():
    return None
  bs = c.block_size
  # start >= 0, length >= 1, start + length <= bs (so start < bs, length <= bs - start).
  if st.min() < 0 or ln.min() < 1 or (st + ln).max() > bs:
    return None
  if c.slot_words == 1:
    mask = _masks(bs)[(st * (bs + 1) + ln).astype(np.intp)]
    if ((h.slots.reshape(-1)[blk] & mask) != mask).any():
      return None
  else:
    mask = T.range_mask(st, ln, c.slot_words)
    if ((h.slots[blk] & mask) != mask).any():
      return None
  return blk, ref, tr


def open_held(h: HostState, row: int, segs: np.ndarray, blocks: np.ndarray, ref: np.ndarray,
              tr: np.ndarray, *, copy_tail: bool) -> bool:
  """Opens inactive `row` on `segs`, which passed `held_counts` (giving `blocks`,
  `ref`, `tr`); `copy_tail`: the row opens on a copy of a partial tail in the
  lowest free block, if one is free. Returns whether it copied."""
  k = segs.shape[0]
  bs = h.config.block_size
  tb, ts, tl = segs[-1].tolist()
  copy = copy_tail and tl < bs and h.free.num_free >= 1
  fresh = -1
  if copy:
    f = h.free.lowest(1)
    fresh = int(f[0])
    h.take_blocks(f, T._prefix_words(tl, h.config.slot_words))  # pylint: disable=protected-access
    h.log.copies(h, np.array([[tb, ts, fresh, 0, tl]], np.int64))
    h.log.touch_owned(blocks[-1:])  # as the split's decref does
  refs = k - 1 if copy else k
  h.log.touch_row(h, row)
  h.block[row, :k] = segs[:, 0]
  h.start[row, :k] = segs[:, 1]
  h.length[row, :k] = segs[:, 2]
  if copy:
    h.block[row, k - 1] = fresh
    h.start[row, k - 1] = 0
  h.num_segments[row] = k
  h.seq_len[row] = int(segs[:, 2].sum())
  h.active[row] = True
  h.refresh_tail(row)  # the row's tail columns (host_state.HostState.row_tails)
  if refs:
    # Live blocks (held: `ref > tr >= 0`), so no count leaves 0: the free index stays.
    blk = blocks[:refs]
    uniq, count = aggregate(h.stamp, blk, 1)
    if uniq is blk:
      ref, tr = ref[:refs], tr[:refs]
    else:  # a block twice (a split inside it): its counts summed
      ref, tr = h.ref_count[uniq], h.table_refs[uniq]
    h.log.touch_owned(uniq)
    h.ref_count[uniq] = ref + count
    h.table_refs[uniq] = tr + count
    h.num_table_blocks += uniq.size - int(np.count_nonzero(tr))
  if copy:
    h.table_refs[fresh] += 1
    h.num_table_blocks += 1
  return copy


def open_many_held(h: HostState, rows: np.ndarray, segs: list[np.ndarray], blocks: np.ndarray,
                   ref: np.ndarray, tr: np.ndarray) -> None:
  """`open_held` of a few distinct `rows` (no tail copy) on `segs`, which passed
  `held_counts_many`: the rows written one by one, then one count update."""
  for row, x in zip(rows.tolist(), segs):  # a few rows: plain slices, one row at a time
    k = x.shape[0]
    h.log.touch_row(h, row)
    h.block[row, :k] = x[:, 0]
    h.start[row, :k] = x[:, 1]
    h.length[row, :k] = x[:, 2]
    h.num_segments[row] = k
    h.seq_len[row] = sum(x[:, 2].tolist())
    h.active[row] = True
    h.refresh_tail(row)  # the row's tail columns (host_state.HostState.row_tails)
  if not blocks.size:
    return
  # Held blocks (`ref > tr >= 0`): no count leaves 0, so the free index stays.
  uniq, count = aggregate(h.stamp, blocks, 1)
  if uniq is not blocks:  # a block twice (a split inside it, or two rows): counts summed
    ref, tr = h.ref_count[uniq], h.table_refs[uniq]
  h.log.touch_owned(uniq)
  h.ref_count[uniq] = ref + count
  h.table_refs[uniq] = tr + count
  h.num_table_blocks += uniq.size - int(np.count_nonzero(tr))
