"""`CachedPool`: a `BlockPool` and a `radix.PrefixCache` kept in sync by one object.

The cache returns a `RefDeltas` for every change of the tree's references, and
`CachedPool` applies each itself, so no caller can forget one:

    cp = CachedPool(pool)
    m = cp.match("tenant", prompt[:-1])     # longest cached prefix, locked
    seq = cp.open(m.segments)               # the sequence shares it
    cp.insert("tenant", tokens, seq)        # after the model step: the tree takes its refs
    cp.release([seq]); cp.unlock(m.node)
    cp.evict(num_blocks=8)                  # decrefs applied, blocks freed

`cp.pool` serves a model step's sequence-side work; `cp.cache` is a read-only view.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from paged_kv.core import compact
from paged_kv.core.errors import (InternalInconsistency, InvalidArgument, InvariantViolation,
                                  PagedKVError)
from paged_kv.core.resize import ResizeReport
from paged_kv.core.segment_format import Segments, as_segments, take_tokens
from paged_kv.pool.block_pool import BlockPool
from paged_kv.cache import packing, persist
from paged_kv.cache.cache_view import CacheView
from paged_kv.telemetry import metrics
from radix.cache import (EvictableReport, Eviction, GcMark, InsertOutcome, MatchResult,
                         PackCandidate, PrefixCache, RefDeltas)
from radix.tree import NodeId

__all__ = ["CacheView", "CachedPool", "PoolStateLost", "state_lost"]

_NO_IDS = np.zeros((0,), np.int32)
# `open_many` of at most this many rows opens them one at a time.
_SMALL_OPENS = 16


class PoolStateLost(PagedKVError):
  """The pool's state buffers were donated to a jitted call whose result never came
  back: every K/V page and reference count is gone; the pool cannot be used.
  """


def state_lost(pool: BlockPool) -> bool:
  """True when an array of `pool.unflushed_state` was deleted (donated, never returned)."""
  for leaf in jax.tree.leaves(pool.unflushed_state):
    is_deleted = getattr(leaf, "is_deleted", None)
    if is_deleted is not None and is_deleted():
      return True
  return False


def table_ref_counts(pool: BlockPool) -> np.ndarray:
  """`i64[num_blocks]`: the references the live tables hold, per block (the mirror's)."""
  return pool.host.table_refs.astype(np.int64)


class CachedPool:
  """A `BlockPool` and its `PrefixCache`, whose reference deltas it applies itself.

  Args:
    pool: the block pool; move its blocks only through this object from now on.
    cache: a cache whose references the pool already counts (checked); default a
      new one from `policy`, `pack_tails` and `clock` (see `radix.PrefixCache`).
    continue_tails: `open` copies a continuable cached tail, so the sequence appends
      in place and `insert` moves the tree's reference onto the copy (no dead slots).
    mix_namespaces: let `pack` and `restore` put different namespaces' tails in one
      block: fewer blocks, but a masking bug in a kernel would then leak K/V across
      tenants. Off, tenants never share a physical block.

  Raises:
    InvalidArgument: the block sizes differ.
    InvariantViolation: `cache` holds references the pool does not count.
  """

  def __init__(self, pool: BlockPool, cache: PrefixCache | None = None, *,
               policy: str = "lru", pack_tails: bool = False,
               clock: Callable[[], float] = time.monotonic, continue_tails: bool = True,
               mix_namespaces: bool = False):
    if cache is None:
      cache = PrefixCache(block_size=pool.config.block_size, policy=policy,
                          pack_tails=pack_tails, clock=clock)
    elif cache.block_size != pool.config.block_size:
      raise InvalidArgument(f"cache block_size {cache.block_size} != pool block_size "
                            f"{pool.config.block_size}")
    elif len(cache.tree):
      pool.check_invariants(extra_segments=cache.segment_refs())
    self._pool = pool
    self._cache = cache
    pool.bind_outside_references(cache.segment_refs)  # pool.check_invariants() counts them
    self._view = CacheView(cache)
    self.continue_tails = bool(continue_tails)
    if not isinstance(mix_namespaces, bool):
      raise InvalidArgument(f"mix_namespaces must be a bool, got {mix_namespaces!r}")
    self.mix_namespaces = mix_namespaces
    self._continuable: set[tuple[int, int, int]] = set()  # tails `match` found continuable
    self._countable_key: tuple[int, int] | None = None
    self._countable_mask = np.zeros((0,), bool)

  # ------------------------------------------------------------------ access
  @property
  def pool(self) -> BlockPool:
    """The `BlockPool`, for sequence-side work (reserve, write, gather, fork)."""
    return self._pool

  @property
  def cache(self) -> CacheView:
    """A read-only view of the prefix cache."""
    return self._view

  @property
  def config(self):
    return self._pool.config

  def _ref_count(self) -> np.ndarray:
    """The whole `ref_count` (the pool's mirror: no device read)."""
    return self._pool.host.ref_count

  def _dynamic(self) -> np.ndarray:
    """`bool[num_blocks]`: the dynamic region (no device read), rebuilt only when the
    config changes (regions are fixed by block id).
    """
    c = self._pool.config
    key = (c.num_blocks, c.num_base_blocks)
    if key != self._countable_key:
      self._countable_mask = np.arange(c.num_blocks) >= c.num_base_blocks
      self._countable_key = key
    return self._countable_mask

  def _apply(self, deltas: RefDeltas) -> None:
    if len(deltas):
      self._pool.apply_ref_deltas(deltas.block_ids, deltas.deltas)

  # ------------------------------------------------------------------ match / open
  def match(self, namespace: Hashable, tokens: Any, *, lock: bool = True,
            record: bool = True) -> MatchResult:
    """Longest cached prefix of `tokens` (see `PrefixCache.match`). With `lock`, a match
    ending inside a node splits it, so only the matched head is locked.
    """
    m = self._cache.match(namespace, tokens, lock=lock, record=record, split=lock)
    self._apply(m.ref_deltas)
    if m.continuable and self.continue_tails:
      if len(self._continuable) > 4 * self._pool.config.max_seqs:
        self._continuable.clear()  # stale entries only cost a skipped copy
      self._continuable.add(tuple(int(x) for x in m.segments[-1]))
    return m

  def unlock(self, node: NodeId) -> None:
    """Releases a lock taken by `match`."""
    self._cache.unlock(node)

  def open(self, segments: Segments | None = None, *, seq_id: int | None = None) -> int:
    """Opens a row on `segments` (a match's, or their prefix), a continuable tail copied
    into a fresh block when one is free; errors as `BlockPool.open_sequence`."""
    return int(self.open_many([segments], None if seq_id is None else [seq_id])[0])

  def open_many(self, segments: Sequence[Segments | None], seq_ids=None) -> np.ndarray:
    """Several `open`s: the rows open atomically, then their continuable tails are copied
    in one `cow_split`, in row order while free blocks last. Returns `i64[B]` the rows.
    """
    if len(segments) == 1 and seq_ids is None:  # one row: the open and the copy in one call
      segs = segments[0]
      tail = None
      if self._continuable and segs is not None and len(segs):
        tail = tuple(np.asarray(segs)[-1].tolist())
        if tail not in self._continuable:
          tail = None
      row = self._pool.open_sequence(segs, copy_tail=tail is not None)
      self._continuable.discard(tail)
      return np.array([row], np.int64)
    if seq_ids is None and len(segments) <= _SMALL_OPENS:
      # A few rows (a step's admissions): each opens alone, its tail copied when
      # continuable (the first row on a given tail).
      tails = []
      for segs in segments:
        tail = None
        if self._continuable and segs is not None and len(segs):
          tail = tuple(np.asarray(segs)[-1].tolist())
          if tail not in self._continuable or tail in tails:
            tail = None
        tails.append(tail)
      rows = self._pool._open_few(segments, [t is not None for t in tails])  # pylint: disable=protected-access
      if rows is not None:
        for tail in tails:
          self._continuable.discard(tail)
        return rows
    rows = self._pool.open_sequences(segments, seq_ids)
    if self._continuable:
      copy = []
      for row, segs in zip(rows, segments):
        if segs is not None and len(segs):
          tail = tuple(int(x) for x in np.asarray(segs)[-1])
          if tail in self._continuable:
            self._continuable.discard(tail)
            copy.append(int(row))
      if copy:
        # No block for a copy: that row continues in a fresh block later.
        self._pool.cow_split(copy, skip_exhausted=True)
    return rows

  def continues_tail(self, segments: Segments | None) -> bool:
    """Whether `open(segments)` would copy the last segment (taking a free block)."""
    if not self._continuable or segments is None or not len(segments):
      return False
    return tuple(int(x) for x in np.asarray(segments)[-1]) in self._continuable

  def release(self, seq_ids: Sequence[int]) -> None:
    """Ends live sequences (their table references go; the tree's stay)."""
    self._pool.release(seq_ids)

  # ------------------------------------------------------------------ insert / evict
  def insert(self, namespace: Hashable, tokens: Any, seq_id: int, *,
             pin_ttl: float | None = None, release: bool = False) -> InsertOutcome:
    """Stores the first `len(tokens)` tokens of live row `seq_id`; the tree's references
    are applied here. `release`: end the row in the same device call. Raises
    `InvalidSequence`, `InvalidArgument` (too many tokens), `InvalidTokensError`,
    `ValueError`; nothing changes on error.
    """
    entries = [(namespace, tokens, seq_id)]
    if release:
      return self._insert(entries, pin_ttl, release=np.array([seq_id], np.int64))[0]
    return self.insert_many(entries, pin_ttl=pin_ttl)[0]

  def insert_many(self, entries: Sequence[tuple[Hashable, Any, int]], *,
                  pin_ttl: float | None = None) -> list[InsertOutcome]:
    """`insert` of each `(namespace, tokens, seq_id)` in order, one reference update; a
    refused entry raises after applying the earlier entries' references.
    """
    return self._insert(entries, pin_ttl, release=None)

  def insert_and_release(self, entries: Sequence[tuple[Hashable, Any, int]],
                         seq_ids: Sequence[int]) -> list[InsertOutcome]:
    """`insert_many(entries)` and `release(seq_ids)` in one device call; if the tree
    refuses an entry, nothing is released.
    """
    ids = np.asarray(seq_ids, np.int64).reshape(-1)
    self._pool._check_ids(ids, active=True)  # pylint: disable=protected-access
    return self._insert(entries, None, release=ids)

  def _insert(self, entries, pin_ttl, release) -> list[InsertOutcome]:
    entries = list(entries)
    segs = self._pool.segments_many([e[2] for e in entries]) if entries else []
    counts, helds = [], []
    for (_, tokens, seq_id), sg in zip(entries, segs):
      held = sum(sg[:, 2].tolist()) if len(sg) <= 64 else int(sg[:, 2].sum(dtype=np.int64))
      count = (tokens.shape[0] if type(tokens) is np.ndarray and tokens.ndim == 1
               else int(np.asarray(tokens).reshape(-1).shape[0]))
      if count > held:
        raise InvalidArgument(f"insert: {count} tokens given; sequence {seq_id} holds {held}")
      counts.append(count)
      helds.append(held)
    outcomes: list[InsertOutcome] = []
    inserted = False
    try:
      for (namespace, tokens, _), sg, count, held in zip(entries, segs, counts, helds):
        # The whole sequence (the usual case): its segments as read (a fresh copy).
        head = sg if count == held else take_tokens(sg, count)
        outcomes.append(self._cache.insert(namespace, tokens, head, pin_ttl=pin_ttl))
      inserted = True
    finally:  # the tree holds what was inserted: the pool takes those references
      if len(outcomes) == 1:
        ids, deltas = outcomes[0].ref_deltas.block_ids, outcomes[0].ref_deltas.deltas
      else:
        ids = np.concatenate([o.ref_deltas.block_ids for o in outcomes] + [_NO_IDS])
        deltas = np.concatenate([o.ref_deltas.deltas for o in outcomes] + [_NO_IDS])
      if inserted and release is not None:
        self._pool.release(release, ref_deltas=(ids, deltas) if ids.size else None)
      elif ids.size:
        self._pool.apply_ref_deltas(ids, deltas)
    return outcomes

  def split(self, node: NodeId, offset: int) -> NodeId:
    """Splits a node after `offset` tokens (no KV copy); returns the head node."""
    head, deltas = self._cache.split(node, offset)
    self._apply(deltas)
    return head

  def pin(self, namespace: Hashable, tokens: Any, ttl: float) -> int:
    """Pins the cached prefix of `tokens` for `ttl`; returns the tokens pinned."""
    return self._cache.pin(namespace, tokens, ttl)

  def unpin(self, namespace: Hashable, tokens: Any) -> None:
    self._cache.unpin(namespace, tokens)

  def evict(self, *, num_blocks: int | None = None, num_tokens: int | None = None,
            policy: str | None = None) -> Eviction:
    """Evicts unlocked, unpinned leaves until `num_blocks` dynamic blocks free (or
    `num_tokens` go); counts from the host mirror, decrefs applied.
    """
    ev = self._cache.evict(num_blocks=num_blocks, num_tokens=num_tokens, policy=policy,
                           ref_count=self._ref_count(), countable=self._dynamic())
    self._apply(ev.ref_deltas)
    return ev

  def ensure_free(self, num_blocks: int) -> bool:
    """Evicts cached blocks until `num_blocks` are free; True when they are."""
    short = num_blocks - self._pool.num_free_blocks
    if short > 0:
      self.evict(num_blocks=short)
    return self._pool.num_free_blocks >= num_blocks

  def gc_mark(self, ttl: float) -> GcMark:
    """GC phase 1 (see `PrefixCache.gc_mark`); moves no reference."""
    return self._cache.gc_mark(ttl)

  def gc_evict(self, *, num_blocks: int | None = None, num_tokens: int | None = None,
               order: str = "high_first") -> Eviction:
    """GC phase 2 (see `PrefixCache.gc_evict`), decrefs applied."""
    ev = self._cache.gc_evict(num_blocks=num_blocks, num_tokens=num_tokens, order=order,
                              ref_count=self._ref_count(), countable=self._dynamic())
    self._apply(ev.ref_deltas)
    return ev

  def evictable(self) -> EvictableReport:
    """What eviction could reclaim now, in tokens, bytes and blocks."""
    c = self._pool.config
    return self._cache.evictable(bytes_per_token=c.block_bytes // c.block_size,
                                 ref_count=self._ref_count())

  # ------------------------------------------------------------------ block moves
  def move_blocks(self, src, dst, *, impl: str = "xla") -> np.ndarray:
    """Applies a compaction plan to the pool and the tree; returns `remap i32[num_blocks]`."""
    remap = self._pool.move_blocks(src, dst, impl=impl)
    self._cache.apply_remap(remap)
    return remap

  def compact(self, *, budget: int = 32, policy: compact.CompactionPolicy | None = None,
              impl: str = "xla") -> np.ndarray:
    """One compaction step (`BlockPool.compact`'s plan of `budget` moves, or `policy`'s);
    tables and tree remapped; returns `remap i32[num_blocks]`.
    """
    if policy is None:
      remap = self._pool.compact(budget=budget, impl=impl)
      self._cache.apply_remap(remap)
      return remap
    src, dst = self._pool.plan(policy)
    return self.move_blocks(src, dst, impl=impl)

  def promote(self, min_readers: int, max_moves: int = 8) -> np.ndarray:
    """Moves blocks with >= `min_readers` references into the base pool; returns remap."""
    remap = self._pool.promote(min_readers, max_moves=max_moves)
    self._cache.apply_remap(remap)
    return remap

  def resize(self, num_blocks: int, *, staging: str = "auto") -> ResizeReport:
    """`BlockPool.resize`: ids are kept (no tree remap); a cut is refused while a block
    above it is referenced."""
    return self._pool.resize(num_blocks, staging=staging)

  # ------------------------------------------------------------------ packing
  def pack(self, candidates: Iterable[PackCandidate]) -> int:
    """Packs an `InsertOutcome.pack`'s live short segments into slotted blocks; returns
    how many moved (`PoolExhausted`, `InvariantViolation`).
    """
    return packing.pack(self._pool, self._cache, candidates, dynamic=self._dynamic(),
                        mix_namespaces=self.mix_namespaces)

  def reclaim_slots(self) -> int:
    """Frees slots no live segment (tables or tree) covers; returns how many."""
    return self._pool.reclaim_slots(self._cache.segment_refs())

  # ------------------------------------------------------------------ recovery
  def reset_locks(self, held: Iterable[NodeId]) -> None:
    """Rebuilds the lock counts from `held`, one entry per outstanding locked match."""
    self._cache.reset_locks(held)

  def recover(self) -> bool:
    """Restores the invariants after an interrupted call; True when the cache was dropped.

    When the pool's counts differ from the tables' plus the tree's, the tree goes and
    each count is set to the tables' references. Raises `PoolStateLost`, or
    `InvariantViolation` when the tables themselves are inconsistent.
    """
    if state_lost(self._pool):
      raise PoolStateLost("the pool's state buffers were deleted (donated to a jitted call "
                          "whose result never came back); its K/V and bookkeeping are gone")
    try:
      self._pool.verify()  # the mirror against the device (reloaded if they differ)
    except InternalInconsistency:
      pass
    try:
      self.check_invariants()
      return False
    except InvariantViolation:
      pass
    self._cache.clear()
    diff = table_ref_counts(self._pool) - self._ref_count().astype(np.int64)
    ids = np.flatnonzero(diff)
    if ids.size:
      self._pool.apply_ref_deltas(ids, diff[ids])
    self.check_invariants()
    return True

  # ------------------------------------------------------------------ checks, metrics
  def segment_refs(self) -> Segments:
    """`i32[n, 3]`: every segment the tree holds (one pool reference each)."""
    return self._cache.segment_refs()

  def check_invariants(self, *, extra_segments: Segments | None = None) -> None:
    """The pool's invariants, counting the cache's references and `extra_segments`
    (`i32[n, 3]`, other outside holders). Raises `InvariantViolation`.
    """
    refs = self._cache.segment_refs()
    if extra_segments is not None:
      refs = np.concatenate([refs, as_segments(extra_segments, name="extra_segments")])
    self._pool.check_invariants(extra_segments=refs)

  def snapshot(self, *, counters=None, assert_no_ghosts: bool = True) -> metrics.PoolSnapshot:
    """A metrics snapshot with the cache's segments counted as live slots (`counters`:
    `metrics.snapshot`'s)."""
    return metrics.snapshot(self._pool.host, self._pool.config,
                            extra_segments=self._cache.segment_refs(), counters=counters,
                            assert_no_ghosts=assert_no_ghosts)

  # ------------------------------------------------------------------ persistence
  def save(self, path: str | os.PathLike) -> None:
    """Writes the cache and its K/V to `path` (see `paged_kv.cache.persist`)."""
    persist.save_prefix_cache(path, self._pool, self._cache)

  def restore(self, path: str | os.PathLike) -> None:
    """Loads a saved cache into this empty one (`load_prefix_cache`'s errors; nothing
    changes on error).
    """
    persist.load_prefix_cache(path, self._pool, self._cache,
                              mix_namespaces=self.mix_namespaces)
