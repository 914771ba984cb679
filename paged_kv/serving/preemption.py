"""`Preemption`: room for a step under memory pressure.

Cached-only blocks are evicted first; then the most recently admitted sequence is
preempted, until the step's blocks are free or one sequence is left. A victim goes
by recompute (its computed tokens go into the cache, it re-queues at the head of
`waiting` and re-matches them) or by swap (`SchedulerConfig.preemption="swap"`,
once it has an output: its K/V is copied to host memory and restored bit-exactly
when it is admitted again).
"""

from __future__ import annotations

from paged_kv.serving.cached_pool import CachedPool
from paged_kv.serving.eviction import Evictor
from paged_kv.serving.finishing import Finishing
from paged_kv.serving.request import Phase, Request, RequestQueues, drop_in_flight
from paged_kv.serving.scheduler_config import SchedulerConfig
from paged_kv.serving.step_report import SchedulerStats
from paged_kv.serving.swap import swap_out


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

  def preempt(self, req: Request) -> None:
    """Takes a running request off its row, by swap or by recompute."""
    # The request leaves `running` only once its row is handled (swap_out or
    # insert + release succeeded): an exception before leaves it running.
    q = self.queues
    if self.config.preemption == "swap" and req.output:
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
