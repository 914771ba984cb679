"""`CacheView`: a read-only view of a `CachedPool`'s prefix cache (`CachedPool.cache`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from paged_kv.core.errors import InvalidArgument
from paged_kv.core.segment_format import Segments
from radix.cache import CacheCounters, EvictableReport, MatchResult, PrefixCache
from radix.tree import HitStats, NodeId, RadixTree

__all__ = ["CacheView"]


class CacheView:
  """Read-only view of a `CachedPool`'s prefix cache: nothing here locks, records a hit
  or moves a reference. Change `tree` only through the `CachedPool`.
  """

  def __init__(self, cache: PrefixCache):
    self._cache = cache

  @property
  def block_size(self) -> int:
    return self._cache.block_size

  @property
  def policy(self) -> str:
    return self._cache.policy

  @property
  def pack_tails(self) -> bool:
    return self._cache.pack_tails

  @property
  def tree(self) -> RadixTree:
    return self._cache.tree

  @property
  def num_tokens(self) -> int:
    return self._cache.num_tokens

  @property
  def num_segments(self) -> int:
    return self._cache.num_segments

  def now(self) -> float:
    return self._cache.now()

  def match(self, namespace: Hashable, tokens: Any, *, lock: bool = False,
            record: bool = False) -> MatchResult:
    """A probe: the longest cached prefix, neither locked nor recorded (`InvalidArgument`
    for `lock` or `record`: use `CachedPool.match`).
    """
    if lock or record:
      raise InvalidArgument("CacheView.match only probes (lock=False, record=False); "
                            "lock or record a match with CachedPool.match")
    return self._cache.match(namespace, tokens, lock=False, record=False)

  def stats(self, namespace: Hashable | None = None) -> HitStats:
    return self._cache.stats(namespace)

  def counters(self) -> CacheCounters:
    return self._cache.counters()

  def segment_refs(self) -> Segments:
    """`i32[n, 3]`: every `(block, start, length)` the tree holds (one reference each)."""
    return self._cache.segment_refs()

  def node_segments(self, node: NodeId) -> Segments:
    """`i32[n, 3]`: a copy of a node's segments."""
    return self._cache.node_segments(node)

  def tree_ref_counts(self, num_blocks: int) -> np.ndarray:
    return self._cache.tree_ref_counts(num_blocks)

  def evictable(self, *, bytes_per_token: int = 0, ref_count: Any = None) -> EvictableReport:
    return self._cache.evictable(bytes_per_token=bytes_per_token, ref_count=ref_count)
