"""The mirror's block-side mutators: reference counts, the free index that follows a
count to and from 0, and slot words.

The functions take the `HostState` first; `HostState` binds them as its methods
(`h.change_refs(...)`). Each tells the attached `ChangeLog` what it touches first.
"""
# pylint: disable=protected-access

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paged_kv.core.state import REGION_DYNAMIC
from paged_kv.pool.ids import aggregate

if TYPE_CHECKING:
  from paged_kv.pool.host_state import HostState

NO_IDS = np.zeros(0, np.int64)
NO_IDS.setflags(write=False)
# `change_refs` of at most this many entries takes the plain-Python path.
SMALL_CHANGES = 32


def change_refs(h: HostState, blocks: np.ndarray, deltas: np.ndarray, *,
                distinct: bool = False) -> np.ndarray:
  """Adds `deltas` to `ref_count[blocks]` (repeats add up; the caller checked the
  results stay >= 0) and returns the blocks freed. A freed block's slots clear and
  it joins the free index; a dynamic block leaving 0 leaves it. `distinct`: the
  caller knows `blocks` holds no repeat."""
  b = np.asarray(blocks, np.int64).reshape(-1)
  if b.size == 0:
    return b
  d = np.asarray(deltas, np.int64)  # an array like `blocks`, or one delta for all
  if d.ndim:
    d = d.reshape(-1)
  if b.size == 1:
    return h._change_ref(int(b[0]), int(d.reshape(-1)[0]))
  if b.size <= SMALL_CHANGES:
    return h._change_refs_small(b, d)
  return h._change_refs_general(b, d, distinct=distinct)


def _change_refs_general(h: HostState, b: np.ndarray, d: np.ndarray, *,
                         distinct: bool = False) -> np.ndarray:
  """`change_refs`, vectorised (`b: i64[k]`, `d`: `i64[k]` or a scalar)."""
  uniq, total = (b, d) if distinct else aggregate(h.stamp, b, d)
  old = h.ref_count[uniq]
  return h.set_refs(uniq, old, old + total)


def set_refs(h: HostState, uniq: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
  """`ref_count[uniq] = new` for distinct blocks counting `old` now (every `new >= 0`),
  with `change_refs`' follow-up; returns the freed blocks."""
  h.log.touch_blocks(h, uniq, distinct=True)
  h.ref_count[uniq] = new
  was_free, now_free = old == 0, new == 0  # counts are never negative
  flip = was_free != now_free
  if not flip.any():
    return NO_IDS
  freed = uniq[flip & now_free]
  taken = uniq[flip & was_free]
  if freed.size:
    h._blocks_freed(freed)
  if taken.size:
    dyn = h.region[taken] == REGION_DYNAMIC
    h.free.mark(taken[dyn], -1)
    h.num_free_base -= taken.size - int(np.count_nonzero(dyn))
  return freed


def _blocks_freed(h: HostState, freed: np.ndarray) -> None:
  """Blocks whose count just reached 0 (distinct): slots cleared, into the free
  index (dynamic) or counted free (base)."""
  h.slots[freed] = 0
  h.log.freed(freed)
  dyn = h.region[freed] == REGION_DYNAMIC
  h.free.mark(freed[dyn], +1)
  h.num_free_base += freed.size - int(np.count_nonzero(dyn))


def _change_refs_small(h: HostState, b: np.ndarray, d: np.ndarray) -> np.ndarray:
  """`change_refs` of a few entries, in plain Python (`d`: `i64[k]` or a scalar)."""
  ids = b.tolist()
  if d.ndim:
    acc: dict[int, int] = {}
    for x, v in zip(ids, d.tolist()):
      acc[x] = acc.get(x, 0) + v
  else:
    acc = dict.fromkeys(ids, 0)
    v = int(d)
    for x in ids:
      acc[x] += v
  uniq = np.fromiter(acc, np.int64, len(acc))
  old = h.ref_count[uniq].tolist()
  return h.set_refs_small(uniq, list(acc), old,
                             [o + v for o, v in zip(old, acc.values())])


def set_refs_small(h: HostState, uniq: np.ndarray, ids: list[int], old: list[int],
                   new: list[int]) -> np.ndarray:
  """`set_refs` of a few distinct blocks, in plain Python (`uniq`: `ids` as an array)."""
  h.log.touch_owned(uniq)
  h.ref_count[uniq] = new
  freed, taken = [], []
  for x, o, n in zip(ids, old, new):
    if (o == 0) != (n == 0):
      (freed if n == 0 else taken).append(x)
  if not freed and not taken:
    return NO_IDS
  region = h.region
  if freed:
    f = np.array(freed, np.int64)
    h.slots[f] = 0
    h.log.freed(f)
    dyn = [x for x in freed if region[x] == REGION_DYNAMIC]
    h.free.mark(np.array(dyn, np.int64), +1)
    h.num_free_base += len(freed) - len(dyn)
  if taken:
    dyn = [x for x in taken if region[x] == REGION_DYNAMIC]
    h.free.mark(np.array(dyn, np.int64), -1)
    h.num_free_base -= len(taken) - len(dyn)
  return np.array(freed, np.int64)


def _change_ref(h: HostState, x: int, delta: int) -> np.ndarray:
  """`change_refs` of one block, in plain Python."""
  h.log.touch_blocks(h, np.array([x], np.int64))
  old = int(h.ref_count[x])
  new = old + delta
  h.ref_count[x] = new
  if (old == 0) == (new == 0):
    return NO_IDS
  one = np.array([x], np.int64)
  dyn = int(h.region[x]) == REGION_DYNAMIC
  if new == 0:
    h.slots[x] = 0
    h.log.freed(one)
    if dyn:
      h.free.mark(one, +1)
    else:
      h.num_free_base += 1
    return one
  if dyn:
    h.free.mark(one, -1)
  else:
    h.num_free_base -= 1
  return NO_IDS


def take_blocks(h: HostState, blocks: np.ndarray, slots: np.ndarray | None = None) -> None:
  """Free dynamic `blocks` (distinct) become owned (`ref_count = 1`, out of the
  index), with slot words `slots` if given."""
  b = np.asarray(blocks, np.int64)
  if b.size == 0:
    return
  h.log.touch_blocks(h, b, distinct=True)
  h.ref_count[b] = 1
  if slots is not None:
    h.slots[b] = slots
  h.free.mark(b, -1)


def set_slots(h: HostState, blocks: np.ndarray, words: np.ndarray) -> None:
  b = np.asarray(blocks, np.int64)
  if b.size == 0:
    return
  h.log.touch_blocks(h, b)
  h.slots[b] = words


def set_slot_bits(h: HostState, blocks: np.ndarray, slots: np.ndarray) -> None:
  """Sets slot `slots[i]` of block `blocks[i]` (distinct blocks)."""
  b = np.asarray(blocks, np.int64)
  if b.size == 0:
    return
  h.log.touch_owned(b)
  s = np.asarray(slots).astype(np.uint32)
  flat = h.slots.reshape(-1)
  at = b * h.config.slot_words + (s >> 5) if h.config.slot_words > 1 else b
  flat[at] |= np.uint32(1) << (s & 31)
