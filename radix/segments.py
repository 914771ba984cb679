"""Segments, the KV layout the cache holds, and the reference deltas it returns.

A segment is a row ``(block, start, length)`` of an ``int32[n, 3]`` array
(``Segments``), ``start + length <= block_size``: the layout ``paged_kv``'s
``BlockPool.segments()`` returns. Cutting inside a segment splits it in two on the
same block without copying KV: one more segment, one more reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from radix.tree import RadixTreeError

__all__ = [
    "InvalidSegmentsError",
    "RefCountMismatchError",
    "RefDeltas",
    "Segments",
    "as_segments",
    "cut",
    "split_point",
]

# `RefDeltas.from_pairs` of at most this many entries sums them in a dict.
SMALL_PAIRS = 64
# Segment arrays of at most this many rows are checked and walked in plain Python.
SMALL_SEGMENTS = 64

EMPTY_SEGMENTS = np.zeros((0, 3), np.int32)
EMPTY_IDS = np.zeros((0,), np.int32)
_I32 = np.iinfo(np.int32)
_EXPECTED = "an int32[n, 3] array of (block, start, length) rows"

Segments = npt.NDArray[np.int32]
"""``int32[n, 3]`` rows ``(block, start, length)`` (see the module docstring)."""


class InvalidSegmentsError(RadixTreeError, ValueError):
  """Segments are malformed or do not cover the tokens given with them."""


class RefCountMismatchError(RadixTreeError, ValueError):
  """A ref_count / remap array disagrees with the references the tree holds."""


def as_segments(segments: Any, *, block_size: int, name: str = "segments") -> Segments:
  """Validates segments; returns them as a C-contiguous ``int32[n, 3]`` array.

  The layout check of ``paged_kv.core.segment_format.as_segments`` (a test keeps the
  two in agreement) plus the bounds of a ``block_size`` block; ``[]`` is no segment.

  Raises:
    InvalidSegmentsError: not ``[n, 3]`` integers within int32 (a tuple of three
      columns is named), negative block or start, length < 1, or past the block.
  """
  if (type(segments) is np.ndarray and segments.dtype == np.int32 and segments.ndim == 2
      and segments.shape[1] == 3 and 0 < segments.shape[0] <= SMALL_SEGMENTS
      and segments.flags.c_contiguous):
    # What the pool hands out: the bounds checked row by row, no conversion.
    rows = segments.tolist()
    if any(b < 0 for b, _, _ in rows):
      raise InvalidSegmentsError(f"{name}: segment block ids must be >= 0")
    if any(st < 0 or ln < 1 or st + ln > block_size for _, st, ln in rows):
      raise InvalidSegmentsError(
          f"every segment needs start >= 0, length >= 1, start + length <= "
          f"block_size={block_size}"
      )
    return segments
  if isinstance(segments, tuple) and len(segments) == 3 and all(
      getattr(x, "ndim", None) == 1 for x in segments):
    shapes = ", ".join(str(tuple(x.shape)) for x in segments)
    raise InvalidSegmentsError(
        f"{name} must be {_EXPECTED}; got a tuple of three 1-D arrays ({shapes}), the "
        f"column layout: pass np.stack([block, start, length], axis=1)")
  try:
    arr = np.asarray(segments)
  except (TypeError, ValueError) as e:
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got "
                               f"{type(segments).__name__} ({e})") from e
  if (arr.ndim == 1 and arr.size == 0) or arr.shape == (0, 3):
    return EMPTY_SEGMENTS.copy()
  if arr.ndim != 2 or arr.shape[1] != 3:
    hint = (" (three columns? pass np.stack([block, start, length], axis=1))"
            if arr.ndim == 2 and arr.shape[0] == 3 else "")
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got shape {tuple(arr.shape)} "
                               f"{arr.dtype}{hint}")
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got shape {tuple(arr.shape)} "
                               f"{arr.dtype}")
  if arr.min() < _I32.min or arr.max() > _I32.max:
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got values outside int32 "
                               f"({arr.min()}..{arr.max()})")
  blocks, starts, lens = arr[:, 0], arr[:, 1], arr[:, 2]
  if (blocks < 0).any():
    raise InvalidSegmentsError(f"{name}: segment block ids must be >= 0")
  if (starts < 0).any() or (lens < 1).any() or (starts + lens > block_size).any():
    raise InvalidSegmentsError(
        f"every segment needs start >= 0, length >= 1, start + length <= "
        f"block_size={block_size}"
    )
  return np.ascontiguousarray(arr, dtype=np.int32)


def split_point(segs: np.ndarray, offset: int) -> tuple[int, int]:
  """``(i, begin)``: the segments wholly within the first ``offset`` tokens and the
  tokens they cover (``segs`` int32[n, 3])."""
  if segs.shape[0] <= SMALL_SEGMENTS:
    i = begin = 0
    for length in segs[:, 2].tolist():
      if begin + length > offset:
        break
      begin += length
      i += 1
    return i, begin
  ends = np.cumsum(segs[:, 2], dtype=np.int64)
  i = int(np.searchsorted(ends, offset, side="right"))
  return i, int(ends[i - 1]) if i > 0 else 0


def cut(segs: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray, bool]:
  """Splits ``segs`` (int32[n, 3]) after ``offset`` tokens: (head, tail, cut_made)."""
  i, begin = split_point(segs, offset)
  if begin == offset:
    return segs[:i], segs[i:], False
  k = offset - begin
  b, s, l = (int(x) for x in segs[i])
  head = np.concatenate([segs[:i], np.array([[b, s, k]], np.int32)])
  tail = np.concatenate([np.array([[b, s + k, l - k]], np.int32), segs[i + 1 :]])
  return head, tail, True


@dataclasses.dataclass(frozen=True)
class RefDeltas:
  """Reference-count changes for the pool: ``ref_count[block_ids] += deltas``.

  ``block_ids`` int32[k] unique and ascending; ``deltas`` int32[k], nonzero.
  """

  block_ids: np.ndarray
  deltas: np.ndarray

  @staticmethod
  def empty() -> RefDeltas:
    return RefDeltas(EMPTY_IDS.copy(), EMPTY_IDS.copy())

  @staticmethod
  def from_pairs(block_ids: Any, deltas: Any) -> RefDeltas:
    """Aggregates (possibly repeated) block ids with their deltas."""
    block_ids = np.asarray(block_ids, np.int64).reshape(-1)
    if block_ids.size == 0:
      return RefDeltas.empty()
    deltas = np.asarray(deltas, np.int64)
    if block_ids.size <= SMALL_PAIRS:  # a few (an insert, an eviction): a dict, no sort of arrays
      acc: dict[int, int] = {}
      if deltas.ndim == 0:
        d = int(deltas)
        for b in block_ids.tolist():
          acc[b] = acc.get(b, 0) + d
      else:
        for b, d in zip(block_ids.tolist(), np.broadcast_to(deltas, block_ids.shape).tolist()):
          acc[b] = acc.get(b, 0) + d
      keys = [b for b in sorted(acc) if acc[b]]
      return RefDeltas(np.array(keys, np.int32), np.array([acc[b] for b in keys], np.int32))
    deltas = np.broadcast_to(deltas, block_ids.shape)
    uniq, inv = np.unique(block_ids, return_inverse=True)
    summed = np.bincount(inv, weights=deltas, minlength=uniq.size).astype(np.int64)
    keep = summed != 0
    return RefDeltas(uniq[keep].astype(np.int32), summed[keep].astype(np.int32))

  @staticmethod
  def increfs(block_ids: np.ndarray) -> RefDeltas | None:
    """+1 on each of ``block_ids`` when they are distinct (a new leaf's segments), without
    ``from_pairs``' sums; None when a block repeats.
    """
    ids = block_ids.tolist()
    if len(set(ids)) != len(ids):
      return None
    return RefDeltas(np.sort(block_ids).astype(np.int32, copy=False), np.ones(len(ids), np.int32))

  def __add__(self, other: RefDeltas) -> RefDeltas:
    return RefDeltas.from_pairs(
        np.concatenate([self.block_ids, other.block_ids]),
        np.concatenate([self.deltas, other.deltas]),
    )

  def __len__(self) -> int:
    return int(self.block_ids.shape[0])

  @property
  def total(self) -> int:
    """Net change in the number of references (sum of deltas)."""
    return int(self.deltas.sum(dtype=np.int64))

  def apply_to(self, ref_count: np.ndarray) -> None:
    """Applies the deltas in place to a host ``ref_count`` array (for simulators)."""
    np.add.at(ref_count, self.block_ids, self.deltas)

