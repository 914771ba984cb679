"""The host copy of the free index, in the device's layout (`BlockMeta`'s).

`bits: u32[ceil(n / 32)]` (bit `b % 32` of word `b // 32` set iff block `b` is a
free dynamic block), `counts` (level `l >= 1`: free blocks per `32**(l + 1)`
blocks) and `num_free`, so the mirror compares with the device bit for bit.
`lowest(k)` (the k lowest free blocks, what the device's `take_blocks` hands
out), `mark(blocks, delta)` and `largest_run()` (`free_runs.FreeRuns`) cost O(k)
numpy work plus one pass over count level 1, never a pass over the blocks.

A call that takes or frees at most `SMALL_BLOCKS` blocks runs in plain Python
from a hint (`_low`: no word below it has a free bit), where numpy's per-call
cost would dominate, and falls back to the vectorised code when the words after
the hint hold too few free blocks; both give the same results
(`tests/pool/test_small_paths.py`).
"""

from __future__ import annotations

import numpy as np

from paged_kv.core.state import FREE_FANOUT, free_index_levels
from paged_kv.pool.free_runs import FreeRuns

_F = FREE_FANOUT
_BIT = np.uint32(1) << np.arange(_F, dtype=np.uint32)
# `lowest` / `mark` of at most this many blocks take the plain-Python paths, which
# read at most this many words after the hint.
SMALL_BLOCKS = 64


def _unpack(words: np.ndarray) -> np.ndarray:
  """`bool[len(words) * 32]`: the bits of `u32` words, bit 0 of word 0 first."""
  return np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8),
                       bitorder="little").astype(bool)


class HostFreeIndex:
  """Free dynamic blocks of a pool of `num_blocks` blocks, in the device's layout.

  Attributes:
    num_blocks: pool size.
    bits: `u32[ceil(num_blocks / 32)]` the free bitmap.
    counts: `i32[...]` the count levels above it (at least one entry).
    num_free: free dynamic blocks.
  """

  def __init__(self, num_blocks: int, bits: np.ndarray, counts: np.ndarray, num_free: int):
    self.num_blocks = int(num_blocks)
    self.sizes, self.offsets = free_index_levels(self.num_blocks)
    self.bits = np.array(bits, np.uint32)
    self.counts = np.array(counts, np.int32)
    self.num_free = int(num_free)
    self._runs: FreeRuns | None = None  # built on the first `largest_run`
    self._low = 0  # a word index: no word below it has a free bit

  @classmethod
  def from_mask(cls, free: np.ndarray) -> "HostFreeIndex":
    """The index of `free: bool[n]` (O(n); what `build_free_index` computes on device)."""
    free = np.asarray(free, bool)
    n = free.shape[0]
    sizes, _ = free_index_levels(n)
    padded = np.zeros(sizes[0] * _F, bool)
    padded[:n] = free
    bits = np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32)
    level = padded.reshape(sizes[0], _F).sum(axis=1, dtype=np.int64)
    counts = []
    for size in sizes[1:]:
      grown = np.zeros(size * _F, np.int64)
      grown[:level.size] = level
      level = grown.reshape(size, _F).sum(axis=1)
      counts.append(level)
    counts = np.concatenate(counts).astype(np.int32) if counts else np.zeros(1, np.int32)
    return cls(n, bits, counts, int(free.sum()))

  def copy(self) -> "HostFreeIndex":
    return HostFreeIndex(self.num_blocks, self.bits, self.counts, self.num_free)

  def mask(self) -> np.ndarray:
    """`bool[num_blocks]`: the free blocks (O(n))."""
    return _unpack(self.bits)[:self.num_blocks]

  def lowest(self, k: int) -> np.ndarray:
    """`i64[k]`: the `k` lowest free blocks, ascending (`k <= num_free`)."""
    k = int(k)
    if k <= 0:
      return np.zeros((0,), np.int64)
    if k > self.num_free:
      raise ValueError(f"{k} blocks wanted, {self.num_free} free")
    if k <= SMALL_BLOCKS:
      out = self._lowest_small(k)
      if out is not None:
        return out
    return self._lowest_general(k)

  def _lowest_small(self, k: int) -> np.ndarray | None:
    """`lowest(k)` in plain Python over the words from the hint on; None when the
    `SMALL_BLOCKS` words after the first non-empty one hold fewer than `k` free
    blocks (the general path then decides). Moves the hint up to that word."""
    bits = self.bits
    w = self._low
    if w >= bits.shape[0] or not bits[w]:
      nz = np.flatnonzero(bits[w:w + SMALL_BLOCKS])
      if not nz.size:
        self._low = min(w + SMALL_BLOCKS, bits.shape[0])  # those words are all empty
        return None
      w += int(nz[0])
    self._low = w
    out = []
    for x in bits[w:w + SMALL_BLOCKS].tolist():
      base = w << 5
      while x:
        low = x & -x
        out.append(base + low.bit_length() - 1)
        if len(out) == k:
          return np.array(out, np.int64)
        x ^= low
      w += 1
    return None

  def _lowest_general(self, k: int) -> np.ndarray:
    """`lowest(k)` by the count levels (`1 <= k <= num_free`)."""
    if k == 1:  # the lowest free block: descend the count levels to its word
      g = 0
      for level in range(len(self.sizes) - 1, 0, -1):
        off = self.offsets[level]
        lo = off + g * _F
        g = g * _F + int(np.flatnonzero(self.counts[lo:min(lo + _F, off + self.sizes[level])])[0])
      lo = g * _F
      word = lo + int(np.flatnonzero(self.bits[lo:lo + _F])[0])
      w = int(self.bits[word])
      return np.array([word * _F + (w & -w).bit_length() - 1], np.int64)
    if len(self.sizes) == 1:  # one level of words: unpack them all (n <= 1024)
      return np.flatnonzero(_unpack(self.bits))[:k].astype(np.int64)
    level1 = self.counts[self.offsets[1]:self.offsets[1] + self.sizes[1]]
    groups = np.flatnonzero(level1)  # groups of 32 words holding a free block
    cum = np.cumsum(level1[groups], dtype=np.int64)
    last = int(np.searchsorted(cum, k))  # the group holding the k-th free block
    found = []
    for g in groups[:last + 1]:
      words = self.bits[g * _F:(g + 1) * _F]
      found.append(np.flatnonzero(_unpack(words)) + g * _F * _F)
    return np.concatenate(found)[:k].astype(np.int64)

  def mark(self, blocks: np.ndarray, delta: int) -> None:
    """Marks distinct blocks free (`delta=+1`, they were taken) or taken (`-1`, free)."""
    b = np.asarray(blocks, np.int64).reshape(-1)
    if b.size == 0:
      return
    if b.size <= SMALL_BLOCKS:
      self._mark_small(b.tolist(), delta)
    else:
      self._mark_general(b, delta)
    self.num_free += int(delta) * int(b.size)

  def _mark_small(self, blocks: list[int], delta: int) -> None:
    """`mark` of a few distinct blocks in plain Python: one xor per word touched,
    one add per count entry touched (a word's blocks are counted by its popcount)."""
    bits, counts = self.bits, self.counts
    if len(blocks) == 1:
      x = blocks[0]
      w = x >> 5
      bits[w] = int(bits[w]) ^ (1 << (x & 31))
      for level in range(1, len(self.sizes)):
        counts[self.offsets[level] + (w >> (5 * level))] += delta
      if delta > 0 and w < self._low:
        self._low = w
      if self._runs is not None:
        self._runs.dirty(np.array([w], np.int64))
      return
    per_word: dict[int, int] = {}
    for x in blocks:
      w = x >> 5
      per_word[w] = per_word.get(w, 0) | (1 << (x & 31))
    for w, m in per_word.items():
      bits[w] = int(bits[w]) ^ m
    for level in range(1, len(self.sizes)):
      off, shift = self.offsets[level], 5 * level
      per_group: dict[int, int] = {}
      for w, m in per_word.items():
        g = w >> shift
        per_group[g] = per_group.get(g, 0) + m.bit_count()
      for g, c in per_group.items():
        counts[off + g] += delta * c
    if delta > 0:
      self._low = min(self._low, min(per_word))
    if self._runs is not None:
      self._runs.dirty(np.fromiter(per_word, np.int64, len(per_word)))

  def _mark_general(self, b: np.ndarray, delta: int) -> None:
    """`mark` by `ufunc.at` and a bincount per count level (`b`: `i64`, distinct)."""
    np.bitwise_xor.at(self.bits, b // _F, _BIT[b % _F])
    for level in range(1, len(self.sizes)):
      size = self.sizes[level]
      off = self.offsets[level]
      # A count per group of 32**(level+1) blocks: n / 1024 entries at most.
      self.counts[off:off + size] += delta * np.bincount(b // _F ** (level + 1),
                                                         minlength=size).astype(np.int32)
    if delta > 0:
      self._low = min(self._low, int(b.min()) >> 5)
    if self._runs is not None:
      self._runs.dirty(b // _F)

  def largest_run(self) -> int:
    """The longest run of free blocks: O(words changed * log(words)) per call
    (`FreeRuns`, a segment tree over the bitmap's words)."""
    if self._runs is None:
      self._runs = FreeRuns(self.bits)
    return min(self._runs.largest(self.bits), self.num_blocks)
