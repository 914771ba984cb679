"""`StepTelemetry`: a scheduler's pool figures, snapshots and alerts, step by step.

The cheap figures (`metrics.step_stats_host`, from the pool's host mirror) on the
steps `StatsPacer` picks, the full `metrics.PoolSnapshot` every `snapshot_every`
steps, edge-triggered alerts from both; the latest snapshots and alerts are kept.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from paged_kv.core.segment_format import Segments
from paged_kv.runtime import counters as runtime_counters
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.stats_pacing import StatsPacer
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord
from paged_kv.telemetry import metrics

MAX_KEPT_SNAPSHOTS = 10_000  # `Scheduler.snapshots` keeps the latest this many
MAX_KEPT_ALERTS = 10_000  # `Scheduler.alerts` keeps the latest this many


class StepTelemetry:
  """The figures, snapshots and alerts of a scheduler (see the module docstring)."""

  def __init__(self, cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
               record: StepRecord,
               on_snapshot: Callable[[int, metrics.PoolSnapshot, SchedulerStats], None] | None):
    self.cached_pool = cached_pool
    self.config = config
    self.stats = stats
    self.record = record
    self.on_snapshot = on_snapshot
    self.pacer = StatsPacer(config.stats_every, config.stats_budget)
    # The latest snapshots and alerts (bounded: a long-running server keeps memory
    # flat; every one is also handed to `on_snapshot` / in the `StepReport`).
    self.snapshots: collections.deque[metrics.PoolSnapshot] = collections.deque(
        maxlen=MAX_KEPT_SNAPSHOTS)
    self.alerts: collections.deque[metrics.Alert] = collections.deque(maxlen=MAX_KEPT_ALERTS)
    self._monitor = metrics.AlertMonitor()
    # The cheap pool figures of the latest step's start (`take_stats()`: now).
    self.last_stats: metrics.StepStats | None = None
    self._pending: metrics.StepStats | None = None
    self._seconds = 0.0
    self._runtime_base = cached_pool.pool.runtime.snapshot()
    self._compiles_at_warmup: int | None = None

  # ------------------------------------------------------------------ device traffic
  def runtime(self) -> runtime_counters.RuntimeCounters:
    """The pool's device traffic since the scheduler was built (`runtime.counters`)."""
    return self.cached_pool.pool.runtime.snapshot().since(self._runtime_base)

  def mark_warm(self) -> None:
    """After a warm-up: compiles from now on count in `stats.compiles_after_warmup`."""
    self._compiles_at_warmup = runtime_counters.backend_compiles()
    self.update_runtime_stats()

  def count_rewarm(self, compiles_before: int) -> None:
    """Counts a shrink cut's re-warm (compiles since `compiles_before`) in
    `stats.rewarm_compiles`, not after warm-up."""
    cut = runtime_counters.backend_compiles() - compiles_before
    self.stats.rewarm_compiles += cut
    self._compiles_at_warmup += cut

  def update_runtime_stats(self) -> None:
    """Copies the device traffic into the scheduler's `stats`."""
    rt, st = self.runtime(), self.stats
    st.device_dispatches = rt.num_dispatches
    st.bookkeeping_dispatches = rt.bookkeeping_dispatches
    st.blocking_reads = rt.blocking_reads
    st.backend_compiles = rt.backend_compiles
    if self._compiles_at_warmup is not None:
      st.compiles_after_warmup = runtime_counters.backend_compiles() - self._compiles_at_warmup

  # ------------------------------------------------------------------ pool figures

  def take_stats(self) -> metrics.StepStats:
    """The cheap pool figures now, from the pool's host mirror."""
    pool = self.cached_pool.pool
    return metrics.step_stats_host(pool.host, pool.config, counters=self.stats)

  def take_snapshot(self) -> metrics.PoolSnapshot:
    """The full pool snapshot now (O(num_blocks) host work)."""
    pool = self.cached_pool.pool
    return metrics.snapshot(pool.host, pool.config,
                            extra_segments=self.cached_pool.segment_refs(),
                            counters=self.stats)

  def extra_segments(self) -> Segments:
    """`i32[n, 3]` `(block, start, length)` references the cache holds."""
    return self.cached_pool.segment_refs()

  def begin(self, t0: float) -> metrics.StepStats | None:
    """At a step's start (`t0`, `perf_counter`): its figures when the step takes them."""
    self._pending, self._seconds = None, 0.0
    if self.pacer.takes(self.record.step):
      self._pending = self.take_stats()
      self._seconds = time.perf_counter() - t0
    return self._pending

  def end(self, step_id: int, t0: float) -> tuple:
    """At a step's end: `(figures, snapshot)` of the step (None where it took none);
    paces the figures, fires alerts, calls `on_snapshot` (which may raise)."""
    pool_stats = snap = None
    if self._pending is not None:
      t1 = time.perf_counter()
      pool_stats = self.last_stats = dataclasses.replace(
          self._pending, oom_by_reason=dict(self.stats.oom_by_reason))
      self._pending = None
      self._seconds += time.perf_counter() - t1
      self.pacer.pace(step_id, self._seconds, time.perf_counter() - t0 - self._seconds)
      self._observe_alerts(pool_stats)
    every = self.config.snapshot_every
    if every and step_id % every == 0:
      snap = self.take_snapshot()
      self.snapshots.append(snap)
      self._observe_alerts(snap)
      if self.on_snapshot is not None:
        self.on_snapshot(step_id, snap, self.stats)
    return pool_stats, snap

  def _observe_alerts(self, figures) -> None:
    fired = self._monitor.observe(figures)
    self.alerts.extend(fired)
    self.record.alerts.extend(fired)
