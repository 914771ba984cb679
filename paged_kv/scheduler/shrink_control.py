"""`ShrinkControl`: gives memory back while serving (`Scheduler.shrink_to`).

Each step moves up to the policy's budget of referenced blocks from above the
target into free blocks below it (`host_ops.plan_shrink`), evicting cached-only
blocks when room is short; once nothing above is referenced, the pool is cut there
and the executor follows. Requests are never held back: allocation takes the lowest
free blocks, so nothing new lands above the target while a block below is free.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from paged_kv.core import compact, regions
from paged_kv.core import resize as resize_lib
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, PoolExhausted
from paged_kv.pool import host_transitions as host_ops
from paged_kv.runtime import counters
from paged_kv.scheduler.admission import Admission, cdiv
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.request import is_int
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord


class ShrinkControl:
  """The pending shrink of a scheduler's pool, a step at a time (module docstring)."""

  def __init__(self, cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
               evictor: Evictor, admission: Admission, record: StepRecord, *, caching: bool,
               rewarm: Callable[[int], None]):
    """`rewarm(compiles_before)` runs after a cut (the scheduler re-warms the new size
    when it was warmed up); `caching`: cached-only blocks may be evicted for room."""
    self.cached_pool = cached_pool
    self.config = config
    self.stats = stats
    self.evictor = evictor
    self.admission = admission
    self.record = record
    self.caching = caching
    self.rewarm = rewarm
    self.pending: regions.ShrinkProgress | None = None
    self.latest: regions.ShrinkProgress | None = None
    self._policy: compact.CompactionPolicy | None = None

  @property
  def pool(self):
    return self.cached_pool.pool

  def start(self, executor, num_blocks: int, policy: compact.CompactionPolicy | None, *,
            block_bytes: int | None, evict_cached: bool, margin: int | None, staging: str,
            on_room_failure: Callable[[BaseException], None]) -> regions.ShrinkProgress:
    """Checks `Scheduler.shrink_to`'s arguments, registers the shrink and makes room
    below the target now.

    Args:
      num_blocks: the size after the cut, above the base pool and below today's.
      policy: the byte budget of moves per step (default the scheduler's compaction
        policy, else `CompactionPolicy()`).
      block_bytes: bytes per block the budget counts (default the pool's).
      evict_cached: evict cached-only blocks when the room below is short.
      margin: free blocks kept below the target beyond the moves' (default
        `max_batch` + the prefill budget's blocks).
      staging: `BlockPool.resize`'s `"host"`, `"device"` or `"auto"`.

    Raises:
      InvalidArgument: a shrink pending, a bad argument, or an executor holding the
        pool config without `resize` (nothing changed).
      PoolExhausted: the target cannot hold the live blocks (every referenced one
        without `evict_cached`), or a submitted request needs more (nothing changed).
      Anything raised while making room, after the shrink was unregistered and
        `on_room_failure` (the scheduler's reconciliation) ran.
    """
    pc = self.pool.config
    if self.pending is not None:
      raise InvalidArgument(f"a shrink to {self.pending.target} blocks is pending; "
                            f"cancel_shrink() first")
    if not is_int(num_blocks) or not pc.num_base_blocks < num_blocks < pc.num_blocks:
      raise InvalidArgument(f"num_blocks must be an int in ({pc.num_base_blocks}, "
                            f"{pc.num_blocks}) (above the base pool, below the pool's "
                            f"size), got {num_blocks!r}")
    num_blocks = int(num_blocks)
    if policy is None:
      policy = self.config.compaction or compact.CompactionPolicy()
    elif not isinstance(policy, compact.CompactionPolicy):
      raise InvalidArgument(f"policy must be a CompactionPolicy or None, got "
                            f"{type(policy).__name__}")
    if block_bytes is None:
      block_bytes = pc.block_bytes
    elif not is_int(block_bytes) or block_bytes < 1:
      raise InvalidArgument(f"block_bytes must be a positive int, got {block_bytes!r}")
    if margin is None:
      margin = self.config.max_batch + cdiv(self.config.prefill_token_budget, pc.block_size)
    elif not is_int(margin) or margin < 0:
      raise InvalidArgument(f"margin must be an int >= 0, got {margin!r}")
    if not isinstance(evict_cached, (bool, np.bool_)):
      raise InvalidArgument(f"evict_cached must be a bool, got {evict_cached!r}")
    if not isinstance(staging, str) or staging not in resize_lib.STAGINGS:
      raise InvalidArgument(f"staging must be one of {resize_lib.STAGINGS}, got {staging!r}")
    if (not callable(getattr(executor, "resize", None))
        and isinstance(getattr(executor, "config", None), PoolConfig)):
      raise InvalidArgument(f"{type(executor).__name__} holds the pool config but has no "
                            f"resize(config): it could not follow the cut")
    dynamic = num_blocks - pc.num_base_blocks
    live, cached = self.pool.host.block_usage()
    if live > dynamic or (not evict_cached and live + cached > dynamic):
      held = live if live > dynamic else live + cached
      raise PoolExhausted(f"cannot shrink to {num_blocks} blocks: {dynamic} dynamic blocks "
                          f"would hold {held} referenced now", reason="no_free_block")
    need = self.admission.largest_need()
    if need > dynamic:
      raise PoolExhausted(f"cannot shrink to {num_blocks} blocks: a submitted request needs "
                          f"up to {need} of its {dynamic} dynamic blocks", reason="no_free_block")
    held_above, _ = self._progress(num_blocks)
    max_moves = max(1, min(policy.max_moves(int(block_bytes)), pc.num_blocks // 2))
    progress = regions.ShrinkProgress(
        target=num_blocks, start_blocks=pc.num_blocks, start_step=self.record.step,
        max_moves=max_moves, block_bytes=int(block_bytes), margin=int(margin),
        evict_cached=bool(evict_cached), held_at_start=held_above, held_above=held_above,
        staging=staging)
    previous = self.latest
    self._policy = policy
    self.pending = self.latest = progress
    # Room below the target now, so the next step's allocations already land there.
    t0 = time.perf_counter()
    try:
      progress.held_above, _ = self._make_room(progress, *self._progress(num_blocks))
    except BaseException as exc:
      self.pending, self.latest = None, previous  # no shrink registered
      on_room_failure(exc)
      raise
    progress.move_seconds += time.perf_counter() - t0
    return progress

  def cancel(self) -> regions.ShrinkProgress | None:
    """Ends a pending shrink without cutting (moves done stay; compaction resumes)."""
    s = self.pending
    if s is not None:
      s.cancelled = True
      self.pending = None
    return s

  def step(self, executor) -> None:
    """One step of the pending shrink: budgeted moves below the target, then the cut."""
    s = self.pending
    if s is None:
      return
    t0 = time.perf_counter()
    s.steps += 1
    self.stats.shrink_steps += 1
    held, free_below = self._progress(s.target)
    s.spilled_blocks += max(0, held - s.held_above)  # allocations that found no room below
    held, free_below = self._make_room(s, held, free_below)
    moved = 0
    if held:
      src, dst = host_ops.plan_shrink(self.pool.host, s.target, budget=s.max_moves)
      moved = int(np.sum(src >= 0))
      if moved:
        self.cached_pool.move_blocks(src, dst)  # tables and the cache follow the remap
        held -= moved
        s.moves += moved
        self.stats.shrink_moves += moved
        self.stats.shrink_bytes_moved += moved * s.block_bytes
        s.max_step_share = max(s.max_step_share,
                               self._policy.step_time_share(moved, s.block_bytes))
      else:
        s.wait_steps += 1
    s.last_moves, s.held_above = moved, held
    if held == 0:
      if self.admission.largest_need() <= s.target - self.pool.config.num_base_blocks:
        self._cut(s, executor)
      else:
        s.wait_steps += 1  # a request submitted since needs the bigger pool: it runs first
    s.move_seconds += time.perf_counter() - t0

  def _progress(self, target: int) -> tuple[int, int]:
    """`(held_above, free_below)` of `target` (from the host mirror)."""
    return host_ops.shrink_progress(self.pool.host, target)

  def _make_room(self, s: regions.ShrinkProgress, held: int, free_below: int) -> tuple[int, int]:
    """Evicts cached-only blocks until the room below the target holds what is above
    plus the margin (as far as the cache allows); returns the new `(held, free_below)`."""
    short = held + s.margin - free_below
    if short <= 0 or not s.evict_cached or not self.caching:
      return held, free_below
    freed = self.evictor.evict(short)
    if not freed:
      return held, free_below
    s.evicted_blocks += freed
    self.stats.shrink_evicted_blocks += freed
    return self._progress(s.target)

  def _cut(self, s: regions.ShrinkProgress, executor) -> None:
    """Cuts the (free) tail above the target; the executor and the quota follow."""
    old = self.pool.config.num_blocks
    compiles = counters.backend_compiles()  # the cut's own: the resize and the re-warm
    # Refuses (nothing changed) if the tail is referenced.
    report = self.cached_pool.resize(s.target, staging=s.staging)
    resize = getattr(executor, "resize", None)
    if callable(resize):
      try:
        resize(self.pool.config)
      except BaseException:
        # The cut blocks were free: growing back restores them.
        self.cached_pool.resize(old, staging=s.staging)
        raise
    s.cut = report
    quota = self.admission.quota
    if quota is not None:
      quota.total_blocks = s.target - self.pool.config.num_base_blocks
      quota.borrowed = min(quota.borrowed, quota.cached_quota)
    self.rewarm(compiles)
    s.done_step = self.record.step
    self.stats.shrinks += 1
    self.stats.shrink_blocks_returned += old - s.target
    self.pending = None
