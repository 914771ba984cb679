"""Typed checks of config fields: one message format, one error type.

A wrong type or value raises `InvalidArgument` naming owner, field, value and
what is allowed (`SchedulerConfig.watermark_blocks must be an int in [0,
2147483647], got 10**9`); the value comes back as a Python scalar.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from paged_kv.core.errors import InvalidArgument

__all__ = ["I32_MAX", "check_bool", "check_choice", "check_int", "check_number"]

I32_MAX = int(np.iinfo(np.int32).max)


def _fail(owner: str, name: str, allowed: str, value: Any) -> InvalidArgument:
  return InvalidArgument(f"{owner}.{name} must be {allowed}, got {value!r}")


def check_int(owner: str, name: str, value: Any, low: int = 0, high: int = I32_MAX, *,
              optional: bool = False) -> int | None:
  """`value` as an int in `[low, high]` (`optional`: None passes)."""
  if value is None and optional:
    return None
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
      or not low <= int(value) <= high):
    allowed = f"an int in [{low}, {high}]" + (" or None" if optional else "")
    raise _fail(owner, name, allowed, value)
  return int(value)


def check_number(owner: str, name: str, value: Any, low: float, high: float, *,
                 low_open: bool = False, high_open: bool = False,
                 optional: bool = False) -> float | None:
  """`value` as a finite float in the interval (open where asked; `optional`: None passes)."""
  if value is None and optional:
    return None
  ok = (not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Real)
        and math.isfinite(float(value)))
  if ok:
    v = float(value)
    ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
  if not ok:
    allowed = (f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
               + (" or None" if optional else ""))
    raise _fail(owner, name, allowed, value)
  return float(value)


def check_bool(owner: str, name: str, value: Any) -> bool:
  """`value` as a bool (`True`/`False` or a numpy bool; not 0/1, not a string)."""
  if not isinstance(value, (bool, np.bool_)):
    raise _fail(owner, name, "a bool", value)
  return bool(value)


def check_choice(owner: str, name: str, value: Any, choices: Sequence[str]) -> str:
  """`value`, one of `choices` (strings)."""
  if not isinstance(value, str) or value not in choices:
    raise _fail(owner, name, f"one of {tuple(choices)}", value)
  return value
