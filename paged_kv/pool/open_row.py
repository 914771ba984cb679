"""One row opened on held segments in one pass: each check once, each count once.

What a prefix cache hands `BlockPool.open_sequence`: `i32[k, 3]` segments on
blocks the cache holds. `transitions.open_rows` of one row (plus the tail copy of
`open_one_copying_tail`) reads the blocks' counts and slot words twice (the
pool's "held by someone outside the tables" check, then the open's own segment
checks) and sums the blocks once per count. Here one gather serves the checks
and the update: `held_counts` decides, `open_held` applies. Same results as the
two calls (`tests/mirror/test_open_row.py` compares them on random states).
"""

from __future__ import annotations

import numpy as np

from paged_kv.pool import host_transitions as T
from paged_kv.pool.host_state import HostState
from paged_kv.pool.ids import aggregate

_MASKS: dict[int, np.ndarray] = {}


def _masks(block_size: int) -> np.ndarray:
  """`i64[(bs + 1) ** 2]`: entry `s * (bs + 1) + l` has bits `[s, s + l)` set (cached,
  read only)."""
  m = _MASKS.get(block_size)
  if m is None:
    s = np.arange(block_size + 1, dtype=np.int64)
    m = ((((np.int64(1) << s[None, :]) - 1) << s[:, None]) & 0xFFFFFFFF).reshape(-1)
    m.setflags(write=False)
    _MASKS[block_size] = m
  return m


def held_counts(h: HostState,
                segs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """`(blocks i64[k], ref_count, table_refs)` of the blocks of `segs` (`i32[k, 3]`, `k >= 1`, C order)
  when a row opens on them without the general path: at most `max_segments`, every
  block in range and held outside the tables (`ref_count > table_refs`: so live, and
  no dead-slot question), every segment well formed on written slots. None
  otherwise (the general path then decides and raises; nothing was changed)."""
  if segs.shape[0] > h.config.max_segments:
    return None
  return _held(h, segs)


def held_counts_many(h: HostState, segs: list[np.ndarray]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """`held_counts` of several rows' segments at once (`i32[k_i, 3]` each, C order,
  any `k_i >= 0`): one gather and one check over them all, concatenated. Returns
  the concatenation's `(blocks, ref_count, table_refs)` (empty when no row has a
  segment) or None when any row would be refused alone. The same answer as one
  `held_counts` per row: an open changes neither `ref_count - table_refs` (a held
  block gains one of each) nor any slot word, which is all the checks read."""
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
  """Opens inactive `row` on `segs` (which passed `held_counts`, giving `blocks`,
  `ref`, `tr`);
  `copy_tail`: copies the tail into the lowest free block when it is partial and a
  block is free, the row opening on the copy (`open_one_copying_tail`). Returns
  whether it copied."""
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
  """Opens inactive distinct `rows` (`i64[R]`, a few) on `segs` (one `i32[k_i, 3]` each,
  no tail copy), which passed `held_counts_many` (giving `blocks`, `ref`, `tr`): the
  rows written one by one, then one count update for all their blocks (`open_held`
  of each row, the same end state)."""
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
