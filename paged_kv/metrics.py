"""Pool metrics computed from the state: one snapshot dataclass.

All quantities are derived from `PoolState` (plus counters the caller keeps,
such as OOMs by reason); nothing here is stored twice.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_kv.config import PoolConfig
from paged_kv.state import REGION_DYNAMIC, PoolState


def largest_free_run(free: np.ndarray) -> int:
  """Length of the longest run of consecutive True entries of `free`."""
  if not free.any():
    return 0
  padded = np.concatenate([[False], free, [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])
  return int((edges[1::2] - edges[::2]).max())


def fragmentation_ratio(free: np.ndarray) -> float:
  """1 - largest contiguous free run / total free blocks (0 when nothing is free)."""
  total = int(free.sum())
  return 0.0 if total == 0 else 1.0 - largest_free_run(free) / total


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
  """Memory metrics of a pool at one instant (names as in DESIGN.md)."""

  num_blocks: int
  num_free_blocks: int
  block_pool_utilization: float        # used blocks / all blocks
  internal_fragmentation: float        # 1 - used slots / slots of used blocks
  fragmentation_ratio: float           # dynamic region: 1 - largest free run / free blocks
  largest_contiguous_free_bytes: int
  segments_per_sequence: float         # mean over live sequences
  live_sequences: int
  live_tokens: int
  ghost_block_bytes: int               # unreferenced but not reusable: 0 by construction


def snapshot(state: PoolState, config: PoolConfig) -> PoolSnapshot:
  """Computes a `PoolSnapshot` on the host from the device state."""
  meta = jax.tree.map(np.asarray, state.meta)
  table = jax.tree.map(np.asarray, state.table)
  n, bs = config.num_blocks, config.block_size
  used = meta.ref_count > 0
  i = np.arange(bs)
  bits = (meta.slots[:, i // 32] >> (i % 32).astype(np.uint32)) & 1
  used_slots = int(bits[used].sum())
  dyn_free = (~used) & (meta.region == REGION_DYNAMIC)
  in_list = np.zeros(n, bool)
  nf = int(meta.num_free)
  if nf:
    in_list[meta.free_list[n - nf:]] = True
  ghosts = int(np.sum(dyn_free & ~in_list))
  active = table.active
  num_live = int(active.sum())
  return PoolSnapshot(
      num_blocks=n,
      num_free_blocks=int((~used).sum()),
      block_pool_utilization=float(used.mean()),
      internal_fragmentation=0.0 if not used.any() else 1.0 - used_slots / (int(used.sum()) * bs),
      fragmentation_ratio=fragmentation_ratio(dyn_free),
      largest_contiguous_free_bytes=largest_free_run(dyn_free) * config.block_bytes,
      segments_per_sequence=float(table.num_segments[active].mean()) if num_live else 0.0,
      live_sequences=num_live,
      live_tokens=int(table.seq_len[active].sum()),
      ghost_block_bytes=ghosts * config.block_bytes,
  )
