"""`Evictor`: frees cached-only blocks of the prefix cache when the scheduler needs
room: GC-marked idle nodes first (with `CacheGovernance.gc_ttl`), then the cache's
policy. The `CachedPool` applies every decref; the evictor decides and counts."""

from __future__ import annotations

from paged_kv.cache.cached_pool import CachedPool
from paged_kv.cache.governance import CacheGovernance
from paged_kv.scheduler.step_report import SchedulerStats


class Evictor:
  """Evicts cached-only blocks on demand and counts them in `stats`."""

  def __init__(self, cached_pool: CachedPool, stats: SchedulerStats,
               governance: CacheGovernance | None):
    self.cached_pool = cached_pool
    self.stats = stats
    self.gc = governance is not None and governance.gc_ttl is not None

  def evict(self, num_blocks: int) -> int:
    """Evicts up to `num_blocks` cached-only blocks; returns the blocks freed."""
    if num_blocks <= 0:
      return 0
    pool = self.cached_pool.pool
    before = pool.num_free_blocks
    if self.gc:
      # GC phase 2 first: marked (idle) nodes, highest block address first.
      ev = self.cached_pool.gc_evict(num_blocks=num_blocks)
      if ev.num_segments:
        self.stats.evictions += 1
        self.stats.evicted_tokens += ev.num_tokens
        self.stats.gc_evicted_tokens += ev.num_tokens
      num_blocks -= pool.num_free_blocks - before
    if num_blocks > 0:
      ev = self.cached_pool.evict(num_blocks=num_blocks)
      if ev.num_segments:
        self.stats.evictions += 1
        self.stats.evicted_tokens += ev.num_tokens
    return pool.num_free_blocks - before

  def ensure_free(self, need: int) -> bool:
    """Evicts what is short of `need` free blocks; True when the pool has them."""
    pool = self.cached_pool.pool
    short = need - pool.num_free_blocks
    if short > 0:
      self.evict(short)
    return pool.num_free_blocks >= need
