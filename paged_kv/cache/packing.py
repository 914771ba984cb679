"""Packing the cache's short segments into shared ("slotted") blocks.

The pool moves the tree's references (`BlockPool.pack_slots` with an outside owner);
the cache only rewrites its records, and its rebind deltas are checked against the
pool's moves, not applied again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from paged_kv.core.errors import InvariantViolation
from paged_kv.pool.block_pool import BlockPool
from radix.cache import PackCandidate, PrefixCache, RefDeltas
from radix.tree import StaleNodeError

__all__ = ["pack"]


def pack(pool: BlockPool, cache: PrefixCache, candidates: Iterable[PackCandidate], *,
         dynamic: np.ndarray, mix_namespaces: bool) -> int:
  """`CachedPool.pack`: moves the live candidates on `dynamic` blocks; returns how many moved."""
  live: list[PackCandidate] = []
  for cand in candidates:
    try:
      held = cache.node_segments(cand.node)
    except StaleNodeError:
      continue
    if (dynamic[cand.segment[0]]
        and (held == np.asarray(cand.segment, np.int32)).all(axis=1).any()):
      live.append(cand)
  if not live:
    return 0
  old = np.array([c.segment for c in live], np.int32)
  groups, block_groups = _groups(pool, cache, live, mix_namespaces)
  result = pool.pack_slots(extra_segments=old, groups=groups, block_groups=block_groups)
  moved = RefDeltas.empty()
  num_moved = 0
  for cand, seg_old, seg_new in zip(live, old, result.extra_segments):
    if tuple(seg_old) != tuple(seg_new):
      moved = moved + cache.rebind_segment(cand.node, seg_old, seg_new)
      num_moved += 1
  ids, deltas = result.ref_deltas
  if not (np.array_equal(moved.block_ids, ids) and np.array_equal(moved.deltas, deltas)):
    raise InvariantViolation("pack: the cache's rebind deltas differ from the pool's moves")
  return num_moved


def _groups(pool: BlockPool, cache: PrefixCache, live: list[PackCandidate],
            mix_namespaces: bool) -> tuple[np.ndarray, np.ndarray]:
  """`pack_slots`' groups: each candidate's namespace (an index), and as a
  destination each block whose every holder is a cache node of one candidate's
  namespace (-1 for the others: a block a table row or another namespace holds).
  All 0 with `mix_namespaces`."""
  n = pool.config.num_blocks
  if mix_namespaces:
    return np.zeros((len(live),), np.int64), np.zeros((n,), np.int32)
  tree = cache.tree
  index: dict[Hashable, int] = {}
  groups = np.array([index.setdefault(tree.node(c.node).namespace, len(index))
                     for c in live], np.int64)
  blocks, owners = [], []
  for node in tree.nodes():
    if node.value.shape[0]:
      blocks.append(node.value[:, 0])
      owners.append(np.full(node.value.shape[0], index.get(node.namespace, -1), np.int64))
  lowest = np.full((n,), len(index), np.int64)
  highest = np.full((n,), -1, np.int64)
  if blocks:
    b, o = np.concatenate(blocks), np.concatenate(owners)
    np.minimum.at(lowest, b, o)
    np.maximum.at(highest, b, o)
  one = (lowest == highest) & (pool.host.table_refs == 0)
  return groups, np.where(one, highest, -1).astype(np.int32)
