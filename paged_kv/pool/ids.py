"""Distinct ids and sums per id without a sort (O(k) numpy over a scratch array),
cached index ranges, and slot words as one int.

The mirror's mutators take a few to a few thousand block ids per call, almost
always distinct; `np.unique` sorts them every time and `np.add.at` is as slow.
"""

from __future__ import annotations

import numpy as np


def distinct_mask(stamp: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """`bool[k]`: True at exactly one entry of each distinct value of `ids`, no sort:
  each entry writes its position into `stamp` (scratch `i64` over the id space)
  at its id, and exactly one entry of a repeated id reads its own back."""
  pos = np.arange(ids.shape[0])
  stamp[ids] = pos
  return stamp[ids] == pos


def aggregate(stamp: np.ndarray, ids: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(uniq, totals)`: the distinct ids (in an unspecified order) and the exact `i64`
  sum of `values` over each one's entries; no sort, and no work beyond the check
  when the ids are already distinct (the common case). `stamp` as `distinct_mask`."""
  if ids.size <= 1:
    return ids, values
  first = distinct_mask(stamp, ids)
  if first.all():
    return ids, values
  uniq = ids[first]
  stamp[uniq] = np.arange(uniq.size)
  if np.ndim(values) == 0:  # one value for all (a count): a bincount over the k positions
    return uniq, np.bincount(stamp[ids], minlength=uniq.size) * int(values)
  totals = np.zeros(uniq.size, np.int64)
  np.add.at(totals, stamp[ids], values)
  return uniq, totals


def sum_by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(uniq i64[U], totals i64[U])`: the distinct ids, ascending, and the exact sum
  of `values` over each one's entries (a dict for a few ids: it beats a sort)."""
  if ids.size <= 32:
    acc: dict[int, int] = {}
    for i, v in zip(ids.tolist(), values.tolist()):
      acc[i] = acc.get(i, 0) + v
    keys = sorted(acc)
    return np.array(keys, np.int64), np.array([acc[k] for k in keys], np.int64)
  uniq, inv = np.unique(ids, return_inverse=True)
  totals = np.zeros(uniq.size, np.int64)
  np.add.at(totals, inv.reshape(-1), values)
  return uniq.astype(np.int64), totals


_ARANGES: dict[int, np.ndarray] = {}


def arange(k: int) -> np.ndarray:
  """`np.arange(k)` (int64), cached and read only (a slot or position range built
  once per size instead of once per call)."""
  a = _ARANGES.get(k)
  if a is None:
    a = _ARANGES[k] = np.arange(k, dtype=np.int64)
    a.setflags(write=False)
  return a


def words_to_int(words: np.ndarray) -> int:
  """A block's slot words (`u32[W]`, word k holds slots 32k..32k+31) as one Python int."""
  out = 0
  for k, w in enumerate(words.tolist()):
    out |= int(w) << (32 * k)
  return out
