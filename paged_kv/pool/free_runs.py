"""`FreeRuns`: the longest run of free blocks, kept up to date in O(words changed * log).

A binary segment tree over the free bitmap's 32-bit words (`HostFreeIndex.bits`).
Each node covers consecutive words and stores the run of set bits at its low end
(`pre`), at its high end (`suf`), the longest run inside it (`best`), whether it
is all set (`full`) and its width in bits (`width`). Two neighbours combine as

    pre  = L.pre + R.pre if L.full else L.pre
    suf  = R.suf + L.suf if R.full else R.suf
    best = max(L.best, R.best, L.suf + R.pre)

so the root's `best` is the pool's largest free run. Marking blocks dirties their
words; `largest()` recomputes those leaves and their ancestors (one vectorised
pass per level), never the whole bitmap: the scheduler's per-step figures and
compaction trigger stay flat in the pool size.
"""

from __future__ import annotations

import numpy as np

_F = 32


def _low_ones(w: np.ndarray) -> np.ndarray:
  """Consecutive set bits from bit 0 of each `u32` word (32 for a full word)."""
  inv = ~w
  low = inv & (np.uint32(0) - inv)  # lowest clear bit, 0 for a full word
  out = np.full(w.shape, 32, np.int64)
  nz = low != 0
  out[nz] = np.log2(low[nz].astype(np.float64)).astype(np.int64)
  return out


def _reverse(w: np.ndarray) -> np.ndarray:
  b = np.unpackbits(np.ascontiguousarray(w, dtype="<u4").view(np.uint8), bitorder="little")
  return np.packbits(b.reshape(-1, _F)[:, ::-1], bitorder="little").view("<u4").astype(np.uint32)


def _inner(w: np.ndarray) -> np.ndarray:
  """Longest run of set bits inside each word (at most 32 vector steps)."""
  x = w.copy()
  length = np.zeros(w.shape, np.int64)
  while True:
    nz = x != 0
    if not nz.any():
      return length
    length[nz] += 1
    x = x & (x >> np.uint32(1))


class FreeRuns:
  """The segment tree of runs over `bits` (see the module docstring)."""

  def __init__(self, bits: np.ndarray):
    w = bits.shape[0]
    self.sizes = [w]
    while self.sizes[-1] > 1:
      self.sizes.append((self.sizes[-1] + 1) // 2)
    # Level arrays, each one longer than needed: the extra node is the identity
    # (full, width 0), which pads an odd level.
    self.pre = [np.zeros(s + 1, np.int64) for s in self.sizes]
    self.suf = [np.zeros(s + 1, np.int64) for s in self.sizes]
    self.best = [np.zeros(s + 1, np.int64) for s in self.sizes]
    self.full = [np.zeros(s + 1, bool) for s in self.sizes]
    self.width = [np.zeros(s + 1, np.int64) for s in self.sizes]
    for level, s in enumerate(self.sizes):
      self.full[level][s] = True
    self._dirty: list[np.ndarray] = []
    self._leaves(bits, np.arange(w))
    for level in range(1, len(self.sizes)):
      self._combine(level, np.arange(self.sizes[level]))

  def _leaves(self, bits: np.ndarray, idx: np.ndarray) -> None:
    w = bits[idx]
    self.pre[0][idx] = _low_ones(w)
    self.suf[0][idx] = _low_ones(_reverse(w))
    self.best[0][idx] = _inner(w)
    self.full[0][idx] = w == np.uint32(0xFFFFFFFF)
    self.width[0][idx] = _F

  def _combine(self, level: int, idx: np.ndarray) -> None:
    below = level - 1
    left = 2 * idx
    right = np.minimum(2 * idx + 1, self.sizes[below])  # past the end: the identity node
    lp, ls, lb, lf, lw = (a[below][left] for a in (self.pre, self.suf, self.best, self.full,
                                                    self.width))
    rp, rs, rb, rf, rw = (a[below][right] for a in (self.pre, self.suf, self.best, self.full,
                                                     self.width))
    self.pre[level][idx] = np.where(lf, lw + rp, lp)
    self.suf[level][idx] = np.where(rf, rw + ls, rs)
    self.best[level][idx] = np.maximum(np.maximum(lb, rb), ls + rp)
    self.full[level][idx] = lf & rf
    self.width[level][idx] = lw + rw

  def dirty(self, words: np.ndarray) -> None:
    """Words whose bits changed (recomputed at the next `largest`)."""
    self._dirty.append(np.asarray(words, np.int64))

  def largest(self, bits: np.ndarray) -> int:
    """The longest run of set bits of `bits` (the tree's words, after the marks)."""
    if self._dirty:
      idx = np.unique(np.concatenate(self._dirty))
      self._dirty = []
      self._leaves(bits, idx)
      for level in range(1, len(self.sizes)):
        idx = np.unique(idx // 2)
        self._combine(level, idx)
    return int(self.best[-1][0])
