"""`Preemption`: room for a step under memory pressure.

Cached-only blocks are evicted first; then the most recently admitted sequences are
preempted until the step's blocks are free or one sequence is left: by recompute
(its computed tokens go into the cache, it re-queues at the head of `waiting`) or by
swap (`preemption="swap"`, once it has output: its K/V to host memory).

The sequence left alone must still get its block, or every later step repeats the
failure (`unstick`): its cache lock is dropped and the cache evicted again; a shared
layout is recomputed in fresh blocks (`RequestQueues.unshared`, within
`Admission.alone_need`); else it ends with `stop_reason="pool_exhausted"`.
"""

from __future__ import annotations

from paged_kv.core.errors import PoolExhausted
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.finishing import Finishing
from paged_kv.scheduler.request import Phase, Request, RequestQueues, drop_in_flight
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.step_report import SchedulerStats
from paged_kv.scheduler.swap import swap_out


class Preemption:
  """Frees blocks by eviction, then by preempting the newest sequences."""

  def __init__(self, cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
               evictor: Evictor, finishing: Finishing, queues: RequestQueues):
    self.cached_pool = cached_pool
    self.config = config
    self.stats = stats
    self.evictor = evictor
    self.finishing = finishing
    self.queues = queues

  def relieve(self, blocks: int) -> None:
    """Evicts cached blocks, then preempts the most recently admitted sequences,
    until `blocks` blocks are free (at least one) or one sequence is left."""
    blocks = max(blocks, 1)
    if self.evictor.evict(blocks) >= blocks:
      return
    pool, running = self.cached_pool.pool, self.queues.running
    while pool.num_free_blocks < blocks and len(running) > 1:
      self.preempt(running[-1])
      # A recomputed victim's blocks went into the cache: evict them, unlocked now.
      self.evictor.evict(blocks - pool.num_free_blocks)
    if pool.num_free_blocks < blocks and running:
      self.unstick(running[0], blocks)

  def unstick(self, req: Request, blocks: int) -> None:
    """Room for `req`, running alone with `blocks` blocks still short after eviction,
    or it leaves its row (module docstring): else every later step would repeat it."""
    pool, stats = self.cached_pool.pool, self.stats
    if req.lock_node is not None:
      # Its row holds references to every block it reads: the lock only keeps the
      # cache's copy of the prefix (and the tails it copied away from) unevictable.
      node, req.lock_node = req.lock_node, None
      self.cached_pool.unlock(node)
      stats.unstick_unlocks += 1
      self.evictor.evict(blocks - pool.num_free_blocks)
      if pool.num_free_blocks >= blocks:
        return
    bs = pool.config.block_size
    held = int(pool.host.num_segments[req.seq_id])
    if held > -(-req.num_cached // bs):
      # More segments than full blocks would need: a shared layout. Recompute it in
      # fresh blocks (its tokens stay in the cache until admission evicts them).
      self.queues.unshared.add(id(req))
      self.preempt(req, recompute=True)
      stats.unstick_preemptions += 1
      return
    req.stop_reason = "pool_exhausted"
    stats.unstick_refusals += 1
    free, evictable = pool.num_free_blocks, self.cached_pool.evictable().num_blocks
    req.error = PoolExhausted(
        f"request {req.request_id!r} runs alone, {req.num_cached} tokens in {held} "
        f"segments, and needs {blocks} more block(s); {free} are free and {evictable} "
        f"evictable: the rest is held by pinned prefix-cache entries (`CachedPool.pin`), "
        f"base-region blocks or rows outside this scheduler", reason="no_free_block")

  def preempt(self, req: Request, *, recompute: bool = False) -> None:
    """Takes a running request off its row, by swap or by recompute (`recompute`:
    by recompute whatever the config says)."""
    # The request leaves `running` only once its row is handled (swap_out or
    # insert + release succeeded): an exception before leaves it running.
    q = self.queues
    if self.config.preemption == "swap" and req.output and not recompute:
      swapped = swap_out(self.cached_pool.pool, req.seq_id)
      q.running.remove(req)
      req.swapped = swapped
      self.stats.preemptions_swap += 1
      self.stats.swap_to_host_bytes += swapped.nbytes
      req.phase = Phase.SWAPPED
      q.swapped.append(req)
    else:
      self.finishing.store_and_release(req)
      q.running.remove(req)
      self.stats.preemptions_recompute += 1
      req.num_cached = 0
      req.phase = Phase.WAITING
      q.waiting.appendleft(req)
    drop_in_flight(req)  # (recompute resamples them: the same tokens)
    self.stats.preemptions += 1
    req.num_preemptions += 1
    node, req.lock_node, req.seq_id = req.lock_node, None, None
    if node is not None:
      self.cached_pool.unlock(node)
