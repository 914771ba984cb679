"""Between-step maintenance of a scheduler's pool: compaction and promotion.

Compaction runs when the fragmentation ratio crosses `CompactionPolicy`'s threshold,
within its byte budget of block moves; it pauses while a shrink is pending (whose
moves compact downwards). Promotion moves blocks read by at least `promote_readers`
references into the base pool every `promote_every` steps.
"""

from __future__ import annotations

import time

import numpy as np

from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.step_report import SchedulerStats
from paged_kv.telemetry import metrics


def maybe_compact(cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
                  last_stats: metrics.StepStats | None, *, shrinking: bool) -> int:
  """Compacts within the policy's budget when its threshold is crossed; returns moves."""
  policy = config.compaction
  if policy is None or shrinking:  # a shrink's moves compact downwards
    return 0
  pool = cached_pool.pool
  # The latest cheap figures (no extra device reduction); without them, the ratio now.
  ratio = (last_stats.fragmentation_ratio if last_stats is not None
           else metrics.step_stats_host(pool.host, pool.config).fragmentation_ratio)
  if not policy.should_compact(ratio):
    return 0
  t0 = time.perf_counter()
  # The policy's byte budget (a share of a step's time at the copy bandwidth), in
  # moves of this pool's blocks.
  src, dst = pool.plan(policy)
  num_moves = int(np.sum(src >= 0))
  if num_moves == 0:
    return 0
  cached_pool.move_blocks(src, dst)  # tables and the cache follow the remap
  stats.record_compaction(num_moves, time.perf_counter() - t0)
  return num_moves


def maybe_promote(cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
                  step: int) -> int:
  """Moves widely shared blocks (system prompts) into the base pool; returns moves."""
  if (not config.promote_readers or not cached_pool.pool.config.num_base_blocks
      or step % config.promote_every):
    return 0
  remap = cached_pool.promote(config.promote_readers)  # the cache follows the remap
  moved = int(np.sum(remap != np.arange(remap.shape[0])))
  if moved:
    stats.promotions += moved
  return moved
