"""`CachedPool`: a `BlockPool` and a `radix.PrefixCache` kept in sync by one object.

The radix cache is host bookkeeping that never touches the pool: every call that
changes the tree's references returns a `RefDeltas` for the pool. `CachedPool`
owns both and applies each delta itself, so no caller can forget one:

    cp = CachedPool(pool)                             # or CachedPool(pool, cache)
    m = cp.match("tenant", prompt[:-1])               # longest cached prefix, locked
    seq = cp.open(m.segments)                         # the sequence shares it (increfs)
    ...                                               # cp.pool.reserve_tokens / write_kv
    cp.insert("tenant", tokens, seq)                  # the tree takes its references
    cp.release([seq]); cp.unlock(m.node)
    cp.evict(num_blocks=8)                            # decrefs applied, blocks freed
    cp.check_invariants()                             # counts the cache's references

Who moves which reference:

* the **sequence side** (`open`, `release`, and the pool's own `fork`,
  `reserve_tokens`, `cow_split`) is the pool's: one reference per table segment;
* the **tree side** (`insert`, `split`, `evict`, `gc_evict`) comes back from the
  cache as `RefDeltas`, applied here with `BlockPool.apply_ref_deltas`;
* **moves** (`compact`, `move_blocks`, `promote`) change block ids: the pool
  remaps its tables and this object remaps the tree (`apply_remap`);
* **packing** (`pack`) moves the tree's references inside the pool
  (`pack_slots` with an outside owner); the cache only rewrites its records, and
  its rebind deltas are checked against the pool's, not applied again;
* **persistence** (`save`, `restore`) writes the tree and its K/V, and restores
  them into fresh blocks with the tree's references applied.

Interruptions: each call applies the pool side and the cache side one after the
other. When an exception (a `KeyboardInterrupt` included) lands between the two,
`recover()` restores the invariants: if the pool and the tree disagree, the tree
is dropped (`PrefixCache.clear`) and the pool's reference counts are rebuilt from
the live tables, so nothing leaks and no block is freed under a reader (the cache
is only a cache). A pool whose donated state was lost (`state_lost`) cannot be
recovered: `recover()` raises `PoolStateLost`.

`cp.pool` is the `BlockPool` for the sequence-side work a model step does
(`reserve_tokens`, `write_kv`, `gather_kv`, `fork`, `cow_split`, the executor's
`state`); block moves and cache changes go through this object. `cp.cache` is a
read-only `CacheView` (statistics, probes, enumeration).

Segments are `Segments`, `int32[n, 3]` rows `(block, start, length)`, everywhere.
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
  """The pool's state points at deleted buffers: a jitted call took it (donation)
  and the new state never came back (e.g. an executor raised after donating).
  Every K/V page and every reference count is gone; the pool cannot be used."""


def state_lost(pool: BlockPool) -> bool:
  """True when some array of `pool.state` was deleted (donated and not returned).

  Looks at the buffers only: applies no queued change (`BlockPool.unflushed_state`).
  """
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
    pool: the block pool (owned from now on: move blocks only through this object).
    cache: an existing cache with the pool's block size; its references must
      already be in the pool (an empty cache, or one `load_prefix_cache` filled
      for this pool): checked with the invariant checker. Default: a new cache
      built from `policy`, `pack_tails` and `clock`.
    policy, pack_tails, clock: of the new cache (see `radix.PrefixCache`); ignored
      when `cache` is given.
    continue_tails: when a match ends at the end of a cached partial block
      (`MatchResult.continuable`), `open` copies that tail into a fresh block
      (`BlockPool.cow_split`), so the sequence appends after it in place and
      `insert` moves the tree's reference onto the copy: the old block's unused
      slots are not kept alive (no dead slots per turn). False: the sequence
      continues in a fresh block and the shared block keeps its unused slots.
    mix_namespaces: let `pack` (and `restore`'s layout) put different namespaces'
      tails in one block. Off (the default), a block a tail is packed into holds
      one namespace's tokens only, as every other block does: tenants never share
      a physical block. On, packing saves more blocks, at a risk: no slot is ever
      shared and freed slots are zeroed before reuse when scrubbing, but a masking
      bug in any attention kernel would then read another tenant's K/V.

  Raises:
    InvalidArgument: the cache's block size differs from the pool's.
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
    """`bool[num_blocks]`: the dynamic region, host side (no device read).

    Regions are fixed by block id (`[0, num_base_blocks)` is the base pool; moves
    and resizes keep it), so the mask is rebuilt only when the config changes.
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
    """Longest cached prefix of `tokens` (see `PrefixCache.match`).

    To keep a token to compute (for the logits), match `tokens[:-1]`. The result's
    `segments` (`i32[n, 3]`) go to `open`; a locked `node` to `unlock` once the
    sequence is done with it. With `lock`, a match ending inside a node splits
    that node at the match point first (its cut's incref is applied here) and
    locks only the matched head: the unmatched tail stays evictable, so a short
    match into a long node never pins blocks the sequence does not use.
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
    """Opens a sequence on a cached prefix; returns its row.

    Args:
      segments: `i32[n, 3]` `(block, start, length)` rows, a `match`'s
        `segments` or a leading part of them (each gains the sequence's
        reference); None or empty: an empty sequence.
      seq_id: the row; default the lowest free one.

    With `continue_tails`, when the last segment is a tail `match` reported
    continuable, it is copied into a fresh block (`BlockPool.cow_split`) so the
    sequence's next tokens go in place after it; with no free block for the copy
    the sequence simply continues in a fresh block later.

    Raises:
      InvalidSegmentLayout, InvalidBlock, InvalidSegment, PoolExhausted,
      InvalidSequence: as `BlockPool.open_sequence`; nothing changes.
    """
    return int(self.open_many([segments], None if seq_id is None else [seq_id])[0])

  def open_many(self, segments: Sequence[Segments | None], seq_ids=None) -> np.ndarray:
    """Several `open`s at once: one device call opens every row, one copies the tails.

    The rows open atomically (`BlockPool.open_sequences`: default the lowest free
    rows, in order); then the continuable tails among them are copied in one
    `cow_split` that serves the rows in order while free blocks last, exactly
    as one `open` after the other would. Returns `i64[B]` the rows.

    Raises:
      As `open`, for the first row that fails; nothing changes.
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
    """Whether `open(segments)` would copy the last segment (a continuable tail).

    The copy takes one free block when one is free (see `open`).
    """
    if not self._continuable or segments is None or not len(segments):
      return False
    return tuple(int(x) for x in np.asarray(segments)[-1]) in self._continuable

  def release(self, seq_ids: Sequence[int]) -> None:
    """Ends live sequences (their table references go; the tree's stay)."""
    self._pool.release(seq_ids)

  # ------------------------------------------------------------------ insert / evict
  def insert(self, namespace: Hashable, tokens: Any, seq_id: int, *,
             pin_ttl: float | None = None, release: bool = False) -> InsertOutcome:
    """Stores the first `len(tokens)` tokens of live sequence `seq_id` in the cache.

    The segments are read from the pool (`BlockPool.segments`), cut after
    `len(tokens)` tokens; the tree takes one reference per new segment (and per
    segment a node split cuts), applied to the pool here. The sequence stays
    live: `release` it afterwards (or keep decoding). With `pack_tails`, pass the
    outcome's `pack` to `pack` after the release.

    Args:
      namespace: cache namespace.
      tokens: the sequence's token ids (its first `len(tokens)` cached tokens).
      seq_id: a live sequence holding at least `len(tokens)` tokens.
      pin_ttl: pin the inserted path for this long.
      release: then end the sequence, in the same device call as the tree's
        references (`insert_and_release` of one row).

    Returns:
      The cache's `InsertOutcome`; its `ref_deltas` are already applied.

    Raises:
      InvalidSequence: `seq_id` not live. InvalidArgument: more tokens than the
      sequence holds. InvalidTokensError / ValueError: bad tokens or TTL. Nothing
      changes on error.
    """
    entries = [(namespace, tokens, seq_id)]
    if release:
      return self._insert(entries, pin_ttl, release=np.array([seq_id], np.int64))[0]
    return self.insert_many(entries, pin_ttl=pin_ttl)[0]

  def insert_many(self, entries: Sequence[tuple[Hashable, Any, int]], *,
                  pin_ttl: float | None = None) -> list[InsertOutcome]:
    """Several `insert`s: one read of the rows' segments, one reference update.

    Args:
      entries: `(namespace, tokens, seq_id)` per sequence, distinct live rows,
        inserted in order (a later entry shares what an earlier one stored).
      pin_ttl: pin every inserted path for this long.

    Returns:
      One `InsertOutcome` per entry; their `ref_deltas` are already applied, all
      in one `BlockPool.apply_ref_deltas` after the tree took them.

    Raises:
      As `insert`. Every row and token count is checked before the tree changes;
      if the tree refuses an entry (bad tokens, TTL), the references of the
      entries before it are applied and the error is raised.
    """
    return self._insert(entries, pin_ttl, release=None)

  def insert_and_release(self, entries: Sequence[tuple[Hashable, Any, int]],
                         seq_ids: Sequence[int]) -> list[InsertOutcome]:
    """`insert_many(entries)`, then `release(seq_ids)`: the tree's references and
    the rows' end in one device call (`BlockPool.release(ref_deltas=...)`).

    What a scheduler does with the sequences finishing in a step. With
    `pack_tails`, pass the outcomes' `pack` to `pack` afterwards.

    Raises:
      As `insert_many` and `release`; every row is checked before the tree
      changes. If the tree refuses an entry, the references of the entries
      before it are applied, nothing is released and the error is raised.
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
    """Evicts unlocked, unpinned leaves until `num_blocks` blocks free (or `num_tokens` go).

    The pool's `ref_count` comes from its host mirror (the whole array, indexed
    by the cache: no device read, no per-call lookup); the decrefs are applied,
    so the blocks whose last reference was the tree's are free when this
    returns. Leaves go tail first at block granularity (see
    `radix.PrefixCache`'s `granularity`).

    Only dynamic-region blocks count toward `num_blocks`: a freed base-region
    (promoted) block never becomes a free block for new sequences.

    Returns:
      The cache's `Eviction` (its `ref_deltas` already applied); it may fall short
      when nothing else is evictable.
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
    """One compaction step, tables and tree remapped; returns `remap i32[num_blocks]`.

    Args:
      budget: moves of the default `"top_down"` plan (`BlockPool.compact`).
      policy: plan with this policy's strategy and budget instead.
      impl: page copy implementation.
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
    """Shrinks or grows the pool (block ids are kept; see `BlockPool.resize`, which
    also says what `staging` picks); returns the pool's `ResizeReport`.

    Block ids do not change, so the tree needs no remap: a cut is refused
    (`InvalidBlock`, nothing changed) while any block above it is referenced,
    by a table or by the cache (`ref_count` counts both). Empty the tail first
    with `move_blocks` of a `regions.plan_shrink` plan (`Scheduler.shrink_to`
    does it while serving).
    """
    return self._pool.resize(num_blocks, staging=staging)

  # ------------------------------------------------------------------ packing
  def pack(self, candidates: Iterable[PackCandidate]) -> int:
    """Packs the cache's short segments into slotted blocks; returns how many moved.

    Candidates (an `InsertOutcome.pack`) whose node or segment is gone since
    (evicted, split) or whose block is in the base region are skipped. The pool
    moves the tree's references (`pack_slots` with an outside owner); the cache
    rewrites its records, and its rebind deltas must equal the pool's.

    Raises:
      PoolExhausted: nowhere to pack now; nothing changed.
      InvariantViolation: the cache's and the pool's reference moves disagree.
    """
    return packing.pack(self._pool, self._cache, candidates, dynamic=self._dynamic(),
                        mix_namespaces=self.mix_namespaces)

  def reclaim_slots(self) -> int:
    """Frees slots no live segment (tables or tree) covers; returns how many."""
    return self._pool.reclaim_slots(self._cache.segment_refs())

  # ------------------------------------------------------------------ recovery
  def reset_locks(self, held: Iterable[NodeId]) -> None:
    """Rebuilds the cache's lock counts from the locks still held (one entry per
    outstanding `match(lock=True)`); every other lock is dropped."""
    self._cache.reset_locks(held)

  def recover(self) -> bool:
    """Restores the invariants after an interrupted call; True when the cache was dropped.

    When the pool's counts equal the tables' plus the tree's references (and
    the other invariants hold) nothing changes. Otherwise the interruption fell
    between the pool side and the cache side of a call: the tree is dropped
    (every lock and node handle goes stale) and each block's count is set to the
    tables' references, freeing what only the tree held.

    Raises:
      PoolStateLost: the pool's state was donated and not returned.
      InvariantViolation: the tables themselves are inconsistent (not repairable).
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
    """The pool's invariants, counting the cache's references.

    Args:
      extra_segments: `i32[n, 3]` references held by other outside holders, on
        top of the cache's.

    Raises:
      InvariantViolation: a violation. InvalidSegmentLayout: bad `extra_segments`.
    """
    refs = self._cache.segment_refs()
    if extra_segments is not None:
      refs = np.concatenate([refs, as_segments(extra_segments, name="extra_segments")])
    self._pool.check_invariants(extra_segments=refs)

  def snapshot(self, *, counters: metrics.PoolCounters | None = None,
               assert_no_ghosts: bool = True) -> metrics.PoolSnapshot:
    """A metrics snapshot with the cache's segments counted as live slots."""
    return metrics.snapshot(self._pool.host, self._pool.config,
                            extra_segments=self._cache.segment_refs(), counters=counters,
                            assert_no_ghosts=assert_no_ghosts)

  # ------------------------------------------------------------------ persistence
  def save(self, path: str | os.PathLike) -> None:
    """Writes the cache and its K/V to `path` (see `paged_kv.cache.persist`)."""
    persist.save_prefix_cache(path, self._pool, self._cache)

  def restore(self, path: str | os.PathLike) -> None:
    """Loads a saved cache into this (empty) cache, its references applied to the pool.

    Raises:
      InvalidArgument: the cache is not empty. The errors of
      `persist.load_prefix_cache`; on every error the pool and cache are unchanged.
    """
    persist.load_prefix_cache(path, self._pool, self._cache,
                              mix_namespaces=self.mix_namespaces)
