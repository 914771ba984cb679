"""`commit`: apply the host's bookkeeping decisions to the device state in one program.

A flush sends the host's queued decisions as one `CommitBatch` of *final*
values, so one dispatch applies a whole step's changes in any order. It also
checks that the device held what the host expected; a difference sets a bit of
`mismatch`, applies nothing, and the host raises `InternalInconsistency`. Work
is O(widths), never O(num_blocks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.alloc import mark_blocks, reads_before_writes
from paged_kv.core.config import PoolConfig
from paged_kv.core.page_copy import move_pages
from paged_kv.core.state import REGION_DYNAMIC, KVPages, PoolState

MISMATCH_BLOCKS = 1
MISMATCH_ROWS = 2
MISMATCH_TOTALS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CommitBatch:
  """One commit's arrays as the program reads them (`-1` ids are padding).

  Per touched block (`block_ids: i32[K]`, distinct): `ref_count` and slot bits
  before the window (`old_*`) and now (`new_*`), and whether to zero it before or
  after the page writes (`scrub_*`). Per touched row (`rows: i32[R]`): its old
  length fields and the whole row now (`row_*`). Then slot-range copies
  (`copy_*: i32[C]`, after the moves), block moves (`move_*: i32[M]`), the
  `expected` totals before (checked when `check_totals`) and the new clock `step`.
  """

  block_ids: jax.Array
  old_ref: jax.Array
  new_ref: jax.Array
  old_slots: jax.Array
  new_slots: jax.Array
  scrub_before: jax.Array
  scrub_after: jax.Array
  rows: jax.Array
  old_num_segments: jax.Array
  old_seq_len: jax.Array
  old_active: jax.Array
  row_block: jax.Array
  row_start: jax.Array
  row_length: jax.Array
  row_num_segments: jax.Array
  row_seq_len: jax.Array
  row_active: jax.Array
  copy_src_block: jax.Array
  copy_src_start: jax.Array
  copy_dst_block: jax.Array
  copy_dst_start: jax.Array
  copy_length: jax.Array
  move_src: jax.Array
  move_dst: jax.Array
  expected: jax.Array
  check_totals: jax.Array
  step: jax.Array


# Fields of a `CommitBatch` in the packed buffer: (name, shape code, padding fill, kind).
# Shape codes: K blocks, R rows, C copies, M moves, W slot words, S max_segments.
_FIELDS = (
    ("block_ids", "K", -1, "i"), ("old_ref", "K", 0, "i"), ("new_ref", "K", 0, "i"),
    ("old_slots", "KW", 0, "u"), ("new_slots", "KW", 0, "u"),
    ("scrub_before", "K", 0, "b"), ("scrub_after", "K", 0, "b"),
    ("rows", "R", -1, "i"), ("old_num_segments", "R", 0, "i"), ("old_seq_len", "R", 0, "i"),
    ("old_active", "R", 0, "b"), ("row_block", "RS", 0, "i"), ("row_start", "RS", 0, "i"),
    ("row_length", "RS", 0, "i"), ("row_num_segments", "R", 0, "i"),
    ("row_seq_len", "R", 0, "i"), ("row_active", "R", 0, "b"),
    ("copy_src_block", "C", -1, "i"), ("copy_src_start", "C", 0, "i"),
    ("copy_dst_block", "C", -1, "i"), ("copy_dst_start", "C", 0, "i"),
    ("copy_length", "C", 0, "i"), ("move_src", "M", -1, "i"), ("move_dst", "M", -1, "i"),
    ("expected", "5", -1, "i"), ("check_totals", "", 0, "b"), ("step", "", 0, "i"),
)


# Runs of consecutive `_FIELDS` of one shape, written together on the host
# (`CommitLayout.group`): name -> the fields, in buffer order.
_GROUPS = {
    "blocks": ("block_ids", "old_ref", "new_ref"),
    "slots": ("old_slots", "new_slots"),
    "scrub": ("scrub_before", "scrub_after"),
    "rows_before": ("rows", "old_num_segments", "old_seq_len", "old_active"),
    "row_segments": ("row_block", "row_start", "row_length"),
    "rows_after": ("row_num_segments", "row_seq_len", "row_active"),
    "copies": ("copy_src_block", "copy_src_start", "copy_dst_block", "copy_dst_start",
               "copy_length"),
    "moves": ("move_src", "move_dst"),
}


@dataclasses.dataclass(frozen=True)
class CommitLayout:
  """Where each `CommitBatch` field lies in a `PackedCommit`'s `i32` buffer (static).

  One array crosses instead of 27 arguments (a jitted call's cost grows with its
  arguments); slot words are stored bit for bit, flags as 0/1.
  """

  blocks: int
  rows: int
  copies: int
  moves: int
  slot_words: int
  max_segments: int

  def shape(self, code: str) -> tuple[int, ...]:
    dims = {"K": self.blocks, "R": self.rows, "C": self.copies, "M": self.moves,
            "W": self.slot_words, "S": self.max_segments, "5": 5}
    return tuple(dims[c] for c in code)

  @functools.cached_property
  def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
    """`name -> (offset, shape)`."""
    out, off = {}, 0
    for name, code, _, _ in _FIELDS:
      shape = self.shape(code)
      out[name] = (off, shape)
      off += int(np.prod(shape, dtype=np.int64))
    return out

  @functools.cached_property
  def size(self) -> int:
    off, shape = self.offsets[_FIELDS[-1][0]]
    return off + int(np.prod(shape, dtype=np.int64))

  @functools.cached_property
  def template(self) -> np.ndarray:
    """The all-padding buffer (a commit that changes nothing); copy before filling."""
    buf = np.zeros(self.size, np.int32)
    for name, _, fill, _ in _FIELDS:
      off, shape = self.offsets[name]
      buf[off:off + int(np.prod(shape, dtype=np.int64))] = fill
    buf.setflags(write=False)
    return buf

  @functools.cached_property
  def _groups(self) -> dict[str, tuple[int, int, int]]:
    """`group name -> (offset, fields, entries per field)`."""
    out = {}
    for group, names in _GROUPS.items():
      off, shape = self.offsets[names[0]]
      size = int(np.prod(shape, dtype=np.int64))
      assert all(self.offsets[n] == (off + i * size, shape) for i, n in enumerate(names))
      out[group] = (off, len(names), size)
    return out

  def group(self, buf: np.ndarray, name: str) -> np.ndarray:
    """`i32[fields, entries]`: a writable view of `buf` over a run of same-shaped fields."""
    off, n, size = self._groups[name]
    return buf[off:off + n * size].reshape(n, size)

  def put(self, buf: np.ndarray, name: str, values) -> None:
    """Writes the leading entries of field `name` (the rest keeps its padding)."""
    v = np.asarray(values)
    if v.dtype == np.uint32:
      v = v.view(np.int32)
    off, _ = self.offsets[name]
    buf[off:off + v.size] = v.reshape(-1)

  def unpack(self, buf: jax.Array) -> "CommitBatch":
    """The `CommitBatch` view of a packed buffer (inside jit: static slices)."""
    fields = {}
    for name, _, _, kind in _FIELDS:
      off, shape = self.offsets[name]
      x = buf[off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
      if kind == "u":
        x = jax.lax.bitcast_convert_type(x, jnp.uint32)
      elif kind == "b":
        x = x != 0
      fields[name] = x
    return CommitBatch(**fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedCommit:
  """One commit as it crosses: `buf: i32[layout.size]` and its static `layout` (a program each)."""

  buf: jax.Array
  layout: CommitLayout = dataclasses.field(metadata=dict(static=True))


def _slot_ranges(block, start, length, bs: int, n: int):
  """`(blk, off, valid)`, `[C * bs]` each: the slots of each range (invalid ones at block `n`)."""
  j = jnp.arange(bs, dtype=jnp.int32)[None, :]
  valid = (j < length[:, None]) & (block[:, None] >= 0)
  blk = jnp.where(valid, block[:, None], n).reshape(-1)
  off = jnp.where(valid, start[:, None] + j, 0).reshape(-1)
  return blk, off, valid.reshape(-1)


def _gather_slots(p: jax.Array, block, start, length) -> jax.Array:
  """`[L, H, C * bs, D]`: the K/V of slot ranges (for the copies)."""
  _, _, n, bs, _ = p.shape
  blk, off, _ = _slot_ranges(block, start, length, bs, n)
  return p[:, :, jnp.minimum(blk, n - 1), off]


def _scatter_slots(p: jax.Array, values: jax.Array, block, start, length) -> jax.Array:
  _, _, n, bs, _ = p.shape
  blk, off, _ = _slot_ranges(block, start, length, bs, n)
  return p.at[:, :, blk, off].set(values, mode="drop")


def _page_work(pages: KVPages, b: CommitBatch, *, scrub: bool) -> KVPages:
  """Moves, then copies; each block's scrub after its last read and before its next write."""
  if b.move_src.shape[0]:
    pages = move_pages(pages, b.move_src, b.move_dst)
  has_copies = b.copy_src_block.shape[0] > 0
  n = pages.k.shape[2]
  ids = b.block_ids
  first = last = None
  if scrub:
    before = (ids >= 0) & b.scrub_before
    if b.move_dst.shape[0]:
      before = before & ~jnp.isin(ids, jnp.where(b.move_dst >= 0, b.move_dst, -2))
    first = jnp.where(before, ids, n)
    last = jnp.where((ids >= 0) & b.scrub_after, ids, n)
  zero = lambda p, idx: p.at[:, :, idx].set(jnp.zeros((), p.dtype), mode="drop")
  out = []
  for p in (pages.k, pages.v):
    if has_copies:
      values = _gather_slots(p, b.copy_src_block, b.copy_src_start, b.copy_length)
      # The gather first: the writes below then update the donated pages in place.
      values, p = reads_before_writes(values, p)
    if scrub:
      p = zero(p, first)
    if has_copies:
      p = _scatter_slots(p, values, b.copy_dst_block, b.copy_dst_start, b.copy_length)
    if scrub:
      p = zero(p, last)
    out.append(p)
  return KVPages(k=out[0], v=out[1])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def commit(state: PoolState, batch: PackedCommit, *,
           config: PoolConfig) -> tuple[PoolState, jax.Array]:
  """Applies one packed commit (module docstring) to `state` (donated).

  Returns `(state, mismatch: i32[])`: 0 when the device held what the host
  expected, else bits `MISMATCH_BLOCKS`, `MISMATCH_ROWS`, `MISMATCH_TOTALS`, and
  then nothing is applied.
  """
  n, s = config.num_blocks, config.max_seqs
  meta, table = state.meta, state.table
  b = batch.layout.unpack(batch.buf)
  ids = b.block_ids
  valid = ids >= 0
  cb = jnp.clip(ids, 0, n - 1)
  old_ref = meta.ref_count[cb]
  old_slots = meta.slots[cb]
  dynamic = meta.region[cb] == REGION_DYNAMIC
  bad_blocks = jnp.any(valid & (old_ref != b.old_ref)) | jnp.any(
      valid[:, None] & (old_slots != b.old_slots))
  rows = b.rows
  rvalid = rows >= 0
  cr = jnp.clip(rows, 0, s - 1)
  bad_rows = jnp.any(rvalid & ((table.num_segments[cr] != b.old_num_segments)
                               | (table.seq_len[cr] != b.old_seq_len)
                               | (table.active[cr] != b.old_active)))
  act = table.active
  totals = jnp.stack([meta.num_free, jnp.sum(act, dtype=jnp.int32),
                      jnp.sum(jnp.where(act, table.seq_len, 0), dtype=jnp.int32),
                      jnp.sum(jnp.where(act, table.num_segments, 0), dtype=jnp.int32),
                      state.step])
  bad_totals = b.check_totals & jnp.any(totals != b.expected)
  mismatch = (bad_blocks.astype(jnp.int32) * MISMATCH_BLOCKS
              + bad_rows.astype(jnp.int32) * MISMATCH_ROWS
              + bad_totals.astype(jnp.int32) * MISMATCH_TOTALS)
  # The reads above first: the scatters below then update the donated arrays in place.
  (old_ref, dynamic, mismatch), state = reads_before_writes((old_ref, dynamic, mismatch), state)
  meta, table = state.meta, state.table
  # All or nothing: on a mismatch every id becomes padding (the scatters drop it).
  ok = mismatch == 0
  drop = lambda x: jnp.where(ok, x, -1)
  b = dataclasses.replace(
      b, block_ids=drop(b.block_ids), rows=drop(b.rows), move_src=drop(b.move_src),
      move_dst=drop(b.move_dst), copy_src_block=drop(b.copy_src_block),
      copy_dst_block=drop(b.copy_dst_block),
      step=jnp.where(ok, jnp.asarray(b.step, jnp.int32), state.step))
  ids, rows = b.block_ids, b.rows
  valid, rvalid = ids >= 0, rows >= 0

  pages = _page_work(state.pages, b, scrub=config.scrub_freed_blocks)

  safe = jnp.where(valid, ids, n)  # out of range: dropped
  new_ref = b.new_ref
  freed = valid & dynamic & (old_ref > 0) & (new_ref == 0)
  taken = valid & dynamic & (old_ref == 0) & (new_ref > 0)
  meta = mark_blocks(meta, ids, jnp.where(freed, 1, jnp.where(taken, -1, 0)))
  live = jnp.where(valid & (new_ref > 0), ids, n)
  meta = dataclasses.replace(
      meta,
      ref_count=meta.ref_count.at[safe].set(new_ref, mode="drop"),
      slots=meta.slots.at[safe].set(b.new_slots, mode="drop"),
      last_use=meta.last_use.at[live].set(b.step, mode="drop"))
  r = jnp.where(rvalid, rows, s)
  table = dataclasses.replace(
      table,
      block=table.block.at[r].set(b.row_block, mode="drop"),
      start=table.start.at[r].set(b.row_start, mode="drop"),
      length=table.length.at[r].set(b.row_length, mode="drop"),
      num_segments=table.num_segments.at[r].set(b.row_num_segments, mode="drop"),
      seq_len=table.seq_len.at[r].set(b.row_seq_len, mode="drop"),
      active=table.active.at[r].set(b.row_active, mode="drop"))
  state = dataclasses.replace(state, pages=pages, meta=meta, table=table,
                              step=jnp.asarray(b.step, jnp.int32))
  return state, mismatch
