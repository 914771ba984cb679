"""The one host-side segment format: `Segments`, an `int32[n, 3]` array of rows.

Row `i` is `(block, start, length)`: the block, its first slot used and the
tokens (`length >= 1`, `start + length <= block_size`); a sequence is its
segments in row order. The device's `SegmentTable` holds the same triples as
padded per-field arrays. `radix.cache.as_segments` repeats `as_segments`'s
layout check (radix cannot import `paged_kv`); a test keeps them in agreement.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from paged_kv.core.errors import InvalidArgument, InvalidSegmentLayout

Segments: TypeAlias = npt.NDArray[np.int32]
"""`i32[n, 3]` rows `(block, start, length)`; see the module docstring."""

SEGMENT_FIELDS = ("block", "start", "length")

_I32 = np.iinfo(np.int32)
_EXPECTED = "an int32[n, 3] array of (block, start, length) rows"


def empty_segments() -> Segments:
  """`i32[0, 3]`: no segment."""
  return np.zeros((0, 3), np.int32)


def _describe(x: Any, arr: np.ndarray | None) -> str:
  if arr is None:
    return type(x).__name__
  return f"shape {tuple(arr.shape)} {arr.dtype}"


def as_segments(segments: Any, *, name: str = "segments") -> Segments:
  """Checks a segment list's layout; returns it as a C-contiguous `i32[n, 3]`.

  Takes numpy, JAX or nested lists. Raises `InvalidSegmentLayout` for a shape
  other than `[n, 3]`, non-integers, values outside int32, or a tuple of three
  1-D arrays.
  """
  if isinstance(segments, tuple) and len(segments) == 3 and all(
      getattr(x, "ndim", None) == 1 for x in segments):
    shapes = ", ".join(str(tuple(x.shape)) for x in segments)
    raise InvalidSegmentLayout(
        f"{name} must be {_EXPECTED}; got a tuple of three 1-D arrays ({shapes}), the "
        f"column layout: pass np.stack([block, start, length], axis=1)")
  try:
    arr = np.asarray(segments)
  except (TypeError, ValueError) as e:
    raise InvalidSegmentLayout(f"{name} must be {_EXPECTED}; got {_describe(segments, None)} "
                               f"({e})") from e
  if (arr.ndim == 1 and arr.size == 0) or arr.shape == (0, 3):
    return empty_segments()
  if arr.ndim != 2 or arr.shape[1] != 3:
    hint = (" (three columns? pass np.stack([block, start, length], axis=1))"
            if arr.ndim == 2 and arr.shape[0] == 3 else "")
    raise InvalidSegmentLayout(f"{name} must be {_EXPECTED}; got {_describe(segments, arr)}"
                               f"{hint}")
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
    raise InvalidSegmentLayout(f"{name} must be {_EXPECTED}; got {_describe(segments, arr)}")
  if arr.min() < _I32.min or arr.max() > _I32.max:
    raise InvalidSegmentLayout(f"{name} must be {_EXPECTED}; got values outside int32 "
                               f"({arr.min()}..{arr.max()})")
  return np.ascontiguousarray(arr, dtype=np.int32)


def num_tokens(segments: Segments) -> int:
  """Tokens covered by `segments` (the sum of the lengths)."""
  return int(as_segments(segments)[:, 2].sum(dtype=np.int64))


def take_tokens(segments: Segments, count: int) -> Segments:
  """The segments of the first `count` tokens; a segment straddling `count` is cut.

  Raises `InvalidSegmentLayout` (bad layout) or `InvalidArgument` (`count` out of range).
  """
  segs = as_segments(segments)
  ends = np.cumsum(segs[:, 2], dtype=np.int64)
  total = int(ends[-1]) if ends.size else 0
  if not 0 <= count <= total:
    raise InvalidArgument(f"count {count} outside [0, {total}] (the segments' tokens)")
  i = int(np.searchsorted(ends, count, side="left"))
  out = segs[:i + 1].copy() if count else empty_segments()
  if count:
    out[-1, 2] -= int(ends[i]) - count
  return out
