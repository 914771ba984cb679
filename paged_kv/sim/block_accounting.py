"""Block accounting on the host (numpy): the pool model of the simulated replays.

Only what a prefix-cache replay needs of a block pool: a reference count per block
and lowest-address-first allocation, so a one-hour trace replays in seconds.
``engine_replay`` replays through the real ``BlockPool``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BlockAccounting"]


class BlockAccounting:
  """Host block accounting: ref counts, lowest-address-first allocation.

  ``ref_count[b]`` counts segment references (sequences + cache); a block is free iff
  its count is 0. ``num_blocks=None``: unlimited (it grows on demand).
  """

  def __init__(self, num_blocks: int | None, block_size: int):
    if block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {block_size}")
    self.block_size = block_size
    self.unlimited = num_blocks is None
    size = 1 << 16 if num_blocks is None else num_blocks
    self._ref = np.zeros(size, np.int32)
    self._free = np.ones(size, bool)
    self.num_free = size
    self._low = 0  # no free block below this address
    self.peak_used = 0

  @property
  def num_blocks(self) -> int:
    return int(self._ref.shape[0])

  @property
  def ref_count(self) -> np.ndarray:
    """i32[num_blocks] references per block (a view; do not write)."""
    return self._ref

  def _grow(self, need: int) -> None:
    size = self.num_blocks
    new = max(2 * size, size + need)
    self._ref = np.concatenate([self._ref, np.zeros(new - size, np.int32)])
    self._free = np.concatenate([self._free, np.ones(new - size, bool)])
    self.num_free += new - size

  def allocate(self, n: int) -> np.ndarray | None:
    """i32[n] fresh block ids with ref_count 1, or None if not enough free blocks."""
    if n > self.num_free:
      if not self.unlimited:
        return None
      self._grow(n - self.num_free)
    ids = np.zeros((0,), np.int64)
    pos, window = self._low, max(4 * n, 1024)
    while ids.shape[0] < n:
      chunk = np.flatnonzero(self._free[pos : pos + window]) + pos
      ids = np.concatenate([ids, chunk[: n - ids.shape[0]]])
      pos += window
      window *= 2
    self._free[ids] = False
    self._ref[ids] = 1
    self.num_free -= n
    if n:
      self._low = int(ids[-1]) + 1
    self.peak_used = max(self.peak_used, self.num_blocks - self.num_free)
    return ids.astype(np.int32)

  def change_refs(self, block_ids: np.ndarray, deltas: np.ndarray | int) -> None:
    """``ref_count[block_ids] += deltas`` (repeats allowed); frees blocks that reach 0.
    RuntimeError if a count would go below 0."""
    block_ids = np.asarray(block_ids)
    if block_ids.size == 0:
      return
    np.add.at(self._ref, block_ids, deltas)
    after = self._ref[block_ids]
    if (after < 0).any():
      raise RuntimeError("ref_count underflow: the cache's deltas drifted")
    gone = block_ids[after == 0]
    gone = np.unique(gone[~self._free[gone]]) if gone.size else gone
    if gone.size:
      self._free[gone] = True
      self.num_free += int(gone.shape[0])
      self._low = min(self._low, int(gone[0]))

  def fresh_segments(self, num_tokens: int) -> np.ndarray | None:
    """i32[k, 3] ``(block, start, length)`` segments over new blocks for ``num_tokens``;
    None (nothing allocated) when too few blocks are free."""
    bs = self.block_size
    n = -(-num_tokens // bs)
    ids = self.allocate(n)
    if ids is None:
      return None
    segs = np.zeros((n, 3), np.int32)
    segs[:, 0] = ids
    segs[:, 2] = bs
    if n:
      segs[-1, 2] = num_tokens - bs * (n - 1)
    return segs
