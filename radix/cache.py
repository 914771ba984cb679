"""Prefix cache: radix-tree nodes bound to KV segments of the block pool.

Host-only bookkeeping: numpy, no JAX, nothing from ``paged_kv``. The cache never
touches the pool; every call returns what the caller must apply to it. With a
``paged_kv.BlockPool`` that caller is ``paged_kv.cache.cached_pool.CachedPool``,
which owns both and applies every delta itself; a simulator (host ``ref_count``
mirror) applies them with ``RefDeltas.apply_to``.

Segments
--------
A segment is one row ``(block, start, length)`` of an ``int32[n, 3]`` array
(``Segments``): physical block id, first token slot in the block, number of tokens
(``1 <= length`` and ``start + length <= block_size``). It is the one segment format
of the library: ``paged_kv``'s ``BlockPool.segments()`` returns it and
``open_sequence(segments=)`` takes it, so a match's segments open a sequence and a
sequence's segments are inserted as they are. A node's tokens are the concatenation
of its segments, in order. Splitting a node at token ``t`` splits its segment list at ``t``;
when ``t`` falls inside a segment ``(b, s, l)`` that segment is cut in two,
``(b, s, k)`` and ``(b, s + k, l - k)``, without copying any KV. The cut leaves one more
segment on ``b`` held by the tree, hence a tree incref of +1 on ``b``.

Who increfs what (the one rule)
-------------------------------
``ref_count[b]`` in the pool counts segment references on ``b``: one per segment in a
live sequence's table plus one per segment held by a cache node. Hence:

* The **sequence side** is the pool's job. ``match`` returns segments to put into a
  new sequence's table; the pool's ``open_sequence(segments)`` increfs them (one per
  segment), and ``release`` decrefs the sequence's segments. The cache returns no
  delta for these.
* The **tree side** is reported by the cache as a ``RefDeltas`` (aggregated per block)
  that the caller applies with ``apply_ref_deltas``: +1 per segment a node gains
  (``insert`` of new tokens, a cut by a node split, ``rebind_segments``), -1 per
  segment a node loses (eviction, ``rebind_segments``).

So at every moment ``ref_count == table refs + bincount(cache.segment_refs()[:, 0])``
and the sum of every ``RefDeltas`` the cache ever returned equals the tree's
references. ``match`` never changes tree references (it never splits a node; a match
ending inside a node returns a cut copy of the segment for the sequence only), unless
``match(lock=True, split=True)`` splits the deepest node at the match point so that
only the matched tokens are locked; then its cut comes back in ``ref_deltas``.

Locks, pins and eviction
------------------------
``match(..., lock=True)`` locks the deepest node it touched (and its ancestors) until
``unlock``; locked nodes are never evicted. ``reset_locks(held)`` rebuilds every lock
count from the locks a caller still holds (after an interrupted operation).
Eviction's block target can count only some blocks (``countable``, e.g. the pool's
dynamic region: a freed base-region block is not a free block for new sequences). ``insert(..., pin_ttl=)`` or ``pin`` keeps a
prefix (e.g. a system prompt) until its TTL expires. Under pressure ``evict`` removes
unlocked, unpinned leaves (and parents that become leaves) by policy:

* ``"lru"`` (default): least recently used first;
* ``"cost"``: fewest hit tokens per stored token first (ties: LRU), so a long,
  rarely reused branch goes before a short, hot one.

With ``granularity="block"`` (the default) a leaf's segments go tail first and the
last leaf is trimmed (split at a segment boundary, no cut) to what the target needs,
so freeing one block never drops a whole long leaf; ``"node"`` evicts whole leaves.

Continuing a shared partial block: a match that ends at the end of a node's partial
last segment ``(b, s, l)`` reports ``MatchResult.continuable``; a pool that copies
that tail into a fresh block ``c`` and appends after it (``CachedPool.open`` does,
with the pool's ``cow_split``) hands ``insert`` a sequence whose segment straddles the
prefix the tree holds. ``insert`` then rebinds the node's last segment to the
sequence's copy on ``c`` (-1 on ``b``, +1 on ``c``), so ``b``'s unused slots are not
kept alive by the tree: no dead slots per turn of a conversation.

Two-phase GC: ``gc_mark(ttl)`` marks nodes not touched for ``ttl`` (a later touch
unmarks them); ``gc_evict`` evicts only marked nodes, in block-address order, and only
as many as the pool asks for. How many blocks a set of decrefs frees is the pool's
business; given the pool's ``ref_count`` (a host mirror, or a lookup the cache asks for
the blocks of the nodes it considers only), ``evict``/``gc_evict`` stop once their
decrefs would free the requested number of blocks and report that count.

Compaction: ``apply_remap(remap)`` with ``remap[old] = new`` rewrites every block id.

``cache.tree`` is exposed for reading (statistics, enumeration); change the tree only
through the cache (``split`` rather than ``tree.split``) so no reference is missed.
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
    length: matched tokens.
    segments: int32[n, 3], the KV of tokens ``[:length]``, to put into the new
      sequence's table (``open_sequence`` increfs them).
    node: locked node handle (pass to ``unlock``), or None when nothing was
      matched or ``lock=False``.
    ref_deltas: tree reference changes; empty unless ``match(split=True)`` split
      the deepest node and cut a segment (+1 on its block).
    continuable: the last segment ``(b, s, l)`` is partial (``s + l <
      block_size``) and ends where the tree's segment on ``b`` ends (the match
      did not stop inside a segment): the sequence may copy it to a fresh block
      and append after it; ``insert`` then moves the tree's reference to the copy.
  """

  length: int
  segments: np.ndarray
  node: NodeId | None
  ref_deltas: RefDeltas
  continuable: bool = False


@dataclasses.dataclass(frozen=True)
class PackCandidate:
  """A short segment (< block_size tokens) held by the tree, worth packing (issue B).

  After the pool copies ``segment``'s slots elsewhere, call
  ``rebind_segment(node, segment, new_segment)``. Its deltas (+1 new block, -1 old
  block) describe the tree's reference moving. Apply them only if the packing did
  not move the reference itself: ``paged_kv`` ``pack_slots`` with an external owner
  already transfers it, so there the deltas are for checking only (compare them with
  the pack result's deltas; applying them again would double-count).
  """

  node: NodeId
  segment: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class InsertOutcome:
  """Result of ``PrefixCache.insert``.

  Attributes:
    prefix_len: leading tokens the cache already held (their segments stay the
      tree's own; the sequence's copies are not referenced by the tree).
    num_new_tokens: tokens the tree took references for.
    node: the new leaf, or None when nothing new was stored.
    ref_deltas: tree increfs: +1 per new segment, +1 per segment cut by a split;
      and when the sequence continued a copy of the held prefix's partial tail
      (see the module docstring), +1 on the copy's block, -1 on the old one.
    pack: short segments of the new leaf to pack (empty unless ``pack_tails``).
  """

  prefix_len: int
  num_new_tokens: int
  node: NodeId | None
  ref_deltas: RefDeltas
  pack: tuple[PackCandidate, ...]


@dataclasses.dataclass(frozen=True)
class CacheCounters:
  """Running totals since construction."""

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
    pack_tails: when True, ``insert`` names the new leaf's short segments to pack.
    clock: returns the current time (float, any monotone unit: TTLs use the same
      unit). Default ``time.monotonic``; simulators pass trace time.
    granularity: what eviction takes. ``"block"`` (default): a leaf's segments go
      tail first and the last leaf evicted is trimmed to what the target needs
      (the LRU leaf loses its tail blocks, as a block-LRU would); ``"node"``:
      whole leaves only.
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
    """The cache's clock (the unit TTLs and access times use)."""
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
    """Longest cached prefix of ``tokens`` in ``namespace``.

    Match all the tokens you have: to keep at least one token to compute (for the
    logits), pass ``tokens[:-1]``.

    Args:
      namespace: hashable namespace; never matches another namespace's entries.
      tokens: int32-compatible token ids, shape [n].
      lock: lock the deepest matched node until ``unlock(result.node)``.
      record: update hit statistics and access times (False: read-only probe).
      split: with ``lock``, when the match ends inside a node, split that node at
        the match point first and lock only the head (the matched tokens), so the
        unmatched tail stays evictable. A split that cuts a segment returns its
        tree incref in ``ref_deltas`` (apply it to the pool). Without ``split`` the
        whole deepest node is locked and ``ref_deltas`` is always empty.

    Raises:
      InvalidTokensError: bad tokens. InvalidNamespaceError: bad namespace.
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
    """Releases a lock taken by ``match``.

    Raises:
      StaleNodeError / LockError: unknown or unlocked node.
    """
    self.tree.unlock(node)

  # ------------------------------------------------------------------ updates
  def insert(
      self, namespace: Hashable, tokens: Any, segments: Any, *, pin_ttl: float | None = None
  ) -> InsertOutcome:
    """Stores a finished sequence: tokens and the segments holding their KV.

    The tree takes one reference per segment for the tokens it did not hold
    (``[prefix_len:]``; a segment straddling ``prefix_len`` is cut and only its
    tail is referenced). Tokens already held keep the tree's own segments.

    Args:
      namespace: hashable namespace.
      tokens: int32-compatible token ids, shape [n].
      segments: ``int32[m, 3]`` ``(block, start, length)`` rows of the sequence,
        covering exactly n tokens in order (e.g. ``BlockPool.segments(seq_id)``;
        ``paged_kv.cache.cached_pool.CachedPool.insert`` reads them itself).
      pin_ttl: if given, pin the whole inserted path for this long.

    Returns:
      InsertOutcome whose ``ref_deltas`` (increfs) the caller applies to the pool
      before releasing the sequence.

    Raises:
      InvalidTokensError / InvalidSegmentsError: bad input; nothing changes.
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
    """Moves ``node``'s partial last segment onto the sequence's copy; returns ref changes.

    ``node`` ends at token ``prefix_len``, where the sequence's segment
    ``(c, s, L)`` covering ``[t0, t0 + L)`` is cut (``t0 < prefix_len < t0 + L``):
    the sequence continued after a copy of the node's tail. The node's last
    segment ``(b, sb, lb)`` (``lb <= prefix_len - t0``, ``b != c``) becomes
    ``(c, s + prefix_len - t0 - lb, lb)``, the same tokens. Returns ``[c]`` (an
    incref) and records ``b`` in ``_rebound`` (a decref); ``[]`` when nothing moved.
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
    """Splits a node after ``offset`` tokens (any token, no KV copy).

    Use this rather than ``cache.tree.split``: the tree attribute is for reading;
    splitting it directly would skip the incref of a cut segment.

    Returns:
      (head node id, RefDeltas): +1 on the block of a segment cut in two, else empty.

    Raises:
      StaleNodeError: unknown node. ValueError: offset outside [1, num_tokens - 1].
    """
    self._pending_cuts.clear()
    head = self.tree.split(node, offset)
    deltas = RefDeltas.from_pairs(np.asarray(self._pending_cuts, np.int32), 1)
    self._pending_cuts.clear()
    return head, deltas

  def rebind_segments(self, node: NodeId, new_segments: Any) -> RefDeltas:
    """Replaces all segments of a node (e.g. after the pool moved or packed them).

    The caller must already have copied the KV so that ``new_segments``
    (``int32[n, 3]`` ``(block, start, length)`` rows) hold the node's tokens in order.

    Returns:
      RefDeltas: +1 per new segment, -1 per old segment (aggregated). Apply them
      unless the pool already transferred these references (see PackCandidate).

    Raises:
      StaleNodeError: unknown node. InvalidSegmentsError: bad segments or a
      different token count. Nothing changes on error.
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

    Both segments are one ``(block, start, length)`` row.

    Raises:
      StaleNodeError: unknown node (e.g. evicted since the PackCandidate).
      InvalidSegmentsError: ``old_segment`` not in the node (e.g. cut by a split
        since), or lengths differ, or ``new_segment`` malformed.
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
    """Rebuilds every lock count from the locks still held (``held``: one entry per
    outstanding ``match(lock=True)``; repeats count, stale ids are ignored); every
    other lock is dropped. For recovery after an interrupted caller."""
    self.tree.reset_locks(held)

  def clear(self) -> RefDeltas:
    """Drops every node, locked or pinned (e.g. when the pool can no longer vouch
    for the tree's segments); returns the tree's decrefs (-1 per segment held)."""
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
    """Pins the cached prefix of ``tokens`` for ``ttl`` time units.

    Returns the number of tokens pinned (the matched prefix; a node matched in part
    is pinned whole). Pinned nodes and their ancestors are not evictable until
    the TTL expires.
    """
    if not ttl >= 0:
      raise ValueError(f"ttl must be >= 0, got {ttl!r}")
    now = self._now()
    m = self.tree.match_prefix(namespace, tokens, now=now, record=False)
    if m.node is not None:
      self.tree.pin(m.node, now + ttl)
    return m.length

  def unpin(self, namespace: Hashable, tokens: Any) -> None:
    """Removes pins from the nodes below the prefix of ``tokens`` (inclusive)."""
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
      num_blocks: stop once the decrefs would free this many blocks given
        ``ref_count``.
      ref_count: the pool's reference counts, unchanged: an ``int[num_blocks]``
        host mirror, or a lookup ``f(block_ids: int64[k]) -> int[k]`` that is
        asked only for the blocks of the nodes considered (a few calls per
        eviction, in doubling batches; e.g. one device gather each). Required
        with ``num_blocks``; optional with ``num_tokens`` (then only used for the
        ``num_freed_blocks`` estimate).
      num_tokens: alternatively, stop once this many tokens are evicted.
      policy: ``"lru"`` or ``"cost"``; default the cache's policy.
      countable: optional ``bool[num_blocks]``: only blocks marked True count
        toward ``num_blocks`` (and ``num_freed_blocks``); e.g. the pool's dynamic
        region, since a freed base-region block serves no new sequence.

    Returns:
      Eviction; may fall short of the target when nothing else is evictable.

    Raises:
      ValueError / RefCountMismatchError: bad arguments; nothing changes.
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
    """GC phase 1: marks unlocked, unpinned nodes idle for at least ``ttl``.

    Clears earlier marks first. A node touched after marking loses its mark.
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
    """GC phase 2: evicts marked nodes, in block-address order, up to a target.

    Only leaves can go, so a marked parent goes after its marked children.
    ``order="high_first"`` evicts the node holding the highest block address first
    (allocation is lowest-first, so this frees the top of the pool and leaves less
    to compact); ``"low_first"`` the opposite. Targets (and ``countable``) as in
    ``evict``.
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
    """Reports what could be evicted now (unlocked and unpinned nodes).

    Args:
      bytes_per_token: KV bytes per token (2 * layers * kv_heads * head_dim *
        itemsize) for ``num_bytes``.
      ref_count: optional pool ref_count mirror, for ``num_blocks``.
    """
    return self._planner.evictable(self._now(), bytes_per_token=bytes_per_token,
                                   ref_count=ref_count)

  # ------------------------------------------------------------------ compaction
  def apply_remap(self, remap: Any) -> None:
    """Follows compaction: every block id ``b`` the tree holds becomes ``remap[b]``.

    Args:
      remap: int[num_blocks], ``remap[old] = new`` (identity for unmoved blocks).

    Raises:
      RefCountMismatchError: not 1-D integer, too short for a held block, values
        out of range, or two held blocks mapped to one. Nothing changes on error.
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
