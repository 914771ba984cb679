"""Cache governance run by the scheduler: live/cached quotas with watermarks, two-phase GC.

`CacheGovernance` is the policy a `SchedulerConfig` carries; the scheduler applies it
every step:

* **Quotas** (`regions.WatermarkQuota`): the dynamic blocks are split between live
  sequences (`live_fraction`) and cached-only blocks (the prefix cache). When live
  usage goes above `high_watermark` of the live limit, live sequences borrow up to
  `max_step` blocks per step from the cached quota; below `low_watermark` they give
  them back, `max_step` per step. Admission holds a request while the live limit
  would be exceeded (never when nothing runs, so a request `submit` accepted always
  runs); cached-only blocks above the cached limit are evicted.
* **Two-phase GC** (`PrefixCache.gc_mark` / `gc_evict`): every `gc_every` steps the
  cache nodes idle for `gc_ttl` seconds (the scheduler's clock) are marked; under
  pressure marked nodes are evicted first, highest block address first (allocation is
  lowest-first, so this frees the top of the pool and leaves less to compact), then
  LRU.

The usage figures come from the scheduler's cheap per-step `metrics.StepStats` (no
per-block host copy).
"""

from __future__ import annotations

import dataclasses
import math

from paged_kv.core import fields
from paged_kv.core.regions import WatermarkQuota

__all__ = ["CacheGovernance"]


@dataclasses.dataclass(frozen=True)
class CacheGovernance:
  """Quotas and GC for the scheduler (see the module docstring).

  Attributes:
    quotas: split the dynamic blocks into a live and a cached quota.
    live_fraction: the live quota's share of the dynamic blocks.
    high_watermark, low_watermark: live usage (of the live limit) above which
      live borrows from the cached quota, below which it gives back.
    max_step: blocks borrowed or given back per step at most.
    gc_ttl: seconds a cache node must sit unused to be marked (None: no GC).
    gc_every: steps between two marking passes.
  """

  quotas: bool = True
  live_fraction: float = 0.7
  high_watermark: float = 0.85
  low_watermark: float = 0.5
  max_step: int = 32
  gc_ttl: float | None = None
  gc_every: int = 64

  def __post_init__(self):
    """Checks every field (`paged_kv.core.fields`; the quota's through `WatermarkQuota`)."""
    own = "CacheGovernance"
    put = lambda name, value: object.__setattr__(self, name, value)
    put("quotas", fields.check_bool(own, "quotas", self.quotas))
    put("gc_ttl", fields.check_number(own, "gc_ttl", self.gc_ttl, 0.0, math.inf,
                                      high_open=True, optional=True))
    put("gc_every", fields.check_int(own, "gc_every", self.gc_every, 1))
    WatermarkQuota(total_blocks=1, live_fraction=self.live_fraction,
                   high_watermark=self.high_watermark, low_watermark=self.low_watermark,
                   max_step=self.max_step, owner=own)  # the quota's fields, named as ours

  def quota(self, dynamic_blocks: int) -> WatermarkQuota:
    """A fresh quota over `dynamic_blocks` (nothing borrowed)."""
    return WatermarkQuota(total_blocks=dynamic_blocks, live_fraction=self.live_fraction,
                          high_watermark=self.high_watermark,
                          low_watermark=self.low_watermark, max_step=self.max_step)
