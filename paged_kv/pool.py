"""`BlockPool`: the host API. A thin wrapper over the jitted transitions.

It validates arguments on the host, calls the transition with `atomic=True`,
and turns a failure status into a typed exception. A refused call leaves the
pool exactly as it was (the jitted transition applied nothing). Batches are
padded to powers of two so the number of compilations stays small.
"""

from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import alloc, compact, kv, regions, segments, slots
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import (OOM_REASONS, InvalidArgument, InvalidBlock, InvalidSegment,
                             InvalidSequence, PoolExhausted, RefCountUnderflow, Status)
from paged_kv.core.invariants import check_invariants
from paged_kv.core.segment_format import Segments, as_segments, empty_segments
from paged_kv.core.state import PoolState, SegmentTable, init_pool


def _bucket(x: int) -> int:
  """Smallest power of two >= max(x, 1)."""
  return 1 << max(int(x) - 1, 0).bit_length()


def _pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full((size,) + a.shape[1:], fill, np.int32)
  out[:a.shape[0]] = a
  return out


_I32 = np.iinfo(np.int32)


def _as_int_array(x, name: str) -> np.ndarray:
  """A 1-D int64 copy of `x`; refuses non-integers and values outside int32."""
  a = np.asarray(x)
  if a.ndim == 0:
    a = a[None]
  if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
    raise InvalidArgument(f"{name} must be a 1-D array of ints, got {a.dtype} {a.shape}")
  a = a.astype(np.int64)
  if a.size and (a.min() < _I32.min or a.max() > _I32.max):
    raise InvalidArgument(f"{name} has values outside int32: {a.min()}..{a.max()}")
  return a


def raise_for_status(status: np.ndarray, what: str) -> None:
  """Raises the typed exception for the first failed entry of `status`."""
  status = np.asarray(status)
  bad = np.nonzero((status != Status.OK) & (status != Status.ABORTED))[0]
  if bad.size == 0:
    return
  i = int(bad[0])
  code = Status(int(status[i]))
  msg = f"{what}: entry {i} failed with {code.name}; nothing was applied"
  if code in OOM_REASONS:
    raise PoolExhausted(msg, reason=OOM_REASONS[code])
  raise {Status.INVALID_SEQUENCE: InvalidSequence, Status.INVALID_COUNT: InvalidArgument,
         Status.INVALID_BLOCK: InvalidBlock, Status.REF_UNDERFLOW: RefCountUnderflow,
         Status.INVALID_SEGMENT: InvalidSegment}[code](msg)


class BlockPool:
  """A block pool with a host-side API raising typed exceptions.

  Example:
    pool = BlockPool(PoolConfig(num_blocks=1024, block_size=16, num_layers=2,
                                num_kv_heads=2, head_dim=64))
    seq = pool.open_sequence()
    slots = pool.reserve_tokens([seq], [5])      # i32[1, 8], -1 padded
    pool.write_kv(0, slots[:, :5], k, v)         # k, v: [1, 5, kv_heads, head_dim]
    child = pool.fork(seq)
    pool.release([seq, child])

  The current `PoolState` is `pool.state`; it may also be passed to the jitted
  transitions directly (they donate it, so reassign `pool.state` afterwards).

  Segments in and out (`segments`, `open_sequence(segments=)`,
  `pack_slots(extra_segments=)`, `reclaim_slots`, `check_invariants`) are
  `Segments`: `int32[n, 3]` rows `(block, start, length)`, the format of
  `radix.PrefixCache` too. A pool shared with a prefix cache is driven through
  `paged_kv.serving.cached_pool.CachedPool`, which applies the cache's references.
  """

  def __init__(self, config: PoolConfig, state: PoolState | None = None):
    self.config = config
    self.state = init_pool(config) if state is None else state

  # -- queries -------------------------------------------------------------
  @property
  def num_free_blocks(self) -> int:
    return int(self.state.meta.num_free)

  def active_sequences(self) -> np.ndarray:
    return np.nonzero(np.asarray(self.state.table.active))[0]

  def _check_ids(self, ids: np.ndarray, *, active: bool | None) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= self.config.max_seqs):
      raise InvalidSequence(f"sequence ids {ids.tolist()} outside [0, {self.config.max_seqs})")
    if len(set(ids.tolist())) != ids.size:
      raise InvalidSequence(f"repeated sequence ids in {ids.tolist()}")
    if active is not None and ids.size:
      act = np.asarray(self.state.table.active)[ids]
      if not (act == active).all():
        bad = ids[act != active].tolist()
        raise InvalidSequence(f"sequences {bad} are {'not ' if active else ''}active")

  def seq_len(self, seq_id: int) -> int:
    self._check_ids(_as_int_array(seq_id, "seq_id"), active=True)
    return int(self.state.table.seq_len[seq_id])

  def segments(self, seq_id: int) -> Segments:
    """`i32[n, 3]` `(block, start, length)` rows of one live sequence, in token order.

    The row is read at its fixed shape (one jitted gather, one device->host
    transfer) and sliced on the host, so no segment count compiles anything new.
    """
    self._check_ids(_as_int_array(seq_id, "seq_id"), active=True)
    rows, ns = jax.device_get(_table_row(self.state.table, np.int32(seq_id)))
    return np.ascontiguousarray(rows[:int(ns)])

  def gather_kv(self, seq_id: int) -> tuple[jax.Array, jax.Array]:
    """Logical `k, v: [num_layers, num_kv_heads, seq_len, head_dim]` of one sequence."""
    length = self.seq_len(seq_id)
    k, v, _ = kv.gather_kv(self.state, seq_id, max_len=_bucket(length))
    return k[:, :, :length], v[:, :, :length]

  def check_invariants(self, extra_segments: Segments | None = None) -> None:
    """Raises `InvariantViolation` unless the state is consistent.

    Args:
      extra_segments: `i32[n, 3]` `(block, start, length)` rows held outside the
        tables (one reference each, e.g. a prefix cache's); None: only the tables
        hold references. A `CachedPool` passes its cache's by default.
    """
    check_invariants(self.state, extra_segments)

  # -- transitions ---------------------------------------------------------
  def open_sequence(self, segments: Segments | None = None,
                    seq_id: int | None = None) -> int:
    """Activates a row (the lowest free one unless `seq_id` is given).

    Args:
      segments: `i32[n, 3]` `(block, start, length)` rows of a shared prefix (e.g. a
        `PrefixCache.match`'s `segments`), each gaining a reference; they must lie
        on live blocks and written slots. None or empty: an empty sequence.
      seq_id: the row to open; default the lowest free one.

    Returns:
      The row.

    Raises:
      InvalidSegmentLayout: `segments` is not `i32[n, 3]`.
      InvalidBlock / InvalidSegment: a segment off a live block or on unwritten slots.
      PoolExhausted: no free row, or more than `max_segments` segments.
      InvalidSequence: `seq_id` out of range or active.
    """
    segs = empty_segments() if segments is None else as_segments(segments)
    active = np.asarray(self.state.table.active)
    if seq_id is None:
      free = np.nonzero(~active)[0]
      if free.size == 0:
        raise PoolExhausted(f"all {self.config.max_seqs} sequence rows are in use",
                            reason="no_free_row")
      seq_id = int(free[0])
    self._check_ids(_as_int_array(seq_id, "seq_id"), active=False)
    blk, start, length = segs[:, 0], segs[:, 1], segs[:, 2]
    p = len(blk)
    if p > self.config.max_segments:
      raise PoolExhausted(f"{p} segments > max_segments {self.config.max_segments}",
                          reason="table_full")
    if p and (blk.min() < 0 or blk.max() >= self.config.num_blocks):
      raise InvalidBlock(f"segment blocks {blk.tolist()} outside [0, {self.config.num_blocks})")
    width = _bucket(p)
    row = lambda a: _pad(a[None].astype(np.int32), 1, 0) if a.size else np.zeros((1, 0), np.int32)
    pad2 = lambda a: np.pad(row(a), ((0, 0), (0, width - p)))
    state, status = segments_open(self.state, seq_id, pad2(blk), pad2(start), pad2(length), p,
                                  self.config)
    self.state = state
    raise_for_status(status, "open_sequence")
    return seq_id

  def reserve_tokens(self, seq_ids, num_new) -> jax.Array:
    """Room for `num_new[i]` more tokens of each sequence; returns `slot_idx i32[B, T]`.

    `T` is `max(num_new)` rounded up to a power of two; entries past `num_new[i]` are -1.
    """
    ids, counts = _as_int_array(seq_ids, "seq_ids"), _as_int_array(num_new, "num_new")
    if ids.shape != counts.shape:
      raise InvalidArgument(f"seq_ids {ids.shape} and num_new {counts.shape} differ in shape")
    self._check_ids(ids, active=True)
    if counts.size and counts.min() < 0:
      raise InvalidArgument(f"num_new must be >= 0, got {counts.tolist()}")
    bs = self.config.block_size
    biggest = int(counts.max()) if counts.size else 0
    need_upper = int(np.sum(-(-counts // bs)))
    if need_upper > self.config.num_blocks:
      raise PoolExhausted(f"the batch needs up to {need_upper} blocks; the pool has "
                          f"{self.config.num_blocks}", reason="no_free_block")
    b = _bucket(ids.size)
    t = _bucket(biggest)
    self.state, (slot_idx, status) = segments.reserve_tokens(
        self.state, _pad(ids, b, -1), _pad(counts, b, 0), config=self.config, max_new_tokens=t,
        atomic=True)
    raise_for_status(np.asarray(status)[:ids.size], "reserve_tokens")
    return slot_idx[:ids.size]

  def write_kv(self, layer: int, slot_idx, k: jax.Array, v: jax.Array) -> None:
    """Writes new tokens' K/V of one layer; `k, v: slot_idx.shape + (kv_heads, head_dim)`."""
    c = self.config
    if not (isinstance(layer, (int, np.integer)) and 0 <= layer < c.num_layers):
      raise InvalidArgument(f"layer {layer!r} outside [0, {c.num_layers})")
    slot_idx = jnp.asarray(slot_idx, jnp.int32)
    want = tuple(slot_idx.shape) + (c.num_kv_heads, c.head_dim)
    for name, x in (("k", k), ("v", v)):
      if tuple(x.shape) != want or x.dtype != c.jnp_dtype:
        raise InvalidArgument(f"write_kv: {name} is {x.dtype}{list(x.shape)}, expected "
                              f"{c.jnp_dtype}{list(want)}")
    s = np.asarray(slot_idx)
    if s.size and (s.min() < -1 or s.max() >= c.num_slots):
      raise InvalidBlock(f"write_kv: slot index outside [-1, {c.num_slots})")
    self.state = _write_state(self.state, jnp.int32(layer), slot_idx, k, v)

  def release(self, seq_ids) -> None:
    """Ends the given live sequences; their blocks lose a reference each."""
    ids = _as_int_array(seq_ids, "seq_ids")
    self._check_ids(ids, active=True)
    self.state, status = segments.release(self.state, _pad(ids, _bucket(ids.size), -1),
                                          config=self.config, atomic=True)
    raise_for_status(np.asarray(status)[:ids.size], "release")

  def fork(self, src: int, dst: int | None = None) -> int:
    """A new sequence sharing every segment of `src`; returns its row."""
    self._check_ids(_as_int_array(src, "src"), active=True)
    if dst is None:
      free = np.nonzero(~np.asarray(self.state.table.active))[0]
      if free.size == 0:
        raise PoolExhausted("no free sequence row for the fork", reason="no_free_row")
      dst = int(free[0])
    self._check_ids(_as_int_array(dst, "dst"), active=False)
    self.state, status = segments.fork(self.state, np.array([src], np.int32),
                                       np.array([dst], np.int32), config=self.config,
                                       atomic=True)
    raise_for_status(status, "fork")
    return dst

  def allocate(self, num: int, contiguous: str = "prefer") -> np.ndarray:
    """`num` blocks owned by the caller (ref_count 1), ascending."""
    if not isinstance(num, (int, np.integer)) or num < 0:
      raise InvalidArgument(f"num must be an int >= 0, got {num!r}")
    if num > self.config.num_blocks:
      raise PoolExhausted(f"{num} blocks requested; the pool has {self.config.num_blocks}",
                          reason="no_free_block")
    self.state, (ids, status) = alloc.allocate(self.state, num, config=self.config,
                                               max_blocks=_bucket(num), contiguous=contiguous)
    raise_for_status(np.asarray(status)[None], "allocate")
    return np.asarray(ids)[:num]

  def apply_ref_deltas(self, block_ids, deltas) -> None:
    """Applies reference changes (e.g. from the prefix cache) atomically."""
    ids, d = _as_int_array(block_ids, "block_ids"), _as_int_array(deltas, "deltas")
    if ids.shape != d.shape:
      raise InvalidArgument(f"block_ids {ids.shape} and deltas {d.shape} differ in shape")
    if ids.size and (ids.min() < 0 or ids.max() >= self.config.num_blocks):
      raise InvalidBlock(f"block ids outside [0, {self.config.num_blocks}): {ids.tolist()}")
    b = _bucket(ids.size)
    self.state, status = alloc.apply_ref_deltas(self.state, _pad(ids, b, -1), _pad(d, b, 0),
                                                config=self.config)
    raise_for_status(np.asarray(status)[:ids.size], "apply_ref_deltas")

  # -- fragmentation (issue B): COW, packing, compaction, regions ---------------
  def cow_split(self, seq_ids) -> np.ndarray:
    """Copies shared/slotted tails into exclusive blocks; returns `bool[B]` split."""
    ids = _as_int_array(seq_ids, "seq_ids")
    self._check_ids(ids, active=True)
    self.state, (split, status) = slots.cow_split(self.state, _pad(ids, _bucket(ids.size), -1),
                                                  config=self.config, atomic=True)
    raise_for_status(np.asarray(status)[:ids.size], "cow_split")
    return np.asarray(split)[:ids.size]

  def pack_slots(self, table_segments=(), extra_segments: Segments = ()) -> "PackResult":
    """Packs short segments into slotted blocks (see `paged_kv.core.slots`).

    Args:
      table_segments: `i32[T, 2]` `(row, col)` pairs naming segments of live
        sequences (positions in the tables, not segments).
      extra_segments: `i32[E, 3]` `(block, start, length)` rows held outside the
        pool (one reference each, e.g. a prefix-cache node's segment).

    Returns:
      A `PackResult`; the references were already transferred by the pool.
    """
    tab = _as_int_array(np.asarray(table_segments).reshape(-1), "table_segments").reshape(-1, 2)
    ext = as_segments(extra_segments, name="extra_segments").astype(np.int64)
    t = jax.tree.map(np.asarray, self.state.table)
    if tab.size:
      self._check_ids(np.unique(tab[:, 0]), active=True)
      if (tab[:, 1] < 0).any() or (tab[:, 1] >= t.num_segments[tab[:, 0]]).any():
        raise InvalidSegment(f"segment columns {tab[:, 1].tolist()} outside the rows' segments")
    if ext.size and (ext[:, 0].min() < 0 or ext[:, 0].max() >= self.config.num_blocks):
      raise InvalidBlock(f"extra segment blocks outside [0, {self.config.num_blocks})")
    k = len(tab) + len(ext)
    owner = np.concatenate([tab[:, 0], np.full(len(ext), slots.OWNER_EXTERNAL)])
    col = np.concatenate([tab[:, 1], np.zeros(len(ext), np.int64)])
    blk = np.concatenate([t.block[tab[:, 0], tab[:, 1]], ext[:, 0]])
    start = np.concatenate([t.start[tab[:, 0], tab[:, 1]], ext[:, 1]])
    length = np.concatenate([t.length[tab[:, 0], tab[:, 1]], ext[:, 2]])
    b = _bucket(k)
    self.state, (new_block, new_start, status) = slots.pack_slots(
        self.state, _pad(owner, b, -1), _pad(col, b, 0), _pad(blk, b, -1), _pad(start, b, 0),
        _pad(length, b, 0), config=self.config, atomic=True)
    raise_for_status(np.asarray(status)[:k], "pack_slots")
    nb, ns = np.asarray(new_block)[:k], np.asarray(new_start)[:k]
    new = np.stack([nb, ns, length], axis=1).astype(np.int32)
    ids = np.concatenate([nb, blk]).astype(np.int64)
    deltas = np.concatenate([np.ones(k, np.int64), -np.ones(k, np.int64)])
    uniq, inv = np.unique(ids, return_inverse=True)
    summed = np.bincount(inv, weights=deltas, minlength=uniq.size).astype(np.int32)
    keep = summed != 0
    return PackResult(table_segments=np.concatenate([tab.astype(np.int32), new[:len(tab)]],
                                                    axis=1),
                      extra_segments=new[len(tab):],
                      ref_deltas=(uniq[keep].astype(np.int32), summed[keep]))

  def reclaim_slots(self, extra_segments: Segments = ()) -> int:
    """Frees slots no live segment covers (see `paged_kv.core.slots.reclaim_slots`).

    `extra_segments` (`i32[n, 3]` `(block, start, length)` rows) must be *every*
    segment held outside the tables; if they do not account for `ref_count`,
    nothing changes and `InvalidSegment` is raised. Returns the slots reclaimed.
    """
    ext = as_segments(extra_segments, name="extra_segments")
    b = _bucket(len(ext))
    self.state, (status, reclaimed) = slots.reclaim_slots(
        self.state, _pad(ext[:, 0], b, 0), _pad(ext[:, 1], b, 0), _pad(ext[:, 2], b, 0),
        config=self.config)
    if int(status) != Status.OK:
      raise InvalidSegment("reclaim_slots: the segments given plus the tables do not account "
                           "for every block's ref_count; nothing was changed")
    return int(reclaimed)

  def compact(self, budget: int = 32, impl: str = "xla") -> np.ndarray:
    """One compaction step of up to `budget` moves; returns `remap i32[num_blocks]`.

    Block ids held outside the tables (a prefix cache's) must follow `remap`;
    a `CachedPool` does that itself.
    """
    if not isinstance(budget, (int, np.integer)) or budget < 1:
      raise InvalidArgument(f"budget must be a positive int, got {budget!r}")
    src, dst = compact.plan_compaction(self.state.meta, budget=int(budget))
    return self.move_blocks(src, dst, impl=impl)

  def move_blocks(self, src, dst, impl: str = "xla") -> np.ndarray:
    """Applies a compaction plan (`compact_permute`); returns `remap i32[num_blocks]`.

    Args:
      src, dst: `i32[M]` a plan from `plan_compaction` / `CompactionPolicy.plan`
        (live sources, free destinations, `-1` padding).
      impl: page copy implementation (`"xla"`, `"pallas"`, `"mosaic"`).

    Raises:
      InvalidBlock: a move the pool refuses; nothing moved.
    """
    self.state, (remap, status) = compact.compact_permute(self.state, src, dst,
                                                          config=self.config, impl=impl)
    raise_for_status(np.asarray(status), "move_blocks")
    return np.asarray(remap)

  def promote(self, min_readers: int, max_moves: int = 8) -> np.ndarray:
    """Moves blocks with >= `min_readers` references into the base pool; returns remap."""
    src, dst = regions.plan_promotion(self.state.meta, int(min_readers), max_moves=max_moves)
    self.state, (remap, status) = regions.promote_blocks(self.state, src, dst,
                                                         config=self.config)
    raise_for_status(np.asarray(status), "promote")
    return np.asarray(remap)

  def resize(self, num_blocks: int) -> None:
    """Shrinks (the cut tail must be free: compact first) or grows the pool."""
    new_config = regions.resized_config(self.config, num_blocks)
    self.state = regions.resize_pool(self.state, config=self.config, new_config=new_config)
    self.config = new_config


@dataclasses.dataclass(frozen=True)
class PackResult:
  """Outcome of `BlockPool.pack_slots`.

  Attributes:
    table_segments: `i32[T, 5]` rows `(row, col, new_block, new_start, length)`.
    extra_segments: `Segments` (`i32[E, 3]`): the new `(block, start, length)` of
      each outside segment, in the order given: the holder rewrites its record to it.
    ref_deltas: `(block_ids, deltas)` the pool already applied (+1 new block,
      -1 old block per moved reference, aggregated); an outside holder's own
      rebind deltas must equal these and must not be applied again.
  """

  table_segments: np.ndarray
  extra_segments: np.ndarray
  ref_deltas: tuple[np.ndarray, np.ndarray]


@jax.jit
def _table_row(table: SegmentTable, seq_id: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(i32[max_segments, 3] rows, i32 num_segments)` of one table row."""
  rows = jnp.stack([table.block[seq_id], table.start[seq_id], table.length[seq_id]], axis=1)
  return rows, table.num_segments[seq_id]


def segments_open(state: PoolState, seq_id: int, blk: np.ndarray, start: np.ndarray,
                  length: np.ndarray, num: int, config: PoolConfig):
  """One-row `open_sequence`, atomic."""
  return segments.open_sequence(state, np.array([seq_id], np.int32), blk, start, length,
                                np.array([num], np.int32), config=config, atomic=True)


@functools.partial(jax.jit, donate_argnames=("state",))
def _write_state(state: PoolState, layer: jax.Array, slot_idx: jax.Array, k: jax.Array,
                 v: jax.Array) -> PoolState:
  return dataclasses.replace(state, pages=kv.write_kv(state.pages, layer, slot_idx, k, v))
