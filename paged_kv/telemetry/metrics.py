"""Pool metrics: the cheap per-step figures, the full snapshot, and threshold alerts.

`StepStats` (every step, from the host mirror) and `PoolSnapshot` (periodic, every
block) are derived from the state, the segments held outside the pool and the
caller's cumulative counters (a `paged_kv.scheduler.SchedulerStats`: OOMs,
compaction); nothing is stored twice. `check_alerts` turns a
snapshot into `Alert`s with a likely cause and an action; `AlertMonitor` fires
each once per upward crossing.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.core.segment_format import Segments, as_segments
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC, PoolState
from paged_kv.pool.host_state import HostState

REGION_NAMES = {REGION_DYNAMIC: "dynamic", REGION_BASE: "base"}


def largest_free_run(free: np.ndarray) -> int:
  """Length of the longest run of consecutive True entries of `free`."""
  if not free.any():
    return 0
  padded = np.concatenate([[False], free, [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])
  return int((edges[1::2] - edges[::2]).max())


def fragmentation_ratio(free: np.ndarray) -> float:
  """1 - largest contiguous free run / total free blocks (0 when nothing is free)."""
  total = int(free.sum())
  return 0.0 if total == 0 else 1.0 - largest_free_run(free) / total


def region_free_masks(ref_count: np.ndarray, region: np.ndarray) -> dict[str, np.ndarray]:
  """Free-block masks per region name; a block of another region breaks a run."""
  return {name: (ref_count == 0) & (region == r) for r, name in REGION_NAMES.items()}


def _is_mirror(state) -> bool:
  """Whether `state` is a pool's host mirror (numpy, no device)."""
  return hasattr(state, "free") and hasattr(state, "table_refs")


def live_slot_mask(state, extra_segments: Segments | None = None) -> np.ndarray:
  """`bool[num_blocks, block_size]`: slots covered by a live row's or an `extra_segments` segment.

  `state` may be a `PoolState` or a pool's host mirror (no device read). Raises
  `InvalidSegmentLayout` when `extra_segments` is not `i32[n, 3]`.
  """
  if _is_mirror(state):
    t, n, bs = state, state.config.num_blocks, state.config.block_size
  else:
    t = jax.tree.map(np.asarray, state.table)
    n, bs = state.pages.k.shape[2], state.pages.k.shape[3]
  used = t.active[:, None] & (np.arange(t.block.shape[1])[None, :] < t.num_segments[:, None])
  segs = np.stack([t.block[used], t.start[used], t.length[used]], axis=1).astype(np.int64)
  if extra_segments is not None:
    extra = as_segments(extra_segments, name="extra_segments").astype(np.int64)
    segs = np.concatenate([segs, extra])
  # Difference array over the flat slot space: +1 at start, -1 at end.
  diff = np.zeros(n * bs + 1, np.int64)
  flat = segs[:, 0] * bs + segs[:, 1]
  np.add.at(diff, flat, 1)
  np.add.at(diff, flat + segs[:, 2], -1)
  return (np.cumsum(diff[:-1]) > 0).reshape(n, bs)


def ghost_blocks(ref_count: np.ndarray, region: np.ndarray, free_list: np.ndarray,
                 num_free) -> int:
  """Blocks on which the free list and `ref_count` disagree, either way (0 by construction).

  Counts free dynamic blocks missing from the list's window, window entries naming
  a referenced, base-region or out-of-range block, repeated entries, and any
  `num_free` excess.
  """
  ref_count, region, free_list = (np.asarray(a) for a in (ref_count, region, free_list))
  n = ref_count.shape[0]
  nf = int(num_free)
  bad_count = max(nf - n, -nf, 0)
  nf = min(max(nf, 0), n)
  window = free_list[n - nf:].astype(np.int64) if nf else np.zeros(0, np.int64)
  in_range = (window >= 0) & (window < n)
  ids = window[in_range]
  counts = np.bincount(ids, minlength=n)
  dyn_free = (ref_count == 0) & (region == REGION_DYNAMIC)
  missing = int(np.sum(dyn_free & (counts == 0)))
  listed_used = int(np.sum((counts > 0) & ~dyn_free)) + int(np.sum(~in_range))
  duplicates = int(np.sum(np.maximum(counts - 1, 0)))
  return missing + listed_used + duplicates + bad_count


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
  """Memory metrics of a pool at one instant.

  Attributes:
    block_pool_utilization: used blocks / all blocks (cache-only blocks count as used).
    kv_usage_ratio: blocks a live sequence uses / all blocks (vLLM's
      `kv_cache_usage_perc`: evictable cache-only blocks count as free).
    internal_fragmentation: 1 - live slots / slots of used blocks (dead slots of
      moved or released segments count as waste).
    handed_out_internal_fragmentation: the same from the slot bits alone (<= it).
    fragmentation_ratio: dynamic region, 1 - largest free run / free blocks;
      `fragmentation_by_region` per region name.
    largest_contiguous_free_bytes: bytes of the largest free dynamic run.
    live_blocks, cached_only_blocks: blocks used by table rows / only by outside holders.
    ghost_block_bytes: bytes of the blocks `ghost_blocks` counts (0 by construction).
    oom_*, compaction_*: from the caller's counters.
  """

  num_blocks: int
  num_free_blocks: int
  block_pool_utilization: float
  kv_usage_ratio: float
  internal_fragmentation: float
  handed_out_internal_fragmentation: float
  fragmentation_ratio: float
  fragmentation_by_region: dict
  largest_contiguous_free_bytes: int
  segments_per_sequence: float
  live_sequences: int
  live_tokens: int
  live_blocks: int
  cached_only_blocks: int
  ghost_block_bytes: int
  oom_by_reason: dict
  oom_by_seq_len: dict
  compaction_moves: int
  compaction_seconds: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _MirrorMeta:
  ref_count: np.ndarray
  slots: np.ndarray
  region: np.ndarray
  free_list: np.ndarray
  num_free: int


def _free_list_of(free: np.ndarray, num_free: int) -> np.ndarray:
  """The ascending free-list layout of a free mask, in numpy."""
  n = free.shape[0]
  out = np.full(n, -1, np.int32)
  idx = np.flatnonzero(free)
  k = min(int(num_free), n)
  out[n - k:] = np.concatenate([idx, np.full(max(k - idx.size, 0), -1)])[:k]
  return out


def snapshot(state, config: PoolConfig, *, extra_segments: Segments | None = None,
             counters=None, assert_no_ghosts: bool = True) -> PoolSnapshot:
  """Computes a `PoolSnapshot` on the host from `state` (a device state or the host mirror).

  `extra_segments: i32[n, 3]` held outside the tables count as live slots;
  `counters` (a `SchedulerStats`, or any object with its `oom_*` and `compaction_*`
  fields) gives the cumulative figures; None counts zeros. `assert_no_ghosts` (default) raises
  `AssertionError` on a ghost block; a monitoring loop passes False and alerts.
  """
  if _is_mirror(state):
    meta = _MirrorMeta(state.ref_count, state.slots, state.region,
                       _free_list_of(state.free.mask(), state.free.num_free), state.free.num_free)
    table = state
  else:
    meta = jax.tree.map(np.asarray, state.meta)
    table = jax.tree.map(np.asarray, state.table)
  n, bs = config.num_blocks, config.block_size
  used = meta.ref_count > 0
  i = np.arange(bs)
  bits = (meta.slots[:, i // 32] >> (i % 32).astype(np.uint32)) & 1
  handed_out = int(bits[used].sum())
  live = live_slot_mask(state, extra_segments)
  live_slots = int(live[used].sum())
  used_slots_total = int(used.sum()) * bs
  masks = region_free_masks(meta.ref_count, meta.region)
  dyn_free = masks["dynamic"]
  ghosts = ghost_blocks(meta.ref_count, meta.region, meta.free_list, meta.num_free)
  if assert_no_ghosts:
    assert ghosts == 0, f"{ghosts} ghost blocks: free list and ref_count disagree"
  active = table.active
  num_live = int(active.sum())
  seg_used = active[:, None] & (np.arange(table.block.shape[1])[None, :]
                                < table.num_segments[:, None])
  in_table = np.zeros(n, bool)
  in_table[table.block[seg_used]] = True
  return PoolSnapshot(
      num_blocks=n,
      num_free_blocks=int((~used).sum()),
      block_pool_utilization=float(used.mean()),
      kv_usage_ratio=float((in_table & used).sum()) / n,
      internal_fragmentation=0.0 if not used.any() else 1.0 - live_slots / used_slots_total,
      handed_out_internal_fragmentation=(0.0 if not used.any()
                                         else 1.0 - handed_out / used_slots_total),
      fragmentation_ratio=fragmentation_ratio(dyn_free),
      fragmentation_by_region={name: fragmentation_ratio(m) for name, m in masks.items()},
      largest_contiguous_free_bytes=largest_free_run(dyn_free) * config.block_bytes,
      segments_per_sequence=float(table.num_segments[active].mean()) if num_live else 0.0,
      live_sequences=num_live,
      live_tokens=int(table.seq_len[active].sum()),
      live_blocks=int((in_table & used).sum()),
      cached_only_blocks=int((used & ~in_table).sum()),
      ghost_block_bytes=ghosts * config.block_bytes,
      oom_by_reason=dict(counters.oom_by_reason) if counters is not None else {},
      oom_by_seq_len=dict(counters.oom_by_seq_len) if counters is not None else {},
      compaction_moves=counters.compaction_moves if counters is not None else 0,
      compaction_seconds=counters.compaction_seconds if counters is not None else 0.0,
  )


# ---------------------------------------------------------------------------
# Cheap per-step figures.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepStats:
  """The per-step pool figures: a few scalars, cheap enough for every step.

  Computed one way, from a pool's host mirror (`step_stats_host`, no device work);
  `step_stats` reads a bare `PoolState`'s bookkeeping into a mirror first. `snapshot`
  (every block, internal fragmentation, ghosts, per-region detail) is the periodic,
  full picture.

  Attributes:
    num_blocks: pool size in blocks (both regions).
    free_blocks: blocks with no reference (`ref_count == 0`).
    cached_blocks: referenced blocks no live table row uses: held only by
      outside holders (the prefix cache), so evictable.
    used_blocks: blocks a live sequence uses (`num_blocks - free - cached`).
    kv_usage_ratio: `used_blocks / num_blocks` (cached blocks count as free, as
      in vLLM's `kv_cache_usage_perc`).
    fragmentation_ratio: dynamic region, 1 - largest free run / free blocks.
    largest_free_run_blocks: the largest run of free dynamic blocks.
    block_bytes: bytes of one block (all layers, K and V).
    oom_by_reason: cumulative OOMs by reason, from the caller's counters.
  """

  num_blocks: int
  free_blocks: int
  cached_blocks: int
  used_blocks: int
  kv_usage_ratio: float
  fragmentation_ratio: float
  largest_free_run_blocks: int
  block_bytes: int
  oom_by_reason: dict = dataclasses.field(default_factory=dict)

  @property
  def largest_contiguous_free_bytes(self) -> int:
    return self.largest_free_run_blocks * self.block_bytes


def step_stats_host(host, config: PoolConfig, *, counters=None) -> StepStats:
  """`StepStats` from a pool's host mirror: no device work; `counters` as `snapshot`'s."""
  n = config.num_blocks
  dyn_free = host.free.num_free
  free = dyn_free + host.num_free_base
  used = host.num_table_blocks
  cached = n - free - used
  run = host.free.largest_run()
  return StepStats(num_blocks=n, free_blocks=free, cached_blocks=cached, used_blocks=used,
                   kv_usage_ratio=used / n,
                   fragmentation_ratio=0.0 if dyn_free == 0 else 1.0 - run / dyn_free,
                   largest_free_run_blocks=run, block_bytes=config.block_bytes,
                   oom_by_reason=dict(counters.oom_by_reason) if counters is not None else {})


def step_stats(state: PoolState, config: PoolConfig, *, counters=None) -> StepStats:
  """`StepStats` of a bare `PoolState`: its bookkeeping (not its pages) read to the
  host once, then `step_stats_host`'s arithmetic."""
  return step_stats_host(HostState.from_device(state, config), config, counters=counters)


# ---------------------------------------------------------------------------
# Alerts.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AlertThresholds:
  """Levels above which `check_alerts` raises an alert (fractions unless noted)."""

  fragmentation_ratio: float = 0.35
  internal_fragmentation: float = 0.10
  kv_usage_ratio: float = 0.95
  segments_per_sequence: float = 32.0
  oom_no_free_block: int = 0          # count; any OOM of this kind alerts
  oom_no_contiguous_run: int = 0
  oom_table_full: int = 0
  ghost_block_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Alert:
  """A structured alert event: `metric` (a snapshot field or `oom_by_reason.<reason>`) is high.

  `value` crossed `threshold`; `severity` is `"warning"` or `"critical"`;
  `likely_cause` and `suggested_action` are for the operator.
  """

  metric: str
  value: float
  threshold: float
  severity: str
  likely_cause: str
  suggested_action: str

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# `(metric, severity, likely cause, suggested action)` of every alert rule; the
# thresholds are `AlertThresholds`' fields (deploy/prometheus/alerts.yml mirrors them).
ALERT_RULES = (
    ("fragmentation_ratio", "warning",
     "live blocks scattered among free holes (long and short requests arriving and leaving)",
     "run budgeted compaction (compact_step) or raise CompactionPolicy.budget"),
    ("internal_fragmentation", "warning",
     "short segments (short radix nodes, finished tails, shared tails) each own a mostly "
     "empty block",
     "pack short segments (pack_slots; PrefixCache(pack_tails=True)) and cow_split shared "
     "tails before appending"),
    ("kv_usage_ratio", "warning",
     "live sequences hold almost every block (blocks held only by the prefix cache are "
     "not counted: they are evicted on demand)",
     "admit fewer sequences (output_reserve_ratio, watermark), preempt, or grow the pool"),
    ("segments_per_sequence", "warning",
     "appends start new segments because tails are shared or slotted",
     "cow_split tails before appending; pack less aggressively for live sequences"),
    ("oom_by_reason.no_free_block", "critical",
     "the pool is exhausted (too small, or the prefix cache holds too much)",
     "evict cached-only blocks, preempt (swap or recompute), or grow the pool"),
    ("oom_by_reason.no_contiguous_run", "warning",
     "external fragmentation: enough free blocks but no contiguous run",
     "compact now (the failed request is a trigger) or raise the per-step budget"),
    ("oom_by_reason.table_full", "warning",
     "sequences need more segments than max_segments (many short appends or packing)",
     "raise PoolConfig.max_segments or cow_split tails so appends stay in place"),
    ("ghost_block_bytes", "critical",
     "free-list and ref_count bookkeeping disagree: a bug",
     "run check_invariants, dump the state, and report it"),
)


def _metric_value(snap: "PoolSnapshot | StepStats", metric: str) -> float | None:
  """The rule's value in `snap`, or None when `snap` (e.g. a `StepStats`) does not carry it."""
  if metric.startswith("oom_by_reason."):
    return float(snap.oom_by_reason.get(metric.split(".", 1)[1], 0))
  value = getattr(snap, metric, None)
  return None if value is None else float(value)


def _threshold(thresholds: AlertThresholds, metric: str) -> float:
  name = metric.replace("oom_by_reason.", "oom_")
  return float(getattr(thresholds, name))


def check_alerts(snap: "PoolSnapshot | StepStats",
                 thresholds: AlertThresholds = AlertThresholds()) -> list[Alert]:
  """Alerts for every metric of `snap` above its threshold (level-triggered)."""
  alerts = []
  for metric, severity, cause, action in ALERT_RULES:
    value, level = _metric_value(snap, metric), _threshold(thresholds, metric)
    if value is not None and value > level:
      alerts.append(Alert(metric, value, level, severity, cause, action))
  return alerts


@dataclasses.dataclass
class AlertMonitor:
  """Edge-triggered alerts: one event when a metric crosses its threshold upwards.

  It alerts again only after a snapshot at or below the threshold; OOM counters
  compare their increase since the previous snapshot.
  """

  thresholds: AlertThresholds = AlertThresholds()
  _firing: set = dataclasses.field(default_factory=set)
  _last_oom: dict = dataclasses.field(default_factory=dict)

  def observe(self, snap: "PoolSnapshot | StepStats") -> list[Alert]:
    """Alerts that fire now; a `StepStats` updates only the rules it carries."""
    events = []
    for metric, severity, cause, action in ALERT_RULES:
      value = _metric_value(snap, metric)
      if value is None:
        continue
      if metric.startswith("oom_by_reason."):
        value, self._last_oom[metric] = value - self._last_oom.get(metric, 0.0), value
      level = _threshold(self.thresholds, metric)
      if value > level:
        if metric not in self._firing:
          self._firing.add(metric)
          events.append(Alert(metric, value, level, severity, cause, action))
      else:
        self._firing.discard(metric)
    return events


def alerts_from(snapshots: Iterable[PoolSnapshot],
                thresholds: AlertThresholds = AlertThresholds()) -> list[Alert]:
  """Runs an `AlertMonitor` over a series of snapshots; returns all events."""
  mon = AlertMonitor(thresholds)
  return [a for s in snapshots for a in mon.observe(s)]
