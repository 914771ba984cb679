"""Prefix cache: radix-tree nodes bound to KV segments of a block pool.

Host bookkeeping only (numpy; nothing from JAX or ``paged_kv``). The cache never
touches the pool: every call that changes the tree's references returns them as a
``RefDeltas`` for the caller to apply (``paged_kv.cache.CachedPool`` does; a simulator
uses ``RefDeltas.apply_to``). The rule: the pool's ``ref_count[b]`` counts one
reference per segment on ``b`` in a live table (the pool's side: ``open_sequence``
increfs a match's segments) plus one per segment a node holds (the cache's deltas:
+1 per segment stored or cut by a split, -1 per segment evicted or moved away). So
``ref_count == table refs + bincount(cache.segment_refs()[:, 0])`` at every moment.

``cache.tree`` is for reading; change it only through the cache (``split``, not
``tree.split``) so that no reference is missed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from radix.eviction import (GC_ORDERS, GRANULARITIES, POLICIES, EvictableReport, Eviction,
                            EvictionPlanner, GcMark, cost_key, gc_key, lru_key)
from radix.segments import (EMPTY_IDS, EMPTY_SEGMENTS, SMALL_SEGMENTS, InvalidSegmentsError,
                            RefCountMismatchError, RefDeltas, Segments, as_segments, cut,
                            split_point)
from radix.tree import HitStats, Node, NodeId, RadixTree, as_tokens

__all__ = [
    "CacheCounters",
    "EvictableReport",
    "Eviction",
    "GRANULARITIES",
    "GcMark",
    "InsertOutcome",
    "InvalidSegmentsError",
    "MatchResult",
    "PackCandidate",
    "POLICIES",
    "PrefixCache",
    "RefCountMismatchError",
    "RefDeltas",
    "Segments",
    "as_segments",
]


@dataclasses.dataclass(frozen=True)
class MatchResult:
  """Result of ``PrefixCache.match``.

  Attributes:
    segments: int32[n, 3], the KV of tokens ``[:length]`` for the new sequence's table.
    node: the locked node (for ``unlock``); None when nothing matched or ``lock=False``.
    ref_deltas: empty unless ``match(split=True)`` cut a segment (+1 on its block).
    continuable: the last segment is a partial block's tail ending where the tree's
      ends: a sequence that appends after a copy of it lets ``insert`` move the tree's
      reference onto the copy (no dead slots kept).
  """

  length: int
  segments: np.ndarray
  node: NodeId | None
  ref_deltas: RefDeltas
  continuable: bool = False


@dataclasses.dataclass(frozen=True)
class PackCandidate:
  """A short segment (< block_size tokens) of ``node`` worth packing into a shared block.

  Once the pool has moved it, ``rebind_segment(node, segment, new_segment)`` records
  the move. Its deltas are for checking only when the pool moved the reference
  itself (``pack_slots`` with an outside owner): applying them would count it twice.
  """

  node: NodeId
  segment: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class InsertOutcome:
  """Result of ``PrefixCache.insert``.

  Attributes:
    prefix_len: leading tokens the cache already held (the tree keeps its own segments).
    num_new_tokens: tokens the tree took references for; ``node`` holds them (or None).
    ref_deltas: +1 per new segment and per segment a split cut; a continued tail
      also moves one reference (+1 on the copy, -1 on the old block).
    pack: the new leaf's short segments (empty unless ``pack_tails``).
  """

  prefix_len: int
  num_new_tokens: int
  node: NodeId | None
  ref_deltas: RefDeltas
  pack: tuple[PackCandidate, ...]


@dataclasses.dataclass(frozen=True)
class CacheCounters:
  """The cache's size and running totals since construction (`PrefixCache.counters()`);
  its prefix hits, per namespace, are `PrefixCache.stats(namespace)` (`HitStats`)."""

  num_nodes: int
  num_tokens: int
  num_segments: int
  inserted_tokens: int
  evicted_nodes: int
  evicted_tokens: int
  evictions: int


class PrefixCache:
  """Radix prefix cache whose nodes hold segments of a block pool.

  Args:
    block_size: tokens per pool block (validates segments).
    policy: default eviction policy, one of ``POLICIES``.
    pack_tails: ``insert`` names the new leaf's short segments to pack.
    clock: the current time, any monotone unit (TTLs use it); simulators pass trace time.
    granularity: ``"block"``: eviction takes a leaf's segments tail first and trims
      the last leaf to the target; ``"node"``: whole leaves only.
  """

  def __init__(
      self,
      *,
      block_size: int,
      policy: str = "lru",
      pack_tails: bool = False,
      clock: Callable[[], float] = time.monotonic,
      granularity: str = "block",
  ):
    if granularity not in GRANULARITIES:
      raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
      raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    self.block_size = int(block_size)
    self.policy = policy
    self.pack_tails = bool(pack_tails)
    self._clock = clock
    self._pending_cuts: list[int] = []
    self._rebound: list[int] = []
    self.tree = RadixTree(split_value=self._split_segments)
    self._num_segments = 0
    self._inserted_tokens = 0
    self._evicted_nodes = 0
    self._evicted_tokens = 0
    self._evictions = 0
    self._planner = EvictionPlanner(self.tree)
    self.granularity = granularity

  # ------------------------------------------------------------------ internals
  def _split_segments(self, segs: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    head, tail, was_cut = cut(segs, offset)
    if was_cut:
      self._pending_cuts.append(int(tail[0, 0]))
      self._num_segments += 1
    return head, tail

  def _now(self) -> float:
    return float(self._clock())

  def now(self) -> float:
    """The cache's clock (the unit of TTLs and access times)."""
    return self._now()

  def _node(self, node_id: NodeId) -> Node:
    return self.tree.node(node_id)

  # ------------------------------------------------------------------ queries
  def match(
      self,
      namespace: Hashable,
      tokens: Any,
      *,
      lock: bool = True,
      record: bool = True,
      split: bool = False,
  ) -> MatchResult:
    """Longest cached prefix of ``tokens`` (int32[n]) in ``namespace``.

    Match ``tokens[:-1]`` to keep a token to compute for the logits. ``lock`` locks the
    deepest matched node until ``unlock(result.node)``; ``record=False`` is a read-only
    probe (no hit statistics, no access time). ``split`` (with ``lock``): a match ending
    inside a node splits it there and locks only the matched head, so the unmatched
    tail stays evictable. Raises ``InvalidTokensError``, ``InvalidNamespaceError``.
    """
    m = self.tree.match_prefix(namespace, tokens, now=self._now(), record=record)
    if m.length == 0:
      return MatchResult(0, EMPTY_SEGMENTS.copy(), None, RefDeltas.empty())
    parts = [self._node(i).value for i in m.path]
    last = self._node(m.path[-1])
    inside = False
    if m.last_offset < last.num_tokens:
      parts[-1], _, inside = cut(parts[-1], m.last_offset)
    segments = np.concatenate(parts).astype(np.int32, copy=True)
    tail = segments[-1]
    continuable = not inside and int(tail[1]) + int(tail[2]) < self.block_size
    node = None
    deltas = RefDeltas.empty()
    if lock:
      node = last.node_id
      if split and m.last_offset < last.num_tokens:
        node, deltas = self.split(node, m.last_offset)
      self.tree.lock(node)
    return MatchResult(m.length, segments, node, deltas, continuable)

  def unlock(self, node: NodeId) -> None:
    """Releases a lock taken by ``match`` (``StaleNodeError``, ``LockError``)."""
    self.tree.unlock(node)

  # ------------------------------------------------------------------ updates
  def insert(
      self, namespace: Hashable, tokens: Any, segments: Any, *, pin_ttl: float | None = None
  ) -> InsertOutcome:
    """Stores a finished sequence's tokens (int32[n]) and the segments holding their KV.

    ``segments`` (``int32[m, 3]``) cover exactly the n tokens in order. The tree
    references only the tokens it did not hold (``[prefix_len:]``; a straddling segment
    is cut); apply the outcome's ``ref_deltas`` before releasing the sequence.
    ``pin_ttl`` pins the inserted path. Raises ``InvalidTokensError``,
    ``InvalidSegmentsError``, ``ValueError``; nothing changes on error.
    """
    tokens = as_tokens(tokens)
    segs = as_segments(segments, block_size=self.block_size)
    covered = (sum(segs[:, 2].tolist()) if segs.shape[0] <= SMALL_SEGMENTS
               else int(segs[:, 2].sum(dtype=np.int64)))
    if covered != tokens.shape[0]:
      raise InvalidSegmentsError(
          f"segments cover {covered} tokens but {tokens.shape[0]} tokens given"
      )
    if pin_ttl is not None and not pin_ttl >= 0:
      raise ValueError(f"pin_ttl must be >= 0, got {pin_ttl!r}")
    now = self._now()
    self._pending_cuts.clear()
    res = self.tree.insert(
        namespace, tokens, lambda prefix_len: cut(segs, prefix_len)[1].copy(), now=now
    )
    blocks = list(self._pending_cuts)
    self._pending_cuts.clear()
    pack: tuple[PackCandidate, ...] = ()
    num_new = 0
    if res.leaf is not None:
      leaf = self._node(res.leaf)
      blocks.extend(self._adopt_continuation(leaf.parent, segs, res.prefix_len))
      num_new = leaf.num_tokens
      self._num_segments += leaf.value.shape[0]
      self._inserted_tokens += num_new
      rebound = self._rebound
      self._rebound = []
      deltas = None if blocks or rebound else RefDeltas.increfs(leaf.value[:, 0])
      if deltas is None:
        deltas = RefDeltas.from_pairs(
            np.concatenate([leaf.value[:, 0], np.asarray(blocks, np.int32),
                            np.asarray(rebound, np.int32)]),
            np.concatenate([np.ones(leaf.value.shape[0] + len(blocks), np.int64),
                            -np.ones(len(rebound), np.int64)]),
        )
      if self.pack_tails:
        short = leaf.value[leaf.value[:, 2] < self.block_size]
        pack = tuple(PackCandidate(res.leaf, tuple(int(x) for x in row)) for row in short)
    else:
      deltas = RefDeltas.from_pairs(np.asarray(blocks, np.int32), 1)
    if pin_ttl is not None:
      deepest = res.leaf
      if deepest is None:
        m = self.tree.match_prefix(namespace, tokens, now=now, record=False)
        deepest = m.node
      if deepest is not None:
        self.tree.pin(deepest, now + pin_ttl)
    return InsertOutcome(res.prefix_len, num_new, res.leaf, deltas, pack)

  def _adopt_continuation(self, node: Node | None, segs: np.ndarray, prefix_len: int) -> list:
    """Moves ``node``'s partial last segment ``(b, ...)`` onto the sequence's copy on
    ``c`` (the segment straddling ``prefix_len``): returns ``[c]`` (an incref), records
    ``b`` in ``_rebound`` (a decref); ``[]`` when the sequence did not continue a copy.
    """
    if node is None or node.parent is None or prefix_len <= 0:
      return []
    i, t0 = split_point(segs, prefix_len)
    if i >= segs.shape[0]:
      return []
    k = prefix_len - t0
    if k <= 0:
      return []  # the cut falls on a segment boundary: nothing straddles
    c, s = int(segs[i, 0]), int(segs[i, 1])
    b, sb, lb = (int(x) for x in node.value[-1])
    if b == c or lb > k:
      return []
    value = node.value.copy()
    value[-1] = (c, s + k - lb, lb)
    node.value = value
    self._rebound.append(b)
    return [c]

  def split(self, node: NodeId, offset: int) -> tuple[NodeId, RefDeltas]:
    """Splits a node after ``offset`` tokens (no KV copy); returns ``(head, deltas)``.

    ``deltas``: +1 on the block of a segment cut in two. ``StaleNodeError``,
    ``ValueError`` (offset outside ``[1, num_tokens - 1]``).
    """
    self._pending_cuts.clear()
    head = self.tree.split(node, offset)
    deltas = RefDeltas.from_pairs(np.asarray(self._pending_cuts, np.int32), 1)
    self._pending_cuts.clear()
    return head, deltas

  def rebind_segments(self, node: NodeId, new_segments: Any) -> RefDeltas:
    """Replaces a node's segments by ``new_segments`` (the same tokens, already copied).

    Returns +1 per new, -1 per old segment (see ``PackCandidate`` on applying them).
    Raises ``StaleNodeError``, ``InvalidSegmentsError``; nothing changes on error.
    """
    n = self._node(node)
    segs = as_segments(new_segments, block_size=self.block_size)
    if int(segs[:, 2].sum(dtype=np.int64)) != n.num_tokens:
      raise InvalidSegmentsError(
          f"node {node} holds {n.num_tokens} tokens; new segments cover " f"{int(segs[:, 2].sum())}"
      )
    old = n.value
    n.value = segs.copy()
    self._num_segments += segs.shape[0] - old.shape[0]
    return RefDeltas.from_pairs(
        np.concatenate([segs[:, 0], old[:, 0]]),
        np.concatenate([np.ones(segs.shape[0], np.int64), -np.ones(old.shape[0], np.int64)]),
    )

  def rebind_segment(
      self, node: NodeId, old_segment: Iterable[int], new_segment: Iterable[int]
  ) -> RefDeltas:
    """Replaces one segment of a node by another of the same length (packing).

    Raises ``StaleNodeError`` (node gone) or ``InvalidSegmentsError`` (``old_segment``
    not held, e.g. cut by a split since; lengths differ; malformed).
    """
    n = self._node(node)
    old = tuple(int(x) for x in old_segment)
    new = as_segments([list(new_segment)], block_size=self.block_size)[0]
    if len(old) != 3 or old[2] != int(new[2]):
      raise InvalidSegmentsError(f"segment lengths differ: {old} vs {tuple(new)}")
    rows = np.flatnonzero((n.value == np.asarray(old, np.int32)).all(axis=1))
    if rows.size == 0:
      raise InvalidSegmentsError(f"node {node} holds no segment {old}")
    segs = n.value.copy()
    segs[rows[0]] = new
    return self.rebind_segments(node, segs)

  def reset_locks(self, held: Iterable[NodeId]) -> None:
    """Rebuilds lock counts from ``held`` (one per outstanding locked match)."""
    self.tree.reset_locks(held)

  def clear(self) -> RefDeltas:
    """Drops every node, locked or pinned; returns the tree's decrefs.

    For when the pool can no longer vouch for the tree's segments.
    """
    refs = self.segment_refs()[:, 0]
    nodes = list(self.tree.nodes())
    self.tree.reset_locks(())
    while len(self.tree):
      for leaf in list(self.tree.leaves()):
        self.tree.remove_leaf(leaf.node_id)
    self._num_segments = 0
    self._evicted_nodes += len(nodes)
    self._evicted_tokens += sum(n.num_tokens for n in nodes)
    self._evictions += int(bool(nodes))
    return RefDeltas.from_pairs(refs, -1)

  def pin(self, namespace: Hashable, tokens: Any, ttl: float) -> int:
    """Pins the cached prefix of ``tokens`` (and its ancestors) for ``ttl``.

    Returns the tokens pinned; a node matched in part is pinned whole.
    """
    if not ttl >= 0:
      raise ValueError(f"ttl must be >= 0, got {ttl!r}")
    now = self._now()
    m = self.tree.match_prefix(namespace, tokens, now=now, record=False)
    if m.node is not None:
      self.tree.pin(m.node, now + ttl)
    return m.length

  def unpin(self, namespace: Hashable, tokens: Any) -> None:
    """Unpins the nodes below the prefix of ``tokens``."""
    m = self.tree.match_prefix(namespace, tokens, now=self._now(), record=False)
    if m.path:
      self.tree.unpin(m.path[0])

  # ------------------------------------------------------------------ eviction
  def _commit(self, chosen: list[tuple[Node, int]], freed: int | None) -> Eviction:
    blocks = []
    num_tokens = 0
    ids = []
    for node, first in chosen:
      if first > 0:  # trim: split off the tail segments (a segment boundary: no cut)
        self._pending_cuts.clear()
        self.tree.split(node.node_id, int(node.value[:first, 2].sum(dtype=np.int64)))
        assert not self._pending_cuts
      num_tokens += node.num_tokens
      segs = self.tree.remove_leaf(node.node_id)
      blocks.append(segs[:, 0])
      ids.append(node.node_id)
    all_blocks = np.concatenate(blocks) if blocks else EMPTY_IDS
    self._num_segments -= int(all_blocks.shape[0])
    self._evicted_nodes += len(ids)
    self._evicted_tokens += num_tokens
    self._evictions += int(bool(ids))
    return Eviction(
        RefDeltas.from_pairs(all_blocks, -1),
        tuple(ids),
        num_tokens,
        int(all_blocks.shape[0]),
        freed,
    )

  def evict(
      self,
      *,
      num_blocks: int | None = None,
      ref_count: Any = None,
      num_tokens: int | None = None,
      policy: str | None = None,
      countable: Any = None,
  ) -> Eviction:
    """Evicts unlocked, unpinned leaves by policy until a target is reached.

    Args:
      num_blocks: stop once the decrefs would free this many blocks (needs ``ref_count``).
      ref_count: the pool's counts: ``int[num_blocks]``, or a lookup
        ``f(block_ids: int64[k]) -> int[k]`` asked only about the blocks considered.
      num_tokens: instead, stop once this many tokens are evicted.
      policy: ``"lru"``, or ``"cost"`` (fewest hit tokens per stored token first).
      countable: ``bool[num_blocks]``: the blocks that count toward ``num_blocks``.

    Returns the ``Eviction`` (short of the target when nothing else is evictable).
    Raises ``ValueError``, ``RefCountMismatchError``; nothing changes on error.
    """
    policy = self.policy if policy is None else policy
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    rc, mask = self._planner.check_targets(num_blocks, ref_count, num_tokens, countable)
    now = self._now()
    key = lru_key if policy == "lru" else cost_key
    chosen, freed = self._planner.select(
        lambda n: n.lock_ref == 0 and not n.is_pinned(now), key, num_blocks, rc, num_tokens,
        mask, self.granularity, lru_index=policy == "lru" and not callable(rc),
    )
    return self._commit(chosen, freed)

  def gc_mark(self, ttl: float) -> GcMark:
    """GC phase 1: marks the unlocked, unpinned nodes idle for ``ttl`` or longer.

    Earlier marks are cleared; a node touched after marking loses its mark.
    """
    if not ttl >= 0:
      raise ValueError(f"ttl must be >= 0, got {ttl!r}")
    now = self._now()
    count = tokens = 0
    for node in self.tree.nodes():
      mark = node.lock_ref == 0 and not node.is_pinned(now) and now - node.last_access >= ttl
      node.gc_marked = mark
      if mark:
        count += 1
        tokens += node.num_tokens
    return GcMark(count, tokens)

  def gc_evict(
      self,
      *,
      num_blocks: int | None = None,
      ref_count: Any = None,
      num_tokens: int | None = None,
      order: str = "high_first",
      countable: Any = None,
  ) -> Eviction:
    """GC phase 2: evicts marked nodes in block-address order (targets as in ``evict``).

    ``"high_first"`` frees the top of the pool first: allocation is lowest-first, so
    less is left to compact.
    """
    if order not in GC_ORDERS:
      raise ValueError(f"order must be one of {GC_ORDERS}, got {order!r}")
    rc, mask = self._planner.check_targets(num_blocks, ref_count, num_tokens, countable)
    now = self._now()
    chosen, freed = self._planner.select(
        lambda n: n.gc_marked and n.lock_ref == 0 and not n.is_pinned(now),
        gc_key(order), num_blocks, rc, num_tokens, mask, self.granularity,
    )
    return self._commit(chosen, freed)

  def evictable(self, *, bytes_per_token: int = 0, ref_count: Any = None) -> EvictableReport:
    """What eviction could reclaim now; ``bytes_per_token`` for ``num_bytes``,
    ``ref_count`` (optional) for ``num_blocks``.
    """
    return self._planner.evictable(self._now(), bytes_per_token=bytes_per_token,
                                   ref_count=ref_count)

  # ------------------------------------------------------------------ compaction
  def apply_remap(self, remap: Any) -> None:
    """Follows compaction: every held block id ``b`` becomes ``remap[b]``.

    Raises ``RefCountMismatchError`` (not 1-D integer, too short, out of range, two
    held blocks sent to one); nothing changes on error.
    """
    rm = np.asarray(remap)
    if rm.ndim != 1 or rm.dtype == np.bool_ or not np.issubdtype(rm.dtype, np.integer):
      raise RefCountMismatchError(
          f"remap must be a 1-D integer array, got " f"{rm.dtype}{rm.shape}"
      )
    nodes = [n for n in self.tree.nodes() if n.value.shape[0]]
    if not nodes:
      return
    used = np.unique(np.concatenate([n.value[:, 0] for n in nodes]))
    if int(used[-1]) >= rm.shape[0]:
      raise RefCountMismatchError(
          f"tree references block {int(used[-1])} but " f"remap has {rm.shape[0]} entries"
      )
    new = rm[used]
    if (new < 0).any() or (new >= rm.shape[0]).any():
      raise RefCountMismatchError("remap values must lie in [0, num_blocks)")
    if np.unique(new).shape[0] != used.shape[0]:
      raise RefCountMismatchError("remap sends two referenced blocks to one block")
    rm32 = rm.astype(np.int32)
    updated = []
    for n in nodes:
      segs = n.value.copy()
      segs[:, 0] = rm32[segs[:, 0]]
      updated.append(segs)
    for n, segs in zip(nodes, updated):
      n.value = segs

  # ------------------------------------------------------------------ reporting
  def node_segments(self, node: NodeId) -> np.ndarray:
    """int32[n, 3]: a copy of a node's segments."""
    return self._node(node).value.copy()

  def segment_refs(self) -> np.ndarray:
    """int32[n, 3]: every segment the tree holds (one pool reference each)."""
    parts = [n.value for n in self.tree.nodes() if n.value.shape[0]]
    return np.concatenate(parts).astype(np.int32) if parts else EMPTY_SEGMENTS.copy()

  def tree_ref_counts(self, num_blocks: int) -> np.ndarray:
    """int32[num_blocks]: the tree's references per block."""
    refs = self.segment_refs()[:, 0]
    if refs.size and int(refs.max()) >= num_blocks:
      raise RefCountMismatchError(
          f"tree references block {int(refs.max())} >= " f"num_blocks={num_blocks}"
      )
    return np.bincount(refs, minlength=num_blocks).astype(np.int32)

  @property
  def num_tokens(self) -> int:
    return self.tree.num_tokens

  @property
  def num_segments(self) -> int:
    return self._num_segments

  def stats(self, namespace: Hashable | None = None) -> HitStats:
    """Hit statistics of one namespace, or of all namespaces when None."""
    return self.tree.stats(namespace)

  def counters(self) -> CacheCounters:
    return CacheCounters(
        len(self.tree),
        self.tree.num_tokens,
        self._num_segments,
        self._inserted_tokens,
        self._evicted_nodes,
        self._evicted_tokens,
        self._evictions,
    )
