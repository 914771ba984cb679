"""Pool regions: base-pool promotion, live/cached quotas with watermarks, shrink/grow.

The base pool (region 1, blocks `[0, num_base_blocks)`) is never handed out by
ordinary allocation nor moved by compaction; `promote_blocks` moves widely read
blocks there. `WatermarkQuota` splits dynamic blocks between live and
cached-only data. `plan_shrink`, `shrink_progress` and `resize_pool` shrink or
grow a pool while serving.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import fields
from paged_kv.core.alloc import rebuild_free_list
from paged_kv.core.compact import move_blocks
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, InvalidBlock
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC, BlockMeta, KVPages, PoolState

if TYPE_CHECKING:
  from paged_kv.core.resize import ResizeReport


# ---------------------------------------------------------------------------
# Base pool promotion.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("max_moves",))
def plan_promotion(meta: BlockMeta, min_readers: jax.Array | int, *,
                   max_moves: int) -> tuple[jax.Array, jax.Array]:
  """Dynamic blocks with at least `min_readers` references, paired with the lowest free base blocks.

  Most-read first (ties: lowest address). Returns `(src, dst)`, `i32[max_moves]`
  each, valid pairs first, `-1` padding.
  """
  n = meta.ref_count.shape[0]
  cand = (meta.region == REGION_DYNAMIC) & (meta.ref_count >= jnp.maximum(min_readers, 1))
  # Candidates first, then more readers, then lower address (last key = primary).
  order = jnp.lexsort((jnp.arange(n), -meta.ref_count, ~cand))
  num_cand = jnp.sum(cand, dtype=jnp.int32)
  free_base = (meta.region == REGION_BASE) & (meta.ref_count == 0)
  (base_idx,) = jnp.nonzero(free_base, size=n, fill_value=0)
  num_base = jnp.sum(free_base, dtype=jnp.int32)
  k = jnp.arange(max_moves, dtype=jnp.int32)
  ok = (k < num_cand) & (k < num_base)
  kk = jnp.clip(k, 0, n - 1)
  return (jnp.where(ok, order[kk], -1).astype(jnp.int32),
          jnp.where(ok, base_idx[kk], -1).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "impl", "interpret"),
                   donate_argnames=("state",))
def promote_blocks(state: PoolState, src: jax.Array, dst: jax.Array, *, config: PoolConfig,
                   impl: str = "xla",
                   interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Moves live dynamic blocks into free base-pool blocks; returns as `compact_permute` does."""
  return move_blocks(state, src, dst, config=config, dst_region=REGION_BASE, impl=impl,
                     interpret=interpret)


# ---------------------------------------------------------------------------
# Live vs cached-only quotas.
# ---------------------------------------------------------------------------


def block_usage(state: PoolState) -> tuple[int, int]:
  """`(live_blocks, cached_only_blocks)` of the dynamic region, on the host.

  Cached-only: referenced, but by no active table row (only outside holders).
  """
  t = jax.tree.map(np.asarray, state.table)
  meta = jax.tree.map(np.asarray, state.meta)
  n = meta.ref_count.shape[0]
  used = t.active[:, None] & (np.arange(t.block.shape[1])[None, :] < t.num_segments[:, None])
  in_table = np.zeros(n, bool)
  in_table[t.block[used]] = True
  dyn = meta.region == REGION_DYNAMIC
  live = in_table & dyn
  cached = (meta.ref_count > 0) & ~in_table & dyn
  return int(live.sum()), int(cached.sum())


@dataclasses.dataclass(frozen=True)
class QuotaDecision:
  """What `WatermarkQuota.update` decided for one step, in blocks.

  `live_limit` / `cached_limit`: what each may hold now; `borrowed`: lent by the
  cached quota; `change`: borrowed (> 0) or given back (< 0) now; `evict_cached`:
  cached-only blocks to evict.
  """

  live_limit: int
  cached_limit: int
  borrowed: int
  change: int
  evict_cached: int


@dataclasses.dataclass
class WatermarkQuota:
  """Two quotas over the dynamic blocks, live vs cached-only, with rate-limited borrowing.

  Live owns `live_fraction`; above `high_watermark` of its limit it borrows up to
  `max_step` blocks per step from the cached quota (which evicts), below
  `low_watermark` it gives them back.
  """

  total_blocks: int
  live_fraction: float = 0.7
  high_watermark: float = 0.85
  low_watermark: float = 0.5
  max_step: int = 32
  borrowed: int = 0
  owner: dataclasses.InitVar[str] = "WatermarkQuota"  # the name errors give the fields

  def __post_init__(self, owner: str = "WatermarkQuota"):
    """Checks every field (`paged_kv.core.fields`)."""
    self.total_blocks = fields.check_int(owner, "total_blocks", self.total_blocks, 1)
    self.live_fraction = fields.check_number(owner, "live_fraction", self.live_fraction, 0.0,
                                             1.0, low_open=True)
    self.high_watermark = fields.check_number(owner, "high_watermark", self.high_watermark,
                                              0.0, 1.0, low_open=True)
    self.low_watermark = fields.check_number(owner, "low_watermark", self.low_watermark, 0.0,
                                             self.high_watermark, high_open=True)
    self.max_step = fields.check_int(owner, "max_step", self.max_step, 1)
    self.borrowed = fields.check_int(owner, "borrowed", self.borrowed, 0)

  @property
  def live_quota(self) -> int:
    return int(math.floor(self.total_blocks * self.live_fraction))

  @property
  def cached_quota(self) -> int:
    return self.total_blocks - self.live_quota

  def update(self, live_blocks: int, cached_blocks: int) -> QuotaDecision:
    """Borrows or gives back (rate-limited) for the current usage; returns the limits."""
    limit = self.live_quota + self.borrowed
    usage = live_blocks / max(limit, 1)
    change = 0
    if usage > self.high_watermark and self.borrowed < self.cached_quota:
      change = min(self.max_step, self.cached_quota - self.borrowed)
    elif usage < self.low_watermark and self.borrowed > 0:
      change = -min(self.max_step, self.borrowed)
    self.borrowed += change
    live_limit = self.live_quota + self.borrowed
    cached_limit = self.cached_quota - self.borrowed
    return QuotaDecision(live_limit=live_limit, cached_limit=cached_limit,
                         borrowed=self.borrowed, change=change,
                         evict_cached=max(0, cached_blocks - cached_limit))


# ---------------------------------------------------------------------------
# Shrink / grow.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("budget",))
def plan_shrink(meta: BlockMeta, num_blocks: jax.Array | int, *,
                budget: int) -> tuple[jax.Array, jax.Array]:
  """Up to `budget` moves of live dynamic blocks at or above `num_blocks` into free ones below it.

  Repeated until it returns no move, after which `resize_pool` to `num_blocks`
  succeeds, unless the blocks below cannot hold the live ones. Returns `(src,
  dst)` as `plan_compaction` does.
  """
  n = meta.ref_count.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  dyn = meta.region == REGION_DYNAMIC
  above = (meta.ref_count > 0) & dyn & (idx >= num_blocks)
  below = (meta.ref_count == 0) & dyn & (idx < num_blocks)
  (rev,) = jnp.nonzero(above[::-1], size=n, fill_value=0)
  (low,) = jnp.nonzero(below, size=n, fill_value=0)
  k = jnp.arange(budget, dtype=jnp.int32)
  kk = jnp.clip(k, 0, n - 1)
  ok = (k < jnp.sum(above, dtype=jnp.int32)) & (k < jnp.sum(below, dtype=jnp.int32))
  src = (n - 1 - rev[kk]).astype(jnp.int32)
  return jnp.where(ok, src, -1), jnp.where(ok, low[kk].astype(jnp.int32), -1)


@jax.jit
def shrink_progress(meta: BlockMeta, num_blocks: jax.Array | int) -> tuple[jax.Array, jax.Array]:
  """`(held_above, free_below)`, `i32[]` each: referenced blocks at or above the cut, free below it.

  Two scalars a serving loop reads per step instead of `ref_count`.
  """
  n = meta.ref_count.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  dyn = meta.region == REGION_DYNAMIC
  held_above = jnp.sum((meta.ref_count > 0) & dyn & (idx >= num_blocks), dtype=jnp.int32)
  free_below = jnp.sum((meta.ref_count == 0) & dyn & (idx < num_blocks), dtype=jnp.int32)
  return held_above, free_below


@dataclasses.dataclass
class ShrinkProgress:
  """A shrink while serving (`Scheduler.shrink_to`), updated by the scheduler once per step.

  Sizes are in blocks. `held_at_start` / `held_above`: referenced blocks above the
  target then and now; `margin`: free blocks kept below the cut for one step's
  allocations; `wait_steps`: steps without progress; `spilled_blocks`: blocks
  newly referenced above the target meanwhile; `max_step_share`: the largest
  modelled share of a step the moves took; `done_step`: the cut's step (-1 while
  pending); `staging`: how the cut resizes (`BlockPool.resize`); `cut`: its
  `ResizeReport`.
  """

  target: int
  start_blocks: int
  start_step: int
  max_moves: int
  block_bytes: int
  margin: int = 0
  evict_cached: bool = True
  held_at_start: int = 0
  held_above: int = 0
  steps: int = 0
  moves: int = 0
  evicted_blocks: int = 0
  spilled_blocks: int = 0
  wait_steps: int = 0
  move_seconds: float = 0.0
  last_moves: int = 0
  max_step_share: float = 0.0
  done_step: int = -1
  cancelled: bool = False
  staging: str = "auto"
  cut: "ResizeReport | None" = None

  @property
  def done(self) -> bool:
    """The cut happened: the pool has `target` blocks."""
    return self.done_step >= 0

  @property
  def bytes_moved(self) -> int:
    return self.moves * self.block_bytes

  @property
  def blocks_returned(self) -> int:
    """Blocks given back by the cut (0 until it happened)."""
    return self.start_blocks - self.target if self.done else 0

  @property
  def emptied_fraction(self) -> float:
    """Share of the blocks above the target that are free now (1.0 once cut)."""
    if self.done:
      return 1.0
    span = self.start_blocks - self.target
    return 1.0 - self.held_above / span if span else 1.0


def resized_config(config: PoolConfig, num_blocks: int) -> PoolConfig:
  """`config` with `num_blocks` blocks and the same number of base-pool blocks."""
  nb = config.num_base_blocks
  if not isinstance(num_blocks, (int, np.integer)) or num_blocks <= nb:
    raise InvalidArgument(f"num_blocks must be an int > {nb} (the base pool), got {num_blocks!r}")
  # int(num_blocks * f) == nb exactly: f sits half a block above nb / num_blocks.
  fraction = 0.0 if nb == 0 else (nb + 0.5) / num_blocks
  new = dataclasses.replace(config, num_blocks=int(num_blocks), base_pool_fraction=fraction)
  assert new.num_base_blocks == nb
  return new


def resize_pool(state: PoolState, *, config: PoolConfig, new_config: PoolConfig) -> PoolState:
  """A pool of `new_config.num_blocks` blocks holding the same data (host call; shapes change).

  Shrinking cuts the free tail off, growing appends free blocks; ids, tables and
  base region stay. Raises `InvalidArgument` (`new_config` differs in more than
  the size or base region) or `InvalidBlock` (a cut block is referenced).
  """
  if new_config.num_base_blocks != config.num_base_blocks:
    raise InvalidArgument("resize_pool keeps the base region; build new_config with "
                          "resized_config()")
  same = dataclasses.replace(new_config, num_blocks=config.num_blocks,
                             base_pool_fraction=config.base_pool_fraction)
  if same != config:
    raise InvalidArgument("new_config may differ from config only in num_blocks")
  n, new_n = config.num_blocks, new_config.num_blocks
  if new_n < n:
    tail_refs = np.asarray(state.meta.ref_count)[new_n:]
    if tail_refs.any():
      live = np.flatnonzero(tail_refs) + new_n
      raise InvalidBlock(f"cannot cut blocks [{new_n}, {n}): {live.size} still referenced "
                         f"(e.g. {live[:8].tolist()}); compact first")
  return resize_state(state, config=config, new_config=new_config)


@functools.partial(jax.jit, static_argnames=("config", "new_config"))
def resize_meta(meta: BlockMeta, *, config: PoolConfig, new_config: PoolConfig) -> BlockMeta:
  """The block metadata of `resize_pool`'s result, free index rebuilt."""
  n, new_n = config.num_blocks, new_config.num_blocks
  if new_n < n:
    fit = lambda x: x[:new_n]
  else:
    fit = lambda x: jnp.concatenate([x, jnp.zeros((new_n - n,) + x.shape[1:], x.dtype)])
  ref_count, slots, last_use, region = (fit(meta.ref_count), fit(meta.slots),
                                        fit(meta.last_use), fit(meta.region))
  free_list, num_free = rebuild_free_list(ref_count, region)
  return BlockMeta(ref_count=ref_count, slots=slots, last_use=last_use, region=region,
                   free_list=free_list, num_free=num_free)


@functools.partial(jax.jit, static_argnames=("config", "new_config"))
def resize_state(state: PoolState, *, config: PoolConfig, new_config: PoolConfig) -> PoolState:
  """`resize_pool`'s arrays, jitted and unchecked; old and new pages are alive together."""
  n, new_n = config.num_blocks, new_config.num_blocks
  if new_n < n:
    fit = lambda p: p[:, :, :new_n]
  else:
    fit = lambda p: jnp.concatenate(
        [p, jnp.zeros(p.shape[:2] + (new_n - n,) + p.shape[3:], p.dtype)], axis=2)
  pages = KVPages(k=fit(state.pages.k), v=fit(state.pages.v))
  meta = resize_meta(state.meta, config=config, new_config=new_config)
  return dataclasses.replace(state, pages=pages, meta=meta)
