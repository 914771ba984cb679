"""Fragmentation work on a `BlockPool` (bound as its methods): tail copies, slot
packing, compaction, promotion into the base region, and resizing (a shrink
cuts a compacted tail).
"""
# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from paged_kv.core import compact as compact_lib
from paged_kv.core import device_memory, regions, slots
from paged_kv.core import resize as resize_lib
from paged_kv.core.errors import BlockInUse, InvalidArgument, InvalidBlock, InvalidSegment, Status
from paged_kv.core.page_copy import BLOCK_MOVE_IMPLS
from paged_kv.core.segment_format import Segments, as_segments
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC
from paged_kv.pool import host_transitions as host_ops
from paged_kv.pool.arguments import (as_int_array, as_int_scalar, bucket, pad, raise_for_status,
                                     single_int)
from paged_kv.pool.changes import ChangeLog

if TYPE_CHECKING:
  from paged_kv.pool.block_pool import BlockPool


@dataclasses.dataclass(frozen=True)
class PackResult:
  """Outcome of `BlockPool.pack_slots`.

  Attributes:
    table_segments: `i32[T, 5]` rows `(row, col, new_block, new_start, length)`.
    extra_segments: `i32[E, 3]` the new `(block, start, length)` of each outside
      segment, in the order given (the holder rewrites its record to it).
    ref_deltas: `(block_ids, deltas)` the pool already applied (+1 new block, -1
      old block per moved reference): an outside holder must not apply them again.
  """

  table_segments: np.ndarray
  extra_segments: np.ndarray
  ref_deltas: tuple[np.ndarray, np.ndarray]


def cow_split(pool: BlockPool, seq_ids, *, skip_exhausted: bool = False) -> np.ndarray:
  """Copies shared/slotted tails into exclusive blocks; returns `bool[B]` split.

  Atomic (`PoolExhausted` unless every copy gets a block) unless
  `skip_exhausted`: then rows are served in order while blocks last.
  """
  i = single_int(seq_ids)
  if i is not None:
    pool._check_id(i, active=True)
    ids = np.array([i], np.int64)
  else:
    ids = as_int_array(seq_ids, "seq_ids")
    pool._check_ids(ids, active=True)
  h = pool.host
  tails = h.block[ids, np.maximum(h.num_segments[ids] - 1, 0)]
  if pool._log.page_conflict(tails, pool._log.free_page_dsts(h), copies=ids.size):
    pool.flush()
  split, status = host_ops.cow_split(h, ids, atomic=not skip_exhausted)
  if skip_exhausted:  # the rows were checked above: only a missing block can fail them
    status = np.where(status == Status.NO_FREE_BLOCK, Status.OK, status)
  raise_for_status(status, "cow_split")
  pool._done()
  return split


def pack_slots(pool: BlockPool, table_segments=(), extra_segments: Segments = (), *,
               groups=None, block_groups=None) -> PackResult:
  """Packs short segments into slotted blocks (`paged_kv.core.slots.pack_slots`).

  Synchronous (the mirror does not model the placement): flushes, reads the
  status, and the mirror reloads.

  Args:
    table_segments: `i32[T, 2]` `(row, col)` positions of live sequences' segments.
    extra_segments: `i32[E, 3]` `(block, start, length)` rows held outside the
      pool (one reference each, e.g. a prefix-cache node's segment).
    groups: `int[T + E]` each segment's group (a tenant, >= 0; table segments
      first), None: all 0.
    block_groups: `int[num_blocks]` each block's group as a destination (-1:
      none), None: all 0. A segment goes only to a block of its group or a fresh one.
  """
  config = pool.config
  try:
    tab_arr = np.asarray(table_segments)
  except (TypeError, ValueError) as e:
    raise InvalidArgument("table_segments must be an int[T, 2] array of (row, col) pairs, "
                          f"got {type(table_segments).__name__}") from e
  if tab_arr.size == 0:
    tab_arr = np.zeros((0, 2), np.int64)
  if tab_arr.ndim != 2 or tab_arr.shape[1] != 2:
    raise InvalidArgument("table_segments must be an int[T, 2] array of (row, col) pairs, "
                          f"got shape {tab_arr.shape}")
  tab = as_int_array(tab_arr.reshape(-1), "table_segments").reshape(-1, 2)
  ext = as_segments(extra_segments, name="extra_segments").astype(np.int64)
  t = pool.host
  if tab.size:
    pool._check_ids(np.unique(tab[:, 0]), active=True)
    if (tab[:, 1] < 0).any() or (tab[:, 1] >= t.num_segments[tab[:, 0]]).any():
      raise InvalidSegment(f"segment columns {tab[:, 1].tolist()} outside the rows' segments")
  if ext.size and (ext[:, 0].min() < 0 or ext[:, 0].max() >= config.num_blocks):
    raise InvalidBlock(f"extra segment blocks outside [0, {config.num_blocks})")
  if ext.size:
    # An outside holder holds ref_count - (table references) on a block: never more
    # extra segments than that (a segment nobody outside holds, or a table's own).
    n = config.num_blocks
    ref = t.ref_count.astype(np.int64)
    outside = ref - t.table_refs
    claimed = np.bincount(ext[:, 0], minlength=n)
    over = np.flatnonzero(claimed > outside)
    if over.size:
      b = int(over[0])
      raise BlockInUse(f"pack_slots: {int(claimed[b])} extra segment(s) on block {b}, but "
                       f"only {max(int(outside[b]), 0)} of its {int(ref[b])} references are "
                       "held outside the tables; nothing was changed")
  k = len(tab) + len(ext)
  owner = np.concatenate([tab[:, 0], np.full(len(ext), slots.OWNER_EXTERNAL)])
  col = np.concatenate([tab[:, 1], np.zeros(len(ext), np.int64)])
  blk = np.concatenate([t.block[tab[:, 0], tab[:, 1]], ext[:, 0]])
  start = np.concatenate([t.start[tab[:, 0], tab[:, 1]], ext[:, 1]])
  length = np.concatenate([t.length[tab[:, 0], tab[:, 1]], ext[:, 2]])
  b = bucket(k)
  seg_group = np.zeros((k,), np.int64) if groups is None else np.asarray(groups, np.int64)
  block_group = (np.zeros((config.num_blocks,), np.int32) if block_groups is None
                 else np.asarray(block_groups, np.int32))
  if seg_group.shape != (k,) or (seg_group < 0).any() or block_group.shape != (
      config.num_blocks,):
    raise InvalidArgument(f"pack_slots: groups must be int[{k}] >= 0 and block_groups "
                          f"int[{config.num_blocks}], got shapes {seg_group.shape}, "
                          f"{block_group.shape}")
  state = pool.state
  pool._state, (new_block, new_start, status) = slots.pack_slots(
      state, pad(owner, b, -1), pad(col, b, 0), pad(blk, b, -1), pad(start, b, 0),
      pad(length, b, 0), pad(seg_group, b, 0), block_group, config=config, atomic=True)
  _synced(pool)
  status, new_block, new_start = jax.device_get((status, new_block, new_start))
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


def _synced(pool: BlockPool) -> None:
  """A transition ran on the device: count it, read its status, reload the mirror."""
  pool.runtime.dispatch("sync")
  pool.runtime.read("status")
  pool._mirror = None


def reclaim_slots(pool: BlockPool, extra_segments: Segments = ()) -> int:
  """Frees slots no live segment covers; returns how many (`core.slots.reclaim_slots`).

  `extra_segments` must be *every* segment held outside the tables, else
  `InvalidSegment` and nothing changes. Synchronous, as `pack_slots`.
  """
  ext = as_segments(extra_segments, name="extra_segments")
  b = bucket(len(ext))
  state = pool.state
  pool._state, (status, reclaimed) = slots.reclaim_slots(
      state, pad(ext[:, 0], b, 0), pad(ext[:, 1], b, 0), pad(ext[:, 2], b, 0),
      config=pool.config)
  _synced(pool)
  status, reclaimed = jax.device_get((status, reclaimed))
  if int(status) != Status.OK:
    raise InvalidSegment("reclaim_slots: the segments given plus the tables do not account "
                         "for every block's ref_count; nothing was changed")
  return int(reclaimed)


def _check_impl(impl) -> str:
  if not isinstance(impl, str) or impl not in BLOCK_MOVE_IMPLS:
    raise InvalidArgument(f"impl must be one of {BLOCK_MOVE_IMPLS}, got {impl!r}")
  return impl


def plan(pool: BlockPool, policy: compact_lib.CompactionPolicy) -> tuple[np.ndarray, np.ndarray]:
  """`(src, dst)`: `policy`'s compaction plan on the mirror (no device work)."""
  h = pool.host
  moves = policy.num_moves(pool.config.num_blocks, pool.config.block_bytes)
  if policy.strategy == "merge":
    return compact_lib.plan_defrag(h.ref_count, h.region, budget=moves)
  return host_ops.plan_compaction(h, budget=moves)


def compact(pool: BlockPool, budget: int = 32, impl: str = "xla", *,
            policy: compact_lib.CompactionPolicy | None = None) -> np.ndarray:
  """One compaction step of up to `budget` moves; returns `remap i32[num_blocks]`.

  Block ids held outside the tables must follow `remap` (a `CachedPool` does).
  `budget` (a positive int, at most `num_blocks // 2` used) is ignored with a
  `policy`; `impl` `"pallas"`/`"mosaic"` moves at once with that kernel
  (synchronously, as `pack_slots`), `"xla"` in the pool's commit.
  """
  impl = _check_impl(impl)
  if policy is not None:
    src, dst = pool.plan(policy)
  else:
    budget = as_int_scalar(budget, "budget", low=1)
    budget = max(1, min(budget, pool.config.num_blocks // 2))
    src, dst = host_ops.plan_compaction(pool.host, budget=budget)
  return _move(pool, src, dst, impl, REGION_DYNAMIC, "move_blocks")


def move_blocks(pool: BlockPool, src, dst, impl: str = "xla") -> np.ndarray:
  """Applies a compaction plan (`compact_permute`); returns `remap i32[num_blocks]`.

  Args:
    src, dst: `i32[M]` a plan from `plan_compaction` / `CompactionPolicy.plan`
      (live sources, free destinations, `-1` padding).
    impl: page copy implementation (`"xla"`, `"pallas"`, `"mosaic"`).

  Raises:
    InvalidArgument: `src`/`dst` not 1-D int arrays of one shape, or a bad `impl`.
    InvalidBlock: a move the pool refuses; nothing moved.
  """
  impl = _check_impl(impl)
  s, d = as_int_array(src, "src"), as_int_array(dst, "dst")
  if s.shape != d.shape:
    raise InvalidArgument(f"src {s.shape} and dst {d.shape} differ in shape")
  return _move(pool, s, d, impl, REGION_DYNAMIC, "move_blocks")


def _move(pool: BlockPool, src, dst, impl: str, dst_region: int, what: str) -> np.ndarray:
  src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
  n = pool.config.num_blocks
  if impl != "xla":  # a kernel: run the device transition itself
    b = bucket(src.size)
    state = pool.state
    fn = compact_lib.compact_permute if dst_region == REGION_DYNAMIC else regions.promote_blocks
    pool._state, (remap, status) = fn(state, pad(src, b, -1), pad(dst, b, -1),
                                      config=pool.config, impl=impl)
    _synced(pool)
    remap, status = jax.device_get((remap, status))
    raise_for_status(status, what)
    return np.asarray(remap)
  live = (src >= 0) | (dst >= 0)
  if live.any() and pool._log.page_conflict(src[src >= 0], dst[dst >= 0], moves=True):
    pool.flush()
  s, d, status = host_ops.move_blocks(pool.host, src, dst, dst_region=dst_region)
  raise_for_status(status, what)
  pool._done()
  return host_ops.remap_of(n, s, d)


def promote(pool: BlockPool, min_readers: int, max_moves: int = 8) -> np.ndarray:
  """Moves blocks with >= `min_readers` references into the base pool; returns remap.

  `max_moves` is clamped to the base pool's size (the plan's static width).
  """
  min_readers = as_int_scalar(min_readers, "min_readers", low=1)
  max_moves = as_int_scalar(max_moves, "max_moves", low=1)
  max_moves = max(1, min(max_moves, pool.config.num_base_blocks))
  src, dst = host_ops.plan_promotion(pool.host, min_readers, max_moves=max_moves)
  return _move(pool, src, dst, "xla", REGION_BASE, "promote")


def resize(pool: BlockPool, num_blocks: int, *, staging: str = "auto") -> resize_lib.ResizeReport:
  """Shrinks (the cut tail must be free: compact first) or grows the pool.

  `staging` (`paged_kv.core.resize`): `"device"` builds the new pages beside the
  old ones; `"host"` copies the kept pages through host memory one layer at a
  time (device peak: the larger pool plus one layer of K); `"auto"` stages only
  when the device lacks room for both. Returns the `ResizeReport`, also kept as
  `last_resize`.

  Raises:
    InvalidArgument: `num_blocks` not an int above the base pool, a size the
      config refuses (the message names the limit), or a bad `staging`.
    InvalidBlock: a block to cut off is still referenced.
    PoolTooLarge: growing needs more memory than the device has free.
    Nothing changed when it raises.
  """
  from paged_kv.pool.block_pool import committed  # pylint: disable=g-import-not-at-top
  config = pool.config
  num_blocks = as_int_scalar(num_blocks, "num_blocks", low=1)
  new_config = regions.resized_config(config, num_blocks)
  staged, budget = resize_lib.plan_staging(config, new_config, staging)
  h = pool.host
  if num_blocks < config.num_blocks:
    tail = h.ref_count[num_blocks:]
    if tail.any():
      live = np.flatnonzero(tail) + num_blocks
      raise InvalidBlock(f"cannot cut blocks [{num_blocks}, {config.num_blocks}): "
                         f"{live.size} still referenced (e.g. {live[:8].tolist()}); "
                         "compact first")
  elif num_blocks > config.num_blocks:
    # The grown pages sit beside the old ones, or (staged) replace them, less one
    # staged layer of K.
    reusable = (config.num_blocks * config.block_bytes * (2 * config.num_layers - 1)
                // (2 * config.num_layers) if staged else 0)
    device_memory.check_fits(new_config, reusable=reusable)
  # A failed staged resize puts the old pages back into this state before it raises.
  with device_memory.allocating(new_config):
    if staged:
      new_state, report = resize_lib.resize_state_staged(
          pool.state, config=config, new_config=new_config, device_budget=budget)
    else:
      new_state, report = resize_lib.resize_state_device(pool.state, config=config,
                                                         new_config=new_config)
  pool._state = committed(new_state)
  pool.runtime.dispatch("sync")
  if report.staged:
    pool.runtime.read("data", 2 * config.num_layers)
  pool._scratch_log = ChangeLog(new_config, rows=False)
  pool._mirror = h.resized(new_config)
  pool.config = new_config
  pool.last_resize = report
  pool._done()
  return report
