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
import heapq
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from radix.tree import (HitStats, Node, NodeId, RadixTree, RadixTreeError, as_tokens)

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

POLICIES = ("lru", "cost")
GRANULARITIES = ("block", "node")
GC_ORDERS = ("high_first", "low_first")

# `RefDeltas.from_pairs` of at most this many entries sums them in a dict.
SMALL_PAIRS = 64
# Segment arrays of at most this many rows are checked and walked in plain Python.
SMALL_SEGMENTS = 64

_EMPTY_SEGMENTS = np.zeros((0, 3), np.int32)
_EMPTY_IDS = np.zeros((0,), np.int32)
_I32 = np.iinfo(np.int32)
_EXPECTED = "an int32[n, 3] array of (block, start, length) rows"

Segments = npt.NDArray[np.int32]
"""``int32[n, 3]`` rows ``(block, start, length)`` (see the module docstring)."""


class InvalidSegmentsError(RadixTreeError, ValueError):
  """Segments are malformed or do not cover the tokens they are given with.

  A wrong layout's message names the expected ``int32[n, 3]`` rows and what was given.
  """


class RefCountMismatchError(RadixTreeError, ValueError):
  """A ref_count / remap array disagrees with the references the tree holds."""


def as_segments(segments: Any, *, block_size: int, name: str = "segments") -> Segments:
  """Validates segments and returns them as a C-contiguous ``int32[n, 3]`` array.

  The layout check is the same as ``paged_kv.core.segment_format.as_segments``
  (radix cannot import ``paged_kv``; a test keeps the two in agreement), plus the
  bounds a block of ``block_size`` tokens sets.

  Args:
    segments: array-like of shape [n, 3], rows ``(block, start, length)``; an empty
      array-like (``[]``, shape ``(0, 3)``) is no segment.
    block_size: tokens per block.
    name: the argument's name, for the error message.

  Raises:
    InvalidSegmentsError: not ``[n, 3]``, not integers, values outside int32, a
      tuple of three 1-D arrays (the column layout), negative block or start,
      length < 1, or ``start + length > block_size``.
  """
  if (type(segments) is np.ndarray and segments.dtype == np.int32 and segments.ndim == 2
      and segments.shape[1] == 3 and 0 < segments.shape[0] <= SMALL_SEGMENTS
      and segments.flags.c_contiguous):
    # What the pool hands out: the bounds checked row by row, no conversion.
    rows = segments.tolist()
    if any(b < 0 for b, _, _ in rows):
      raise InvalidSegmentsError(f"{name}: segment block ids must be >= 0")
    if any(st < 0 or ln < 1 or st + ln > block_size for _, st, ln in rows):
      raise InvalidSegmentsError(
          f"every segment needs start >= 0, length >= 1, start + length <= "
          f"block_size={block_size}"
      )
    return segments
  if isinstance(segments, tuple) and len(segments) == 3 and all(
      getattr(x, "ndim", None) == 1 for x in segments):
    shapes = ", ".join(str(tuple(x.shape)) for x in segments)
    raise InvalidSegmentsError(
        f"{name} must be {_EXPECTED}; got a tuple of three 1-D arrays ({shapes}), the "
        f"column layout: pass np.stack([block, start, length], axis=1)")
  try:
    arr = np.asarray(segments)
  except (TypeError, ValueError) as e:
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got "
                               f"{type(segments).__name__} ({e})") from e
  if (arr.ndim == 1 and arr.size == 0) or arr.shape == (0, 3):
    return _EMPTY_SEGMENTS.copy()
  if arr.ndim != 2 or arr.shape[1] != 3:
    hint = (" (three columns? pass np.stack([block, start, length], axis=1))"
            if arr.ndim == 2 and arr.shape[0] == 3 else "")
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got shape {tuple(arr.shape)} "
                               f"{arr.dtype}{hint}")
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got shape {tuple(arr.shape)} "
                               f"{arr.dtype}")
  if arr.min() < _I32.min or arr.max() > _I32.max:
    raise InvalidSegmentsError(f"{name} must be {_EXPECTED}; got values outside int32 "
                               f"({arr.min()}..{arr.max()})")
  blocks, starts, lens = arr[:, 0], arr[:, 1], arr[:, 2]
  if (blocks < 0).any():
    raise InvalidSegmentsError(f"{name}: segment block ids must be >= 0")
  if (starts < 0).any() or (lens < 1).any() or (starts + lens > block_size).any():
    raise InvalidSegmentsError(
        f"every segment needs start >= 0, length >= 1, start + length <= "
        f"block_size={block_size}"
    )
  return np.ascontiguousarray(arr, dtype=np.int32)


def _split_point(segs: np.ndarray, offset: int) -> tuple[int, int]:
  """``(i, begin)``: the segments wholly within the first ``offset`` tokens and the
  tokens they cover (``segs`` int32[n, 3])."""
  if segs.shape[0] <= SMALL_SEGMENTS:
    i = begin = 0
    for length in segs[:, 2].tolist():
      if begin + length > offset:
        break
      begin += length
      i += 1
    return i, begin
  ends = np.cumsum(segs[:, 2], dtype=np.int64)
  i = int(np.searchsorted(ends, offset, side="right"))
  return i, int(ends[i - 1]) if i > 0 else 0


def _cut(segs: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray, bool]:
  """Splits ``segs`` (int32[n, 3]) after ``offset`` tokens: (head, tail, cut_made)."""
  i, begin = _split_point(segs, offset)
  if begin == offset:
    return segs[:i], segs[i:], False
  k = offset - begin
  b, s, l = (int(x) for x in segs[i])
  head = np.concatenate([segs[:i], np.array([[b, s, k]], np.int32)])
  tail = np.concatenate([np.array([[b, s + k, l - k]], np.int32), segs[i + 1 :]])
  return head, tail, True


@dataclasses.dataclass(frozen=True)
class RefDeltas:
  """Reference-count changes for the pool, aggregated per block.

  Attributes:
    block_ids: int32[k], unique and ascending.
    deltas: int32[k], nonzero; apply as ``ref_count[block_ids] += deltas``.
  """

  block_ids: np.ndarray
  deltas: np.ndarray

  @staticmethod
  def empty() -> RefDeltas:
    return RefDeltas(_EMPTY_IDS.copy(), _EMPTY_IDS.copy())

  @staticmethod
  def from_pairs(block_ids: Any, deltas: Any) -> RefDeltas:
    """Aggregates (possibly repeated) block ids with their deltas."""
    block_ids = np.asarray(block_ids, np.int64).reshape(-1)
    if block_ids.size == 0:
      return RefDeltas.empty()
    deltas = np.asarray(deltas, np.int64)
    if block_ids.size <= SMALL_PAIRS:  # a few (an insert, an eviction): a dict, no sort of arrays
      acc: dict[int, int] = {}
      if deltas.ndim == 0:
        d = int(deltas)
        for b in block_ids.tolist():
          acc[b] = acc.get(b, 0) + d
      else:
        for b, d in zip(block_ids.tolist(), np.broadcast_to(deltas, block_ids.shape).tolist()):
          acc[b] = acc.get(b, 0) + d
      keys = [b for b in sorted(acc) if acc[b]]
      return RefDeltas(np.array(keys, np.int32), np.array([acc[b] for b in keys], np.int32))
    deltas = np.broadcast_to(deltas, block_ids.shape)
    uniq, inv = np.unique(block_ids, return_inverse=True)
    summed = np.bincount(inv, weights=deltas, minlength=uniq.size).astype(np.int64)
    keep = summed != 0
    return RefDeltas(uniq[keep].astype(np.int32), summed[keep].astype(np.int32))

  @staticmethod
  def increfs(block_ids: np.ndarray) -> RefDeltas | None:
    """One reference more on each of ``block_ids`` (``int32[k]``, ``k >= 1``) when
    they are distinct (a new leaf's segments, the usual insert): ``from_pairs(block_ids,
    1)`` without its per-id sums. None when a block repeats (``from_pairs`` then)."""
    ids = block_ids.tolist()
    if len(set(ids)) != len(ids):
      return None
    return RefDeltas(np.sort(block_ids).astype(np.int32, copy=False), np.ones(len(ids), np.int32))

  def __add__(self, other: RefDeltas) -> RefDeltas:
    return RefDeltas.from_pairs(
        np.concatenate([self.block_ids, other.block_ids]),
        np.concatenate([self.deltas, other.deltas]),
    )

  def __len__(self) -> int:
    return int(self.block_ids.shape[0])

  @property
  def total(self) -> int:
    """Net change in the number of references (sum of deltas)."""
    return int(self.deltas.sum(dtype=np.int64))

  def apply_to(self, ref_count: np.ndarray) -> None:
    """Applies the deltas in place to a host ``ref_count`` array (for simulators)."""
    np.add.at(ref_count, self.block_ids, self.deltas)


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
class Eviction:
  """Result of ``evict`` / ``gc_evict``.

  Attributes:
    ref_deltas: tree decrefs (-1 per evicted segment) to apply to the pool.
    nodes: evicted node ids, children before parents.
    num_tokens: tokens evicted.
    num_segments: segment references dropped.
    num_freed_blocks: blocks whose ref_count would reach 0 given the ``ref_count``
      passed in; None when none was passed.
  """

  ref_deltas: RefDeltas
  nodes: tuple[NodeId, ...]
  num_tokens: int
  num_segments: int
  num_freed_blocks: int | None


@dataclasses.dataclass(frozen=True)
class GcMark:
  """Result of ``gc_mark``: nodes (and their tokens) marked as GC candidates."""

  num_nodes: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class EvictableReport:
  """What eviction could reclaim now (unlocked, unpinned nodes).

  Attributes:
    num_nodes, num_tokens, num_segments: evictable nodes, their tokens and segments.
    num_bytes: ``num_tokens * bytes_per_token``.
    num_blocks: blocks that would become free if all of it were evicted (given
      ``ref_count``; None without it).
    num_gc_marked_tokens: tokens currently marked by the GC's phase 1.
  """

  num_nodes: int
  num_tokens: int
  num_segments: int
  num_bytes: int
  num_blocks: int | None
  num_gc_marked_tokens: int


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


def _lru_key(node: Node) -> tuple:
  return (node.last_access, node.access_seq)


def _cost_key(node: Node) -> tuple:
  return (node.hit_tokens / max(node.num_tokens, 1), node.last_access, node.access_seq)


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
    self._scratch = np.zeros((0,), np.int64)  # per block, zero between calls
    self._known = np.zeros((0,), np.int64)  # per block, -1 between calls
    self.granularity = granularity

  # ------------------------------------------------------------------ internals
  def _split_segments(self, segs: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    head, tail, cut = _cut(segs, offset)
    if cut:
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
      return MatchResult(0, _EMPTY_SEGMENTS.copy(), None, RefDeltas.empty())
    parts = [self._node(i).value for i in m.path]
    last = self._node(m.path[-1])
    inside = False
    if m.last_offset < last.num_tokens:
      parts[-1], _, inside = _cut(parts[-1], m.last_offset)
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
        namespace, tokens, lambda prefix_len: _cut(segs, prefix_len)[1].copy(), now=now
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
    i, t0 = _split_point(segs, prefix_len)
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
  def _check_ref_count(self, ref_count: Any) -> np.ndarray | Callable[[np.ndarray], np.ndarray]:
    if callable(ref_count):
      return ref_count
    rc = np.asarray(ref_count)
    if rc.ndim != 1 or not np.issubdtype(rc.dtype, np.integer):
      raise RefCountMismatchError(
          f"ref_count must be a 1-D integer array or a lookup, got " f"{rc.dtype}{rc.shape}"
      )
    self._grow(rc.shape[0])
    return rc

  def _select(
      self,
      eligible: Callable[[Node], bool],
      key: Callable[[Node], tuple],
      num_blocks: int | None,
      ref_count: np.ndarray | Callable[[np.ndarray], np.ndarray] | None,
      num_tokens: int | None,
      countable: np.ndarray | None = None,
      granularity: str = "block",
      lru_index: bool = False,
  ) -> tuple[list[tuple[Node, int]], int | None]:
    """Picks what to evict without changing anything.

    Returns ``(chosen, freed)``: ``chosen`` lists ``(node, first)`` in eviction order
    (children before parents), ``first`` the index of the node's first evicted
    segment (0: the whole node; > 0: only its tail segments ``[first:]`` go, the
    node is trimmed). A node's segments are taken tail first, so with
    ``granularity="block"`` the last node is trimmed to what the target needs.

    ``ref_count`` is the pool's counts: an array, or a lookup ``f(block_ids) ->
    counts`` called on few blocks at a time (prefetched in doubling batches), so a
    caller never has to copy the whole array from a device.

    ``lru_index`` (``key`` must be ``_lru_key``): take the leaves from the tree's
    LRU index (`RadixTree.lru_pop`, O(log leaves) each, put back at the end) in
    the same order as a heap over every eligible leaf would give them, instead of
    building that heap (O(leaves) per call). ``heap`` then holds only the parents
    this selection makes leaves.
    """
    tree = self.tree
    if lru_index:
      heap: list = []
    else:
      heap = [(key(n), n.node_id, n) for n in tree.leaves() if eligible(n)]
      heapq.heapify(heap)
    taken_off: list[Node] = []  # off the LRU index: put back at the end

    def next_node() -> Node | None:
      if not lru_index:
        return heapq.heappop(heap)[2] if heap else None
      while True:
        top = tree.lru_peek()
        if heap and (top is None or (heap[0][0], heap[0][1]) < ((top[0], top[1]), top[2])):
          return heapq.heappop(heap)[2]
        if top is None:
          return None
        node = tree.lru_pop()
        taken_off.append(node)
        if eligible(node):
          return node
    remaining: dict[int, int] = {}
    chosen: list[tuple[Node, int]] = []
    tokens = 0
    freed = 0 if ref_count is not None else None
    trim = granularity == "block"
    touched: list[np.ndarray] = []  # entries of _scratch / _known to reset
    prefetch = 8
    # A host array (or no) ref_count: each node is taken in plain Python, the tree's
    # references chosen so far counted per block in `pending`, until a node longer
    # than `SMALL_SEGMENTS`. Then, or with a lookup: numpy, the counts in `_scratch`
    # (a lookup's answers in `_known`).
    plain = not callable(ref_count)
    pending: dict[int, int] = {}

    def counts(blocks: np.ndarray) -> np.ndarray:
      nonlocal prefetch
      if not callable(ref_count):
        if int(blocks.max()) >= ref_count.shape[0]:
          raise RefCountMismatchError(
              f"tree references block {int(blocks.max())} but ref_count has "
              f"{ref_count.shape[0]} entries")
        return ref_count[blocks].astype(np.int64)
      if (self._known[blocks] < 0).any():
        # This node's blocks plus those of the next few candidates: one lookup.
        ahead = [n.value[:, 0] for _, _, n in heapq.nsmallest(prefetch, heap)]
        prefetch *= 2
        ids = np.unique(np.concatenate([blocks] + ahead)).astype(np.int64)
        self._grow(int(ids[-1]) + 1)
        ids = ids[self._known[ids] < 0]
        got = np.asarray(ref_count(ids)).reshape(-1)
        if got.shape != ids.shape:
          raise RefCountMismatchError(
              f"ref_count lookup returned {got.shape[0]} counts for {ids.shape[0]} blocks")
        self._known[ids] = got
        touched.append(ids)
      return self._known[blocks]

    try:
      while True:
        if num_tokens is not None and tokens >= num_tokens:
          break
        if num_blocks is not None and freed is not None and freed >= num_blocks:
          break
        node = next_node()
        if node is None:
          break
        if plain and node.value.shape[0] > SMALL_SEGMENTS:
          # A long node: the vectorised path from here on, the counts so far moved over.
          plain = False
          if pending:
            ids = np.fromiter(pending, np.int64, len(pending))
            self._grow(int(ids.max()) + 1)
            self._scratch[ids] += np.fromiter(pending.values(), np.int64, len(pending))
            touched.append(ids)
        if plain:  # a host ref_count (or none): the node's segments one by one
          k, n_segs, tokens, freed = self._take_plain(node.value, pending, tokens, freed,
                                                      num_blocks, ref_count, num_tokens,
                                                      countable, trim)
        else:
          k, n_segs, tokens, freed = self._take_looked_up(
              node.value, None if ref_count is None else counts, touched, tokens, freed,
              num_blocks, num_tokens, countable, trim)
        first = n_segs - k
        chosen.append((node, first))
        if first > 0:
          break  # the node is trimmed: the target is met
        parent = node.parent
        if parent is not None and parent.parent is not None:
          pid = parent.node_id
          left_children = remaining.get(pid, len(parent.children)) - 1
          remaining[pid] = left_children
          if left_children == 0 and eligible(parent):
            heapq.heappush(heap, (key(parent), pid, parent))
    finally:
      for ids in touched:
        self._scratch[ids] = 0
        self._known[ids] = -1
      for node in taken_off:
        tree.lru_push(node)  # nothing changed yet: the commit removes the chosen ones
    return chosen, freed

  def _take_looked_up(self, segs: np.ndarray, counts: Callable[[np.ndarray], np.ndarray] | None,
                      touched: list, tokens: int, freed: int | None, num_blocks: int | None,
                      num_tokens: int | None, countable: np.ndarray | None,
                      trim: bool) -> tuple[int, int, int, int | None]:
    """`_take_plain`, vectorised, with counts from `counts(blocks)` (None: no
    ref_count); the tree's references chosen so far are counted in `_scratch` (its
    entries to reset appended to `touched`)."""
    rev = segs[::-1]  # tail first
    blocks = rev[:, 0].astype(np.int64)
    self._grow(int(blocks.max()) + 1)
    stop = np.zeros(blocks.shape, bool)
    cum_tokens = tokens + np.cumsum(rev[:, 2], dtype=np.int64)
    if num_tokens is not None:
      stop |= cum_tokens >= num_tokens
    k = blocks.shape[0]
    if counts is None:
      if trim and stop.any():
        k = int(np.argmax(stop)) + 1
      np.add.at(self._scratch, blocks[:k], 1)
      touched.append(blocks[:k])
      return k, blocks.shape[0], int(cum_tokens[k - 1]), freed
    rc = counts(blocks)
    if np.unique(blocks).shape[0] == blocks.shape[0]:
      repeat = 0
    else:  # a block held twice by this node: count its references in order
      seen: dict[int, int] = {}
      repeat = np.zeros(blocks.shape, np.int64)
      for j, b in enumerate(blocks.tolist()):
        repeat[j] = seen.get(b, 0)
        seen[b] = repeat[j] + 1
    left = rc - (self._scratch[blocks] + repeat + 1)
    if (left < 0).any():
      b = int(blocks[np.argmax(left < 0)])
      raise RefCountMismatchError(
          f"ref_count[{b}]={int(rc[np.argmax(left < 0)])} is below the tree's "
          f"references on it")
    now_free = left == 0
    if countable is not None:
      now_free &= countable[blocks]
    cum_freed = freed + np.cumsum(now_free, dtype=np.int64)
    if num_blocks is not None:
      stop |= cum_freed >= num_blocks
    if trim and stop.any():
      k = int(np.argmax(stop)) + 1
    taken = blocks[:k]
    np.add.at(self._scratch, taken, 1)
    touched.append(taken)
    return k, blocks.shape[0], int(cum_tokens[k - 1]), int(cum_freed[k - 1])

  @staticmethod
  def _take_plain(segs: np.ndarray, pending: dict[int, int], tokens: int, freed: int | None,
                  num_blocks: int | None, ref_count: np.ndarray | None,
                  num_tokens: int | None, countable: np.ndarray | None,
                  trim: bool) -> tuple[int, int, int, int | None]:
    """One node of `_select` with a host `ref_count` (or none), in plain Python.

    The node's segments go tail first; each drops one tree reference on its block
    (`pending` counts the ones this selection dropped before, and is updated for
    the segments taken). Returns `(k, num_segments, tokens, freed)`: the first `k`
    segments (tail first) are taken, the totals after them.

    Raises:
      RefCountMismatchError: a block's `ref_count` is below the tree's references
        on it (checked on every segment of the node), or beyond `ref_count`.
    """
    rows = segs.tolist()
    rows.reverse()
    n = len(rows)
    if ref_count is not None:
      blocks = [r[0] for r in rows]
      top = max(blocks)
      if top >= ref_count.shape[0]:
        raise RefCountMismatchError(f"tree references block {top} but ref_count has "
                                    f"{ref_count.shape[0]} entries")
      rc = ref_count[blocks].tolist()
      dyn = countable[blocks].tolist() if countable is not None else None
      seen: dict[int, int] = {}
      lefts = []
      for b, r in zip(blocks, rc):
        before = seen.get(b, 0)
        seen[b] = before + 1
        left = r - (pending.get(b, 0) + before + 1)
        if left < 0:
          raise RefCountMismatchError(f"ref_count[{b}]={r} is below the tree's references on it")
        lefts.append(left)
    k = n
    for j in range(n):
      tokens += rows[j][2]
      stop = num_tokens is not None and tokens >= num_tokens
      if ref_count is not None:
        if lefts[j] == 0 and (dyn is None or dyn[j]):
          freed += 1
        stop = stop or (num_blocks is not None and freed >= num_blocks)
      if trim and stop:
        k = j + 1
        break
    for r in rows[:k]:
      pending[r[0]] = pending.get(r[0], 0) + 1
    return k, n, tokens, freed

  def _grow(self, size: int) -> None:
    """Makes the per-block scratch arrays cover block ids below ``size``."""
    old = self._scratch.shape[0]
    if old < size:
      new = max(size, 2 * old)
      self._scratch = np.concatenate([self._scratch, np.zeros(new - old, np.int64)])
      self._known = np.concatenate([self._known, np.full(new - old, -1, np.int64)])

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
    all_blocks = np.concatenate(blocks) if blocks else _EMPTY_IDS
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

  @staticmethod
  def _check_countable(countable: Any, ref_count: np.ndarray | None) -> np.ndarray | None:
    if countable is None:
      return None
    mask = np.asarray(countable)
    if mask.dtype != np.bool_ or mask.ndim != 1 or (
        ref_count is not None and not callable(ref_count) and mask.shape != ref_count.shape):
      raise ValueError(f"countable must be a bool[num_blocks] mask like ref_count, got "
                       f"{mask.dtype}{mask.shape}")
    return mask

  def _validate_targets(
      self, num_blocks: int | None, ref_count: Any, num_tokens: int | None
  ) -> np.ndarray | None:
    if (num_blocks is None) == (num_tokens is None):
      raise ValueError("give exactly one of num_blocks (with ref_count) or " "num_tokens")
    if num_blocks is not None:
      if ref_count is None:
        raise ValueError(
            "num_blocks needs the pool's ref_count to know which " "decrefs free a block"
        )
      if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    if num_tokens is not None and num_tokens < 0:
      raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return self._check_ref_count(ref_count) if ref_count is not None else None

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
    rc = self._validate_targets(num_blocks, ref_count, num_tokens)
    mask = self._check_countable(countable, rc)
    now = self._now()
    key = _lru_key if policy == "lru" else _cost_key
    chosen, freed = self._select(
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
    rc = self._validate_targets(num_blocks, ref_count, num_tokens)
    mask = self._check_countable(countable, rc)
    now = self._now()
    sign = -1 if order == "high_first" else 1

    def key(n: Node) -> tuple:
      blocks = n.value[:, 0]
      addr = int(blocks.max() if sign < 0 else blocks.min()) if blocks.size else 0
      return (sign * addr, n.last_access, n.access_seq)

    chosen, freed = self._select(
        lambda n: n.gc_marked and n.lock_ref == 0 and not n.is_pinned(now),
        key,
        num_blocks,
        rc,
        num_tokens,
        mask,
        self.granularity,
    )
    return self._commit(chosen, freed)

  def evictable(self, *, bytes_per_token: int = 0, ref_count: Any = None) -> EvictableReport:
    """Reports what could be evicted now (unlocked and unpinned nodes).

    Args:
      bytes_per_token: KV bytes per token (2 * layers * kv_heads * head_dim *
        itemsize) for ``num_bytes``.
      ref_count: optional pool ref_count mirror, for ``num_blocks``.
    """
    now = self._now()
    nodes = tokens = segments = marked = 0
    blocks = []
    for node in self.tree.nodes():
      if node.gc_marked:
        marked += node.num_tokens
      if node.lock_ref == 0 and not node.is_pinned(now):
        nodes += 1
        tokens += node.num_tokens
        segments += node.value.shape[0]
        blocks.append(node.value[:, 0])
    num_blocks = None
    if ref_count is not None:
      rc = self._check_ref_count(ref_count)
      d = RefDeltas.from_pairs(np.concatenate(blocks) if blocks else _EMPTY_IDS, 1)
      if callable(rc):
        held = np.asarray(rc(d.block_ids.astype(np.int64))).reshape(-1) if len(d) else _EMPTY_IDS
      else:
        if d.block_ids.size and int(d.block_ids.max()) >= rc.shape[0]:
          raise RefCountMismatchError("tree references a block beyond ref_count")
        held = rc[d.block_ids]
      num_blocks = int(np.count_nonzero(held == d.deltas))
    return EvictableReport(
        nodes, tokens, segments, tokens * int(bytes_per_token), num_blocks, marked
    )

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
    return np.concatenate(parts).astype(np.int32) if parts else _EMPTY_SEGMENTS.copy()

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
