"""The pool's argument converters and its status-to-exception mapping.

Each converter returns a plain value or array, or raises `InvalidArgument` before
anything changes. The few-entry fast paths (`SMALL_IDS`) are plain Python: a
scheduler step passes a handful of ids per call.
"""

from __future__ import annotations

import jax
import numpy as np

from paged_kv.core.errors import (OOM_REASONS, BlockInUse, InvalidArgument, InvalidBlock,
                                  InvalidSegment, InvalidSequence, PoolExhausted,
                                  RefCountOverflow, RefCountUnderflow, Status)

I32_MIN, I32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
# Id arguments of at most this many entries are checked in plain Python.
SMALL_IDS = 32


def bucket(x: int, low: int = 1) -> int:
  """Smallest power of two >= max(x, low, 1)."""
  return 1 << max(int(x) - 1, int(low) - 1, 0).bit_length()


def pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full((size,) + a.shape[1:], fill, np.int32)
  out[:a.shape[0]] = a
  return out


def as_int_array(x, name: str) -> np.ndarray:
  """A 1-D int64 copy of `x`; refuses non-integers and values outside int32.

  The range is checked before any cast, so an unsigned `2**64 - 1` is reported
  as itself, not as `-1`.
  """
  if type(x) is np.ndarray and x.ndim == 1:
    if x.dtype == np.int32:
      return x.astype(np.int64)  # int32: nothing to check (the prefix cache's ids)
    if x.dtype == np.int64 and x.size <= SMALL_IDS:  # a few: the range in plain Python
      if not x.size or I32_MIN <= min(v := x.tolist()) and max(v) <= I32_MAX:
        return x.copy()
  elif type(x) is list and len(x) <= SMALL_IDS and all(type(v) is int for v in x):
    if not x or I32_MIN <= min(x) and max(x) <= I32_MAX:
      return np.array(x, np.int64)
  try:
    a = np.asarray(x)
  except (TypeError, ValueError) as e:
    raise InvalidArgument(f"{name} must be a 1-D array of ints, got {type(x).__name__}") from e
  if a.ndim == 0:
    a = a[None]
  if a.ndim != 1 or not (a.size == 0 or (np.issubdtype(a.dtype, np.integer)
                                         and a.dtype != np.bool_)):
    raise InvalidArgument(f"{name} must be a 1-D array of ints, got {a.dtype} {a.shape}")
  if a.size and (a.min() < I32_MIN or a.max() > I32_MAX):
    raise InvalidArgument(f"{name} has values outside int32: {a.min()}..{a.max()}")
  return a.astype(np.int64)


def single_int(x) -> int | None:
  """The value of a one-entry id argument (`3`, `[3]`, `(3,)`, an int scalar or a
  1-entry int array) within int32; else None (the caller's checked path reports
  any problem)."""
  if type(x) in (list, tuple):
    if len(x) != 1:
      return None
    x = x[0]
  if type(x) is int:
    return x if I32_MIN <= x <= I32_MAX else None
  if isinstance(x, np.ndarray):
    if x.size != 1 or x.ndim > 1:
      return None
    x = x.reshape(())[()]
  if isinstance(x, np.integer) and not isinstance(x, np.bool_):
    v = int(x)
    return v if I32_MIN <= v <= I32_MAX else None
  return None


def fast_segments(x) -> np.ndarray | None:
  """`x` if it is a C-contiguous `i32[n, 3]` array (the prefix cache's), else None."""
  if (type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 2 and x.shape[1] == 3
      and x.flags.c_contiguous):
    return x
  return None


def as_int_scalar(x, name: str, *, low: int | None = None, high: int | None = None) -> int:
  """`x` (a Python, numpy or JAX integer scalar, never a bool) as an int in `[low, high)`."""
  value = None
  if isinstance(x, (bool, np.bool_)):
    pass
  elif isinstance(x, (int, np.integer)):
    value = int(x)
  elif isinstance(x, (np.ndarray, jax.Array)) and x.shape == () and (
      np.issubdtype(x.dtype, np.integer) and x.dtype != np.bool_):
    value = int(x)
  if value is None:
    raise InvalidArgument(f"{name} must be an integer scalar, got {x!r}")
  if (low is not None and value < low) or (high is not None and value >= high):
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    raise InvalidArgument(f"{name} {value} outside [{lo}, {hi})")
  return value


def as_kv_array(x, name: str):
  """`x` if it is an array (JAX or numpy); a nested list becomes a numpy array."""
  if isinstance(x, (jax.Array, np.ndarray)):
    return x
  try:
    a = np.asarray(x)
  except (TypeError, ValueError) as e:
    raise InvalidArgument(f"write_kv: {name} must be an array, got {type(x).__name__}") from e
  if a.dtype == object:
    raise InvalidArgument(f"write_kv: {name} must be a numeric array, got {type(x).__name__}")
  return a


_STATUS_OK, _STATUS_ABORTED = int(Status.OK), int(Status.ABORTED)


def raise_for_status(status: np.ndarray, what: str) -> None:
  """Raises the typed exception for the first failed entry of `status`."""
  status = np.asarray(status)
  if not status.any():  # all OK (0): the common case, without the enum comparisons
    return
  bad = np.flatnonzero((status != _STATUS_OK) & (status != _STATUS_ABORTED))
  if bad.size == 0:
    return
  i = int(bad[0])
  code = Status(int(status[i]))
  msg = f"{what}: entry {i} failed with {code.name}; nothing was applied"
  if code in OOM_REASONS:
    raise PoolExhausted(msg, reason=OOM_REASONS[code])
  raise {Status.INVALID_SEQUENCE: InvalidSequence, Status.INVALID_COUNT: InvalidArgument,
         Status.INVALID_BLOCK: InvalidBlock, Status.REF_UNDERFLOW: RefCountUnderflow,
         Status.INVALID_SEGMENT: InvalidSegment, Status.REF_OVERFLOW: RefCountOverflow,
         Status.BLOCK_IN_USE: BlockInUse}[code](msg)
