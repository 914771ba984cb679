"""Cache governance the scheduler applies each step: quotas with watermarks, two-phase GC.

* Quotas (`regions.WatermarkQuota`): the dynamic blocks split into a live share
  (`live_fraction`) and a cached share. Above `high_watermark` of its limit, live
  borrows up to `max_step` blocks a step from the cached share; below
  `low_watermark` it gives them back. Admission holds a request that would pass the
  live limit (never when nothing runs); cached blocks above their limit are evicted.
* GC (`PrefixCache.gc_mark` / `gc_evict`): every `gc_every` steps, nodes idle for
  `gc_ttl` seconds are marked; under pressure marked nodes go first, highest block
  first, then LRU.
"""

from __future__ import annotations

import dataclasses
import math

from paged_kv.core import fields
from paged_kv.core.regions import WatermarkQuota

__all__ = ["CacheGovernance"]


@dataclasses.dataclass(frozen=True)
class CacheGovernance:
  """Quotas and GC for the scheduler (see the module docstring); `gc_ttl=None`: no GC."""

  quotas: bool = True
  live_fraction: float = 0.7
  high_watermark: float = 0.85
  low_watermark: float = 0.5
  max_step: int = 32
  gc_ttl: float | None = None
  gc_every: int = 64

  def __post_init__(self):
    """Checks every field (the quota's through `WatermarkQuota`)."""
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
