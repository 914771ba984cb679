"""The one host-side segment format: `Segments`, an `int32[n, 3]` array of rows.

Row `i` is one segment `(block, start, length)`: the physical block id, the first
token slot used in that block, and the number of tokens (`length >= 1`,
`start + length <= block_size`). The tokens of a sequence (or of a prefix-cache
node) are the concatenation of its segments, in row order.

Every host API that takes or returns segments speaks this layout:
`BlockPool.segments()` / `open_sequence(segments=)` / `pack_slots(extra_segments=)` /
`reclaim_slots()`, `check_invariants(extra_segments=)`, the metrics
(`live_slot_mask`, `snapshot`), `radix.PrefixCache` (`match`, `insert`,
`segment_refs`, ...) and `paged_kv.cache.cached_pool.CachedPool`. The device-side
`SegmentTable` holds the same triples as three `[max_seqs, max_segments]` arrays
(one per field, padded, with `num_segments` beside them): a layout for jitted
gathers, not an argument format.

`as_segments` checks the layout only (shape, integer dtype, int32 range) and raises
`InvalidSegmentLayout`; whether the blocks exist and the slots are written is the
consumer's check, with its own typed error (`InvalidBlock`, `InvalidSegment`, an
invariant violation). `radix.cache.as_segments` makes the same layout check on the
radix side, which cannot import `paged_kv`; a test keeps the two in agreement.
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
  """Checks the layout of a segment list; returns it as a C-contiguous `i32[n, 3]`.

  Args:
    segments: array-like `[n, 3]` of `(block, start, length)` rows (numpy, a JAX
      array, or nested lists); an empty array-like (`[]`, `()`, shape `(0, 3)`) is
      no segment.
    name: the argument's name, for the error message.

  Returns:
    `i32[n, 3]`; it may share memory with `segments` when that already is one.

  Raises:
    InvalidSegmentLayout: not `[n, 3]`, not integers, values outside int32, or a
      tuple of three 1-D arrays (the old `(block, start, length)` column layout,
      ambiguous when there are exactly three segments).
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

  Raises:
    InvalidSegmentLayout: bad layout. InvalidArgument: `count` outside
      `[0, num_tokens(segments)]`.
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
