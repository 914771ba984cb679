"""Pool regions: base-pool promotion, live/cached quotas with watermarks, shrink/grow.

* Base pool (region 1): blocks `[0, config.num_base_blocks)`. Ordinary
  allocation (`allocate`, `reserve_tokens`) never hands them out and compaction
  never moves them. `plan_promotion` / `promote_blocks` move a dynamic block
  whose reader count (`ref_count`: every table row and cache node holding a
  segment on it) reached a threshold into a free base block: one block copy plus
  a `remap`, exactly like a compaction move. The unit is the block: all the
  segments on it move together and keep their `(start, length)`.
* Quotas (host policy): dynamic blocks are split between live sequences and
  cached-only blocks (held only by the prefix cache). `WatermarkQuota` lets live
  demand borrow from the cached quota above a high watermark and gives blocks
  back below a low one, at most `max_step` blocks per step.
* Shrink/grow: `plan_shrink` plans (budgeted) moves that empty the tail above
  a cut while serving; `shrink_progress` says (two scalars) how much is left;
  `resize_pool` cuts off a free tail or appends free blocks; `resized_config`
  is the config of the new size, with the same base region. `ShrinkProgress`
  is the serving loop's record of one shrink (`Scheduler.shrink_to`).
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
  """Dynamic blocks with at least `min_readers` references, to move into the base pool.

  Most-read blocks first (ties: lowest address), each paired with the lowest
  free base block.

  Args:
    meta: block metadata.
    min_readers: `i32[]` promotion threshold on `ref_count`.
    max_moves: static maximum number of promotions.

  Returns:
    `(src, dst)`: `i32[max_moves]` each, valid pairs first, `-1` padding.
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
  """Moves live dynamic blocks into free base-pool blocks (copy + remap).

  Args:
    state: the pool (donated).
    src: `i32[M]` live dynamic blocks (`-1` = padding).
    dst: `i32[M]` free base-region blocks (`-1` = padding).
    config: static pool config.
    impl, interpret: block-move implementation (see `compact.compact_permute`).

  Returns:
    `(state, (remap, status))` as `compact_permute`: tables are rewritten,
    `remap` is for holders outside the pool; one bad move refuses all.
  """
  return move_blocks(state, src, dst, config=config, dst_region=REGION_BASE, impl=impl,
                     interpret=interpret)


# ---------------------------------------------------------------------------
# Live vs cached-only quotas.
# ---------------------------------------------------------------------------


def block_usage(state: PoolState) -> tuple[int, int]:
  """`(live_blocks, cached_only_blocks)` of the dynamic region, on the host.

  A live block is referenced by a segment of an active table row; a cached-only
  block is referenced (`ref_count > 0`) but by no table row (only holders
  outside the pool, such as the prefix cache).
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
  """What `WatermarkQuota.update` decided for one step.

  Attributes:
    live_limit: blocks live sequences may hold now (own quota + borrowed).
    cached_limit: blocks cached-only data may hold now.
    borrowed: blocks currently lent by the cached quota to live sequences.
    change: blocks borrowed (> 0) or given back (< 0) at this step.
    evict_cached: cached-only blocks above `cached_limit`, to evict (radix GC).
  """

  live_limit: int
  cached_limit: int
  borrowed: int
  change: int
  evict_cached: int


@dataclasses.dataclass
class WatermarkQuota:
  """Two quotas over the dynamic blocks, live sequences vs cached-only, with borrowing.

  Live sequences own `live_fraction` of the dynamic blocks, cached-only blocks
  the rest. When live usage exceeds `high_watermark` of the live limit, live
  borrows up to `max_step` blocks per step from the cached quota (which evicts
  to make room); when it falls below `low_watermark`, borrowed blocks are given
  back, at most `max_step` per step. Host-side policy; the scheduler admits and
  evicts by the returned `QuotaDecision`.
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
  """Up to `budget` moves that empty the tail `[num_blocks, n)` for a shrink.

  The highest live dynamic blocks at or above `num_blocks` move into the lowest
  free dynamic blocks below it (a compaction toward low addresses that stops at
  the cut). Repeated until it returns no move, then `resize_pool` to
  `num_blocks` succeeds, unless the blocks below the cut cannot hold the live
  ones (then the plan runs dry with live blocks left above the cut).

  Returns:
    `(src, dst)`: `i32[budget]` each, valid moves first, `-1` padding (the
    format `compact_permute` takes).
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
  """`(held_above, free_below)`, `i32[]` each: what stands between the pool and a cut.

  `held_above`: referenced dynamic blocks at or above `num_blocks` (they must
  move, or be released, before `resize_pool` can cut there); `free_below`: free
  dynamic blocks below it (where they can go). One reduction, two scalars to the
  host: what a serving loop reads per step instead of `ref_count`.
  """
  n = meta.ref_count.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  dyn = meta.region == REGION_DYNAMIC
  held_above = jnp.sum((meta.ref_count > 0) & dyn & (idx >= num_blocks), dtype=jnp.int32)
  free_below = jnp.sum((meta.ref_count == 0) & dyn & (idx < num_blocks), dtype=jnp.int32)
  return held_above, free_below


@dataclasses.dataclass
class ShrinkProgress:
  """A shrink while serving (`Scheduler.shrink_to`): target, budget and progress so far.

  Host-side record, updated once per step by the scheduler.

  Attributes:
    target: pool size after the cut, in blocks.
    start_blocks: pool size when the shrink was requested.
    start_step: the scheduler step it was requested at.
    max_moves: block moves per step (the policy's byte budget over `block_bytes`).
    block_bytes: bytes per block the budget and `bytes_moved` count.
    margin: free blocks kept below the cut beyond what the moves need, so one
      step's allocations find room there (evicting cached blocks for it).
    evict_cached: whether cached-only blocks may be evicted to make room below the cut.
    held_at_start: referenced blocks above the target when it was requested.
    held_above: referenced blocks above the target at the latest step.
    steps: steps the shrink has been pending (including the cut's).
    moves: blocks moved (each `block_bytes` read and written).
    evicted_blocks: blocks freed by evicting cached-only data to make room.
    spilled_blocks: blocks that became referenced above the target while it
      was pending (allocations that found no free block below the cut).
    wait_steps: steps that could not progress: blocks above the target and no
      room below, or the tail free but a request submitted since still needing
      the bigger pool.
    move_seconds: host wall time of the shrink's work (plans, moves, evictions, cut).
    last_moves: blocks moved at the latest step.
    max_step_share: the largest modelled share of a step its moves took (the
      policy's `step_time_share` at `block_bytes`).
    done_step: the step of the cut (-1 while pending).
    cancelled: `Scheduler.cancel_shrink` ended it before the cut.
    staging: how the cut resizes the pages (`BlockPool.resize`): `"auto"`,
      `"device"` or `"host"`.
    cut: the cut's `resize.ResizeReport` (path taken, peak device bytes, bytes
      staged, seconds); None until the cut.
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
  """A pool of `new_config.num_blocks` blocks holding the same data (host call).

  Shrinking cuts blocks `[new_n, n)` off; they must all be free (run
  compaction first; `plan_compaction` moves live blocks to low addresses).
  Growing appends free dynamic blocks (zero pages). Block ids, segment tables
  and the base region are unchanged, so no remap is needed. Shapes change, so
  the result is a new pytree (jitted transitions recompile for it).

  Raises:
    InvalidArgument: `new_config` differs from `config` in more than the size,
      or the base region would change.
    InvalidBlock: a block to cut off is still referenced.
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
  """The block metadata of `resize_pool`'s result (cut or padded with free blocks,
  the free index rebuilt)."""
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
  """`resize_pool`'s arrays, jitted (one program per size; nothing checked: a cut
  tail must be free, which the caller verified). The old and the new pages are
  both alive while it runs; `resize.resize_state_staged` holds one pool at a time."""
  n, new_n = config.num_blocks, new_config.num_blocks
  if new_n < n:
    fit = lambda p: p[:, :, :new_n]
  else:
    fit = lambda p: jnp.concatenate(
        [p, jnp.zeros(p.shape[:2] + (new_n - n,) + p.shape[3:], p.dtype)], axis=2)
  pages = KVPages(k=fit(state.pages.k), v=fit(state.pages.v))
  meta = resize_meta(state.meta, config=config, new_config=new_config)
  return dataclasses.replace(state, pages=pages, meta=meta)
