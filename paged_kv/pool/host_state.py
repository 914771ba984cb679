"""`HostState`: an exact numpy copy of a pool's bookkeeping, changed only through
mutators that record every change for the device.

Mirrored: `BlockMeta.ref_count`, `slots`, `region`, the free index, the whole
`SegmentTable` and the clock `step`. Not mirrored: the K/V pages and `last_use`
(the commit stamps touched blocks with the step). Derived and kept up to date:
`table_refs` (live table segments per block) and each row's tail facts, which a
reservation reads every step; `tail_differences` checks them against the tables.

Every mutator first tells the attached `ChangeLog` what it is about to touch
(the log keeps each block's and row's value before its first change since the
last commit), so nothing the device must apply is forgotten and the commit can
check that the device held what the host expected.
"""

from __future__ import annotations

import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC, PoolState
from paged_kv.pool import ref_counts
from paged_kv.pool.changes import ChangeLog
from paged_kv.pool.free_index import HostFreeIndex
from paged_kv.pool.ids import aggregate, arange, distinct_mask, sum_by_id, words_to_int  # noqa: F401 (re-exported)
from paged_kv.pool.ref_counts import NO_IDS as _NO_IDS
from paged_kv.pool.ref_counts import SMALL_CHANGES


class HostState:
  """The host mirror of one pool's bookkeeping.

  Attributes:
    config: the pool's config.
    ref_count: `i32[n]`; slots: `u32[n, W]`; region: `i8[n]`; free: the free index.
    block, start, length: `i32[S, M]`; num_segments, seq_len: `i32[S]`;
    active: `bool[S]`: the segment tables.
    table_refs: `i32[n]` live table segments per block (derived).
    tail_block, tail_end, tail_limit: `i32[S]` per row (derived, `row_tails`).
    num_table_blocks: blocks with `table_refs > 0` (derived).
    num_free_base: free base-region blocks (derived).
    step: the logical clock (`PoolState.step`).
    log: the `ChangeLog` the mutators record into.
  """

  def __init__(self, config: PoolConfig, *, ref_count, slots, region, free: HostFreeIndex,
               block, start, length, num_segments, seq_len, active, step: int,
               log: ChangeLog | None = None):
    self.config = config
    self.ref_count = np.array(ref_count, np.int32)
    self.slots = np.array(slots, np.uint32).reshape(config.num_blocks, config.slot_words)
    self.region = np.array(region, np.int8)
    self.free = free
    self.block = np.array(block, np.int32)
    self.start = np.array(start, np.int32)
    self.length = np.array(length, np.int32)
    self.num_segments = np.array(num_segments, np.int32)
    self.seq_len = np.array(seq_len, np.int32)
    self.active = np.array(active, bool)
    self.step = int(step)
    self.table_refs = np.bincount(self.block[self.used_mask()],
                                  minlength=config.num_blocks).astype(np.int32)
    self.num_table_blocks = int(np.count_nonzero(self.table_refs))
    self.num_free_base = int(np.count_nonzero((self.ref_count == 0)
                                              & (self.region == REGION_BASE)))
    self.stamp = np.zeros(config.num_blocks, np.int64)  # scratch of `distinct_mask`
    self.tail_block, self.tail_end, self.tail_limit = self.row_tails(
        np.arange(config.max_seqs, dtype=np.int64))
    self.log = log if log is not None else ChangeLog(config)
    self.log.reset(self)

  # ------------------------------------------------------------------ construction
  @classmethod
  def empty(cls, config: PoolConfig, log: ChangeLog | None = None) -> "HostState":
    """The mirror of `init_pool(config)`, built on the host (no device read)."""
    n, s, m = config.num_blocks, config.max_seqs, config.max_segments
    nb = config.num_base_blocks
    region = np.zeros(n, np.int8)
    region[:nb] = REGION_BASE
    zeros = lambda *shape: np.zeros(shape, np.int32)
    return cls(config, ref_count=zeros(n), slots=np.zeros((n, config.slot_words), np.uint32),
               region=region, free=HostFreeIndex.from_mask(np.arange(n) >= nb),
               block=zeros(s, m), start=zeros(s, m), length=zeros(s, m),
               num_segments=zeros(s), seq_len=zeros(s), active=np.zeros(s, bool), step=0,
               log=log)

  @classmethod
  def from_device(cls, state: PoolState, config: PoolConfig,
                  log: ChangeLog | None = None) -> "HostState":
    """A mirror read from a device state (every bookkeeping array to the host: O(n))."""
    import jax  # pylint: disable=g-import-not-at-top
    meta, t = jax.device_get((state.meta, state.table))
    free = HostFreeIndex(config.num_blocks, meta.free_bits, meta.free_counts,
                         int(meta.num_free))
    return cls(config, ref_count=meta.ref_count, slots=meta.slots, region=meta.region,
               free=free, block=t.block, start=t.start, length=t.length,
               num_segments=t.num_segments, seq_len=t.seq_len, active=t.active,
               step=int(jax.device_get(state.step)), log=log)

  def resized(self, config: PoolConfig) -> "HostState":
    """The mirror of `regions.resize_pool` to `config` (a cut tail must be free)."""
    n, new_n = self.config.num_blocks, config.num_blocks
    def fit(a, fill=0):
      if new_n <= n:
        return a[:new_n]
      return np.concatenate([a, np.full((new_n - n,) + a.shape[1:], fill, a.dtype)])
    ref, region = fit(self.ref_count), fit(self.region)
    free = HostFreeIndex.from_mask((ref == 0) & (region == REGION_DYNAMIC))
    self.log.resize(config)
    return HostState(config, ref_count=ref, slots=fit(self.slots), region=region, free=free,
                     block=self.block, start=self.start, length=self.length,
                     num_segments=self.num_segments, seq_len=self.seq_len, active=self.active,
                     step=self.step, log=self.log)

  # ------------------------------------------------------------------ queries
  def used_mask(self, rows: np.ndarray | None = None) -> np.ndarray:
    """`bool[R, M]`: the used table entries of `rows` (default every row)."""
    ns = self.num_segments if rows is None else self.num_segments[rows]
    act = self.active if rows is None else self.active[rows]
    return act[:, None] & (np.arange(self.config.max_segments)[None, :] < ns[:, None])

  def row_segments(self, row: int) -> np.ndarray:
    """`i32[k, 3]` the used `(block, start, length)` of one row (a copy)."""
    k = int(self.num_segments[row])
    out = np.empty((k, 3), np.int32)
    out[:, 0] = self.block[row, :k]
    out[:, 1] = self.start[row, :k]
    out[:, 2] = self.length[row, :k]
    return out

  def row_tails(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(tail_block, tail_end, tail_limit)`, `i32[R]` each, of `rows` from the tables.

    The block of the row's last segment (column 0's for a row without one), the
    slot after that segment, and the next written slot after it or the block's
    end for an active row on a dynamic block (else `tail_end`). A reservation
    grows a row in place iff `tail_limit > tail_end` and its tail block has one
    reference (`host_transitions`).
    """
    c = self.config
    bs, m = c.block_size, c.max_segments
    ns = self.num_segments[rows]
    at = rows * m + np.maximum(ns - 1, 0)
    tb = self.block.reshape(-1)[at]
    end = self.start.reshape(-1)[at] + self.length.reshape(-1)[at]
    i = arange(bs)
    words = self.slots[tb]
    bits = ((words[:, i // 32] >> (i % 32).astype(np.uint32)) & 1).astype(bool)
    first = np.min(np.where(bits & (i[None, :] >= end[:, None]), i, bs), axis=1)
    live = (ns > 0) & self.active[rows] & (self.region[tb] == REGION_DYNAMIC)
    limit = np.where(live, first, end)
    return tb.astype(np.int32), end.astype(np.int32), limit.astype(np.int32)

  def refresh_tail(self, row: int) -> None:
    """`row_tails` of one row into the tail columns, in plain Python."""
    ns = self.num_segments.item(row)
    col = max(ns - 1, 0)
    tb = self.block.item(row, col)
    end = self.start.item(row, col) + self.length.item(row, col)
    limit = end
    if ns > 0 and self.active.item(row) and self.region.item(tb) == REGION_DYNAMIC:
      bits = (self.slots.item(tb, 0) if self.config.slot_words == 1
              else words_to_int(self.slots[tb]))
      after = bits >> end
      limit = end + (after & -after).bit_length() - 1 if after else self.config.block_size
    self.tail_block[row] = tb
    self.tail_end[row] = end
    self.tail_limit[row] = limit

  def _refresh_tails(self, rows: np.ndarray) -> None:
    """`row_tails` of `rows` (`i64[R]`) into the tail columns."""
    self.tail_block[rows], self.tail_end[rows], self.tail_limit[rows] = self.row_tails(rows)

  def tail_differences(self) -> list[str]:
    """The tail columns that differ from `row_tails` of the tables (empty: none)."""
    want = self.row_tails(np.arange(self.config.max_seqs, dtype=np.int64))
    out = []
    for name, col, w in zip(("tail_block", "tail_end", "tail_limit"),
                            (self.tail_block, self.tail_end, self.tail_limit), want):
      if not np.array_equal(col, w):
        out.append(f"{name} (column != tables at rows {np.flatnonzero(col != w)[:4].tolist()})")
    return out

  def dynamic(self, blocks: np.ndarray) -> np.ndarray:
    return self.region[blocks] == REGION_DYNAMIC

  def block_usage(self) -> tuple[int, int]:
    """`(live, cached_only)` dynamic blocks (as `regions.block_usage`; O(n) numpy)."""
    dyn = self.region == REGION_DYNAMIC
    in_table = self.table_refs > 0
    live = in_table & dyn
    cached = (self.ref_count > 0) & ~in_table & dyn
    return int(live.sum()), int(cached.sum())

  def totals(self) -> np.ndarray:
    """`i64[5]` what the commit checks on the device beside the touched entries:
    free blocks, active rows, their tokens and segments, and the clock."""
    act = self.active
    return np.array([self.free.num_free, int(act.sum()), int(self.seq_len[act].sum()),
                     int(self.num_segments[act].sum()), self.step], np.int64)

  # -- block-side mutators (`ref_counts`), bound as methods ---------------------
  # pylint: disable=protected-access
  change_refs = ref_counts.change_refs
  _change_refs_general = ref_counts._change_refs_general
  set_refs = ref_counts.set_refs
  _blocks_freed = ref_counts._blocks_freed
  _change_refs_small = ref_counts._change_refs_small
  set_refs_small = ref_counts.set_refs_small
  _change_ref = ref_counts._change_ref
  take_blocks = ref_counts.take_blocks
  set_slots = ref_counts.set_slots
  set_slot_bits = ref_counts.set_slot_bits
  # pylint: enable=protected-access

  # ------------------------------------------------------------------ row mutators
  def write_rows(self, rows: np.ndarray, *, block=None, start=None, length=None,
                 num_segments=None, seq_len=None, active=None, clear: bool = False) -> None:
    """Writes whole table rows (distinct `rows`): each argument their new values
    (`[R, M]` or `[R]`) or None to keep; `clear` zeroes them (a release)."""
    r = np.asarray(rows, np.int64)
    if r.size == 0:
      return
    self.log.touch_rows(self, r)
    old_used = self.used_mask(r)
    old_blocks = self.block[r][old_used]
    if clear:
      for a in (self.block, self.start, self.length):
        a[r] = 0
      self.num_segments[r] = 0
      self.seq_len[r] = 0
      self.active[r] = False
    else:
      for a, v in ((self.block, block), (self.start, start), (self.length, length),
                   (self.num_segments, num_segments), (self.seq_len, seq_len),
                   (self.active, active)):
        if v is not None:
          a[r] = v
    new_used = self.used_mask(r)
    new_blocks = self.block[r][new_used]
    self._change_table_refs(old_blocks, new_blocks)
    self._refresh_tails(r)

  def _change_table_refs(self, old_blocks: np.ndarray, new_blocks: np.ndarray) -> None:
    """`table_refs` minus one per `old_blocks` entry, plus one per `new_blocks` entry."""
    tr = self.table_refs
    if old_blocks.size + new_blocks.size <= 4:  # a tail move: plain Python
      for x in old_blocks.tolist():
        tr[x] -= 1
        self.num_table_blocks -= int(tr[x] == 0)
      for x in new_blocks.tolist():
        tr[x] += 1
        self.num_table_blocks += int(tr[x] == 1)
      return
    if old_blocks.size:
      uniq, count = aggregate(self.stamp, old_blocks, 1)
      tr[uniq] -= count
      self.num_table_blocks -= int(np.count_nonzero(tr[uniq] == 0))
    if new_blocks.size:
      uniq, count = aggregate(self.stamp, new_blocks, 1)
      tr[uniq] += count
      self.num_table_blocks += int(np.count_nonzero(tr[uniq] == count))

  def extend_rows(self, rows: np.ndarray, tail: np.ndarray, grow: np.ndarray,
                  cell_rows: np.ndarray, cell_cols: np.ndarray, cell_blocks: np.ndarray,
                  cell_lengths: np.ndarray, add_segments: np.ndarray,
                  add_tokens: np.ndarray) -> None:
    """Appends to live rows (a reservation), touching only what changes.

    `rows: [R]` distinct, `tail: [R]` their tail column, `grow: [R]` tokens added
    to it in place; `[C]` new segments at (`rows[cell_rows]`, `cell_cols`), at slot
    0 of distinct fresh `cell_blocks` with `cell_lengths` tokens; `add_segments`
    and `add_tokens` (`[R]`) go to `num_segments` and `seq_len`.
    """
    r = np.asarray(rows, np.int64)
    if r.size == 0:
      return
    self.log.touch_rows(self, r)
    self.length[r, tail] += grow.astype(np.int32)
    rr = r[cell_rows]
    self.block[rr, cell_cols] = cell_blocks
    self.start[rr, cell_cols] = 0
    self.length[rr, cell_cols] = cell_lengths
    self.num_segments[r] += add_segments.astype(np.int32)
    self.seq_len[r] += add_tokens.astype(np.int32)
    self.table_refs[cell_blocks] += 1
    self.num_table_blocks += int(np.asarray(cell_blocks).size)
    self._refresh_tails(r)

  def start_tails(self, rows: np.ndarray, cols: np.ndarray, blocks: np.ndarray) -> None:
    """One token more in each of `rows` (distinct, live), in a new segment at column
    `cols[i]` at slot 0 of its own fresh block `blocks[i]`: `extend_rows` of a
    decode step's rows that start a block, without reading the tables."""
    r = np.asarray(rows, np.int64)
    if r.size == 0:
      return
    self.log.touch_rows(self, r)
    self.block[r, cols] = blocks
    self.start[r, cols] = 0
    self.length[r, cols] = 1
    self.num_segments[r] += 1
    self.seq_len[r] += 1
    self.table_refs[blocks] += 1
    self.num_table_blocks += int(r.size)
    self.tail_block[r] = blocks
    self.tail_end[r] = 1
    self.tail_limit[r] = self.config.block_size  # the block's other slots are free

  def open_row(self, row: int, block: np.ndarray, start: np.ndarray,
               length: np.ndarray, *, tail_taken: bool = False) -> None:
    """Activates inactive `row` on the given segments (`i64[k]` each, on live blocks),
    each gaining a reference; `tail_taken`: the caller already took the last
    segment's block (a tail copy), which gains its table reference only."""
    k = int(block.size)
    self.log.touch_row(self, row)
    for a, v in ((self.block, block), (self.start, start), (self.length, length)):
      a[row, :k] = v
      a[row, k:] = 0
    self.num_segments[row] = k
    self.seq_len[row] = int(length.sum())
    self.active[row] = True
    self.refresh_tail(row)
    if not k:
      return
    refs = block[:-1] if tail_taken else block
    if refs.size <= 4:
      self._change_table_refs(block[:0], block)
      if refs.size:
        # Live blocks (the caller's check): no count leaves 0, nothing leaves the index.
        r = refs.astype(np.int64)
        self.log.touch_owned(r)
        if refs.size == 1 or len(set(ids := r.tolist())) == len(ids):
          self.ref_count[r] += 1
        else:
          np.add.at(self.ref_count, r, 1)
      return
    # The blocks summed once for both counts. They are live (the caller checked
    # `ref_count > 0`), so no count leaves 0: nothing leaves the free index.
    uniq, count = aggregate(self.stamp, refs, 1)
    tr = self.table_refs
    tr[uniq] += count
    self.num_table_blocks += int(np.count_nonzero(tr[uniq] == count))
    if tail_taken:
      x = int(block[-1])
      tr[x] += 1
      self.num_table_blocks += int(tr[x] == 1)
    self.log.touch_owned(uniq)
    self.ref_count[uniq] += count

  def extend_row(self, row: int, tail: int, grow: int, blocks: np.ndarray,
                 lengths: np.ndarray, tokens: int) -> None:
    """`extend_rows` of one row: `grow` tokens in its tail segment (column `tail`),
    then new segments at slot 0 of fresh `blocks` with `lengths` tokens."""
    self.log.touch_row(self, row)
    ns = int(self.num_segments[row])
    k = int(blocks.size)
    if grow:
      self.length[row, tail] += grow
      self.tail_end[row] += grow  # into the room after the tail (the caller's)
    if k:
      self.block[row, ns:ns + k] = blocks
      self.start[row, ns:ns + k] = 0
      self.length[row, ns:ns + k] = lengths
      self.num_segments[row] = ns + k
      self.table_refs[blocks] += 1
      self.num_table_blocks += k
      last = int(lengths[-1])  # the last fresh block: `last` slots from 0, the rest free
      self.tail_block[row] = int(blocks[-1])
      self.tail_end[row] = last
      self.tail_limit[row] = self.config.block_size
    self.seq_len[row] += tokens

  def release_row(self, row: int) -> None:
    """Ends live `row`: its entries cleared, one reference less per segment (the
    blocks summed once for both counts)."""
    self.log.touch_row(self, row)
    ns = int(self.num_segments[row])
    blocks = self.block[row, :ns].astype(np.int64)
    self.block[row, :ns] = 0
    self.start[row, :ns] = 0
    self.length[row, :ns] = 0
    self.num_segments[row] = 0
    self.seq_len[row] = 0
    self.active[row] = False
    self.tail_block[row] = self.tail_end[row] = self.tail_limit[row] = 0  # row_tails of a cleared row
    if ns <= SMALL_CHANGES:
      self._change_table_refs(blocks, blocks[:0])
      self.change_refs(blocks, -1)
      return
    uniq, count = aggregate(self.stamp, blocks, 1)
    tr = self.table_refs
    tr[uniq] -= count
    self.num_table_blocks -= int(np.count_nonzero(tr[uniq] == 0))
    self._change_refs_general(uniq, -count, distinct=True)

  def release_rows(self, rows: np.ndarray, blocks: np.ndarray = _NO_IDS,
                   deltas: np.ndarray = _NO_IDS) -> np.ndarray:
    """Ends live distinct `rows` and adds `deltas` to `ref_count[blocks]` (distinct,
    each change valid against the counts before) in one count update and one
    free-index update: the end state of `change_refs` then `release_row` of each
    row. Returns the freed blocks."""
    held = []  # every row's blocks (rows are a few: plain slices, one row at a time)
    for x in rows.tolist():
      self.log.touch_row(self, x)
      ns = int(self.num_segments[x])
      held += self.block[x, :ns].tolist()
      for a in (self.block, self.start, self.length):
        a[x] = 0
      self.num_segments[x] = 0
      self.seq_len[x] = 0
      self.active[x] = False
      self.tail_block[x] = self.tail_end[x] = self.tail_limit[x] = 0  # row_tails of a cleared row
    held = np.array(held, np.int64)
    ref = self.ref_count
    # No count leaves 0 upwards (increfs are on live blocks): only frees to follow,
    # among the rows' blocks and the outside changes' (a 0 change frees nothing).
    if blocks.size:
      self.log.touch_owned(blocks)
      ref[blocks] += deltas.astype(np.int32)
      ext = blocks if deltas.all() else blocks[deltas != 0]
    else:
      ext = blocks
    if held.size:
      uniq, count = aggregate(self.stamp, held, 1)
      tr = self.table_refs
      tr[uniq] -= count
      self.num_table_blocks -= int(np.count_nonzero(tr[uniq] == 0))
      self.log.touch_owned(uniq)
      ref[uniq] -= count.astype(np.int32) if isinstance(count, np.ndarray) else count
      changed = np.concatenate([uniq, ext]) if ext.size else uniq
    elif ext.size:
      changed = ext
    else:
      return _NO_IDS
    freed = changed[ref[changed] == 0]
    if not freed.size:
      return _NO_IDS
    if held.size and ext.size and freed.size > 1:
      freed = freed[distinct_mask(self.stamp, freed)]  # a block in both parts
    self._blocks_freed(freed)
    return freed

  def move_tail(self, row: int, tail: int, block: int) -> None:
    """Row `row`'s segment at column `tail` now lies at slot 0 of `block` (a tail copy)."""
    self.log.touch_row(self, row)
    old = int(self.block[row, tail])
    self.block[row, tail] = block
    self.start[row, tail] = 0
    self._change_table_refs(np.array([old], np.int64), np.array([block], np.int64))
    self.refresh_tail(row)

  def grow_tails(self, rows: np.ndarray, tail: np.ndarray) -> None:
    """One more token in the tail segment (column `tail`) of each of `rows` (distinct,
    each with room); the slot itself is the caller's `set_slots`."""
    r = np.asarray(rows, np.int64)
    if r.size == 0:
      return
    self.log.touch_rows(self, r)
    self.length[r, tail] += 1
    self.seq_len[r] += 1
    self.tail_end[r] += 1

  def grow_in_place(self, rows: np.ndarray, tail: np.ndarray, blocks: np.ndarray,
                    pos: np.ndarray) -> None:
    """One more token in the tail of each of `rows` (distinct, not in the log yet), at
    slot `pos` of its exclusive tail block, that the step applies on the device
    (`paged_kv.core.growth`): the log learns only the blocks and the tokens."""
    flat = self.slots.reshape(-1)
    p = pos.astype(np.uint32)
    at = blocks * self.config.slot_words + (p >> 5) if self.config.slot_words > 1 else blocks
    flat[at] |= np.uint32(1) << (p & 31)
    self.length[rows, tail] += 1
    self.seq_len[rows] += 1
    self.tail_end[rows] += 1
    self.log.device_growth(blocks, rows.size)

  def copy_slots(self, src_block, src_start, dst_block, dst_start, length) -> None:
    """Records K/V slot-range copies for the device (`page_copy.copy_slot_ranges`)."""
    self.log.copies(self, np.stack([np.asarray(x, np.int64).reshape(-1) for x in
                                    (src_block, src_start, dst_block, dst_start, length)],
                                   axis=1))

  def move_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Records whole-block K/V moves for the device (`page_copy.move_pages`)."""
    self.log.moves(self, np.stack([np.asarray(src, np.int64), np.asarray(dst, np.int64)], axis=1))

  # ------------------------------------------------------------------ comparison
  def differences(self, state: PoolState) -> list[str]:
    """Fields where the device state differs from the mirror (`last_use` not compared)."""
    import jax  # pylint: disable=g-import-not-at-top
    meta, t, step = jax.device_get((state.meta, state.table, state.step))
    pairs = [("ref_count", self.ref_count, meta.ref_count), ("slots", self.slots, meta.slots),
             ("region", self.region, meta.region), ("free_bits", self.free.bits, meta.free_bits),
             ("free_counts", self.free.counts, meta.free_counts),
             ("num_free", self.free.num_free, meta.num_free),
             ("block", self.block, t.block), ("start", self.start, t.start),
             ("length", self.length, t.length), ("num_segments", self.num_segments,
                                                  t.num_segments),
             ("seq_len", self.seq_len, t.seq_len), ("active", self.active, t.active),
             ("step", self.step, step)]
    out = self.tail_differences()  # the host's own derived columns first
    for name, host, dev in pairs:
      host, dev = np.asarray(host), np.asarray(dev)
      if host.shape != dev.shape or not np.array_equal(host, dev):
        if host.shape == dev.shape and host.ndim:
          where = np.argwhere(host != dev)[:4].tolist()
          out.append(f"{name} (host != device at {where})")
        else:
          out.append(f"{name} (host {host.tolist() if host.ndim == 0 else host.shape}, "
                     f"device {dev.tolist() if dev.ndim == 0 else dev.shape})")
    return out
