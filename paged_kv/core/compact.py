"""Online compaction: fragmentation ratio, a budgeted move plan, the in-place permutation.

`plan_compaction` (device) and `plan_defrag` (host) pair live dynamic blocks
with free ones; `compact_permute` copies the pages, moves the metadata, rewrites
the tables and returns `remap` (`remap[old] = new`) for outside holders.
Base-region blocks never move.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import fields
from paged_kv.core.alloc import rebuild_free_list
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import Status
from paged_kv.core.page_copy import move_pages
from paged_kv.core.sequences import first_occurrence
from paged_kv.core.state import REGION_DYNAMIC, BlockMeta, KVPages, PoolState

NUM_REGIONS = 2


def largest_run(mask: jax.Array) -> jax.Array:
  """`i32[]`: length of the longest run of consecutive True entries of `bool[N]` `mask`."""
  n = mask.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  # A max-scan: `lax.cummax` lowers to a reduce-window that XLA's CPU backend runs
  # 4-15x slower than this log-depth scan (measured at 64k-262k blocks).
  last_break = jax.lax.associative_scan(jnp.maximum, jnp.where(mask, -1, idx))
  return jnp.max(jnp.where(mask, idx - last_break, 0), initial=0).astype(jnp.int32)


def _word_runs(words: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per `u32` word, `i32[W]` each: ones from bit 0 up, ones from bit 31 down, longest inner run."""
  one = jnp.uint32(1)
  full = words == jnp.uint32(0xFFFFFFFF)
  inv = ~words
  # Trailing ones of `words` = trailing zeros of `inv` = popcount(lowest set bit - 1).
  pre = jax.lax.population_count((inv & (~inv + one)) - one).astype(jnp.int32)
  suf = jax.lax.clz(inv).astype(jnp.int32)
  # runs[k]: bit i set iff bits i .. i + 2**k - 1 are all ones.
  runs = [words]
  for k in range(4):
    runs.append(runs[-1] & (runs[-1] >> jnp.uint32(1 << k)))
  # Greedy binary lengthening: `cur` marks where a run of `length` ones starts.
  cur = jnp.full_like(words, 0xFFFFFFFF)
  length = jnp.zeros(words.shape, jnp.uint32)
  for k in (4, 3, 2, 1, 0):
    cand = cur & (runs[k] >> length)
    ok = cand != 0
    cur = jnp.where(ok, cand, cur)
    length = jnp.where(ok, length + jnp.uint32(1 << k), length)
  best = jnp.where(full, 32, length.astype(jnp.int32))
  return jnp.where(full, 32, pre), jnp.where(full, 32, suf), best


def largest_run_of_bits(free_bits: jax.Array) -> jax.Array:
  """`i32[]`: `largest_run` of the dynamic free mask, from the free index's `u32` words.

  O(num_blocks / 32): a log-depth pairwise merge over the words.
  """
  pre, suf, best = _word_runs(free_bits)
  size = jnp.full(pre.shape, 32, jnp.int32)
  width = 1 << max(0, (pre.shape[0] - 1).bit_length())
  if width > pre.shape[0]:  # pad with empty words (no free bit)
    pad = jnp.zeros((width - pre.shape[0],), jnp.int32)
    pre, suf, best, size = (jnp.concatenate([a, pad]) for a in (pre, suf, best, size))
  while pre.shape[0] > 1:
    (lp, rp), (ls, rs), (lb, rb), (lz, rz) = (
        (a[0::2], a[1::2]) for a in (pre, suf, best, size))
    pre = jnp.where(lp == lz, lz + rp, lp)
    suf = jnp.where(rs == rz, rz + ls, rs)
    best = jnp.maximum(jnp.maximum(lb, rb), ls + rp)
    size = lz + rz
  return best[0]


def fragmentation_ratio(meta: BlockMeta, *, region: int = REGION_DYNAMIC) -> jax.Array:
  """`f32[]`: 1 - largest contiguous free run / free blocks, within one region (0 if none free).

  A block of another region breaks a run.
  """
  free = (meta.ref_count == 0) & (meta.region == region)
  total = jnp.sum(free, dtype=jnp.int32)
  run = largest_run(free)
  return jnp.where(total > 0, 1.0 - run / jnp.maximum(total, 1), 0.0).astype(jnp.float32)


def region_fragmentation(meta: BlockMeta) -> jax.Array:
  """`f32[NUM_REGIONS]`: `fragmentation_ratio` of the dynamic (0) and base (1) regions."""
  return jnp.stack([fragmentation_ratio(meta, region=r) for r in range(NUM_REGIONS)])


@functools.partial(jax.jit, static_argnames=("budget",))
def plan_compaction(meta: BlockMeta, *, budget: int) -> tuple[jax.Array, jax.Array]:
  """Up to `budget` moves of live dynamic blocks from high to low addresses.

  The k-th highest live block moves to the k-th lowest free block while the source
  lies above the destination. Returns `(src, dst)`, `i32[budget]` each, valid
  moves first, `-1` padding.
  """
  n = meta.ref_count.shape[0]
  live = (meta.ref_count > 0) & (meta.region == REGION_DYNAMIC)
  num_live = jnp.sum(live, dtype=jnp.int32)
  (rev_idx,) = jnp.nonzero(live[::-1], size=n, fill_value=0)
  # Free blocks are derived from `ref_count` (not read from the free list, whose
  # layout is the allocator's business): ascending, the lowest first.
  free = (meta.ref_count == 0) & (meta.region == REGION_DYNAMIC)
  num_free = jnp.sum(free, dtype=jnp.int32)
  (free_idx,) = jnp.nonzero(free, size=n, fill_value=0)
  k = jnp.arange(budget, dtype=jnp.int32)
  src = (n - 1 - rev_idx[jnp.clip(k, 0, n - 1)]).astype(jnp.int32)
  dst = free_idx[jnp.clip(k, 0, n - 1)].astype(jnp.int32)
  ok = (k < num_live) & (k < num_free) & (src > dst)
  return jnp.where(ok, src, -1), jnp.where(ok, dst, -1)


def free_runs(free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Starts and ends (exclusive) of the runs of True in `free`."""
  padded = np.concatenate([[False], free, [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])
  return edges[::2], edges[1::2]


def _leading_true(a: np.ndarray) -> int:
  """Number of leading True entries of a 1-D bool array."""
  stop = np.flatnonzero(~a[:])
  return int(stop[0]) if stop.size else int(a.size)


def plan_defrag(ref_count, region, *, budget: int) -> tuple[np.ndarray, np.ndarray]:
  """Up to `budget` moves that lower the fragmentation ratio fastest (host, numpy).

  Grows the largest free run: each move takes the live block next to it (from
  the side whose live island is shorter) into the smallest other free run, so the
  ratio never rises. A block moved twice is retargeted (one copy). Returns `(src,
  dst)` as `plan_compaction` does.
  """
  ref = np.asarray(ref_count)
  dyn = np.asarray(region) == REGION_DYNAMIC
  n = ref.shape[0]
  free = (ref == 0) & dyn
  movable = (ref > 0) & dyn
  vacated = np.zeros(n, bool)
  src = np.full(budget, -1, np.int32)
  dst = np.full(budget, -1, np.int32)
  move_into: dict[int, int] = {}  # destination block -> index of the move filling it
  num_moves = 0
  for _ in range(2 * n):
    starts, ends = free_runs(free)
    if starts.size <= 1:
      break
    lengths = ends - starts
    main = int(np.argmax(lengths))
    s, e = int(starts[main]), int(ends[main])
    best = None  # (island length, -gap beyond, block)
    for block, step in ((e, 1), (s - 1, -1)):
      if not 0 <= block < n or not movable[block]:
        continue
      # Vectorised walks (a live island can be thousands of blocks long).
      island = _leading_true(movable[block:] if step == 1 else movable[block::-1])
      j = block + step * island
      gap = 0
      if 0 <= j < n:
        gap = _leading_true(free[j:] if step == 1 else free[j::-1])
      cand = (island, -gap, block)
      best = cand if best is None or cand < best else best
    if best is None:
      break
    block = best[2]
    target = None
    for i in np.argsort(lengths, kind="stable"):
      if i == main:
        continue
      cands = np.flatnonzero(~vacated[starts[i]:ends[i]])
      if cands.size:
        target = int(starts[i] + cands[0])
        break
    if target is None:
      break
    if block in move_into:  # data placed earlier in this plan: retarget that move
      k = move_into.pop(block)
    elif num_moves < budget:
      k, num_moves = num_moves, num_moves + 1
      src[k] = block
      vacated[block] = True
    else:
      break
    dst[k] = target
    move_into[target] = k
    free[block], movable[block] = True, False
    free[target], movable[target] = False, True
  return src, dst


def move_blocks(state: PoolState, src: jax.Array, dst: jax.Array, *, config: PoolConfig,
                dst_region: int, impl: str, interpret: bool) -> tuple[PoolState, tuple[jax.Array,
                                                                                      jax.Array]]:
  """Moves live dynamic blocks to free blocks of `dst_region` (traced helper).

  One bad move (out of range, source not live and dynamic, destination not free
  or not in `dst_region`, a block named twice) refuses the call: `INVALID_BLOCK`
  for it, `ABORTED` for the others. Returns `(state, (remap, status))`.
  """
  n = config.num_blocks
  meta, table = state.meta, state.table
  src = jnp.asarray(src, jnp.int32)
  dst = jnp.asarray(dst, jnp.int32)
  pad = (src == -1) & (dst == -1)
  in_range = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
  cs, cd = jnp.clip(src, 0, n - 1), jnp.clip(dst, 0, n - 1)
  src_ok = (meta.ref_count[cs] > 0) & (meta.region[cs] == REGION_DYNAMIC)
  dst_ok = (meta.ref_count[cd] == 0) & (meta.region[cd] == dst_region)
  unique = first_occurrence(jnp.where(pad, -1 - jnp.arange(src.shape[0]), src)) & \
      first_occurrence(jnp.where(pad, -1 - jnp.arange(dst.shape[0]), dst))
  good = pad | (in_range & src_ok & dst_ok & unique)
  status = jnp.where(good, Status.OK, Status.INVALID_BLOCK)
  all_ok = jnp.all(good)
  status = jnp.where(~all_ok & good & ~pad, Status.ABORTED, status).astype(jnp.int32)
  move = all_ok & ~pad
  s = jnp.where(move, src, -1)
  d = jnp.where(move, dst, -1)
  ds = jnp.where(move, dst, n)  # scatter index, out of range = dropped
  ss = jnp.where(move, src, n)

  pages = move_pages(state.pages, s, d, impl=impl, interpret=interpret)
  if config.scrub_freed_blocks:
    pages = KVPages(k=pages.k.at[:, :, ss].set(0, mode="drop"),
                    v=pages.v.at[:, :, ss].set(0, mode="drop"))
  def carry(x, empty):
    return x.at[ds].set(x[cs], mode="drop").at[ss].set(empty, mode="drop")
  ref_count = carry(meta.ref_count, 0)
  slots = carry(meta.slots, jnp.zeros((config.slot_words,), jnp.uint32))
  last_use = carry(meta.last_use, 0)
  free_list, num_free = rebuild_free_list(ref_count, meta.region)
  # No move applied (a refused or empty plan): keep the list bit-identical, stale part too.
  any_move = jnp.any(move)
  free_list = jnp.where(any_move, free_list, meta.free_list)
  num_free = jnp.where(any_move, num_free, meta.num_free)
  meta = dataclasses.replace(meta, ref_count=ref_count, slots=slots, last_use=last_use,
                             free_list=free_list, num_free=num_free)
  remap = jnp.arange(n, dtype=jnp.int32).at[ss].set(dst, mode="drop")
  used = table.active[:, None] & (jnp.arange(config.max_segments)[None, :]
                                  < table.num_segments[:, None])
  block = jnp.where(used, remap[jnp.clip(table.block, 0, n - 1)], table.block)
  table = dataclasses.replace(table, block=block)
  return dataclasses.replace(state, pages=pages, meta=meta, table=table), (remap, status)


@functools.partial(jax.jit, static_argnames=("config", "impl", "interpret"),
                   donate_argnames=("state",))
def compact_permute(state: PoolState, src: jax.Array, dst: jax.Array, *, config: PoolConfig,
                    impl: str = "xla",
                    interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Applies compaction moves `src -> dst` (`i32[M]`, `-1` padding) to pages, metadata and tables.

  `impl`: `"xla"`, `"pallas"` or `"mosaic"` block moves. Returns `(state, (remap,
  status))`: `remap: i32[num_blocks]` (`remap[old] = new`, identity elsewhere),
  `status: i32[M]`; one invalid move refuses the plan.
  """
  return move_blocks(state, src, dst, config=config, dst_region=REGION_DYNAMIC, impl=impl,
                     interpret=interpret)


STRATEGIES = ("merge", "top_down")

# Defaults of `CompactionPolicy`.
H200_COPY_BANDWIDTH = 4.3e12
"""Bytes/s of a device-to-device copy, counting read + write (measured on an H200).

A block move costs `2 * block_bytes / copy_bandwidth` seconds at this figure.
"""
DEFAULT_STEP_SECONDS = 0.020
"""Modelled serving step: an 8B-class decode on an H200 (~16 ms), rounded up."""
DEFAULT_STEP_FRACTION = 0.02
"""Share of a step compaction may take by default."""
LEGACY_MOVES = 32
"""Moves per step when neither a move cap nor the pool's bytes per block is known."""


@dataclasses.dataclass(frozen=True)
class CompactionPolicy:
  """When and how much to compact: a per-step budget in bytes (or step time), not moves.

  The budget is `budget_bytes`, else `step_fraction * step_seconds *
  copy_bandwidth / 2` (a move reads and writes), turned into moves by
  `max_moves(block_bytes)` and capped by `budget`. `threshold`: compact above this
  fragmentation ratio of the dynamic region; `on_contiguous_failure`: also after a
  `NO_CONTIGUOUS_RUN`; `strategy`: `"merge"` (`plan_defrag`, host) or
  `"top_down"` (`plan_compaction`).
  """

  threshold: float = 0.35
  budget: int | None = None
  on_contiguous_failure: bool = True
  strategy: str = "merge"
  budget_bytes: int | None = None
  step_fraction: float = DEFAULT_STEP_FRACTION
  step_seconds: float = DEFAULT_STEP_SECONDS
  copy_bandwidth: float = H200_COPY_BANDWIDTH

  def __post_init__(self):
    """Checks every field (`paged_kv.core.fields`)."""
    own = "CompactionPolicy"
    put = lambda name, value: object.__setattr__(self, name, value)
    put("threshold", fields.check_number(own, "threshold", self.threshold, 0.0, 1.0))
    put("budget", fields.check_int(own, "budget", self.budget, 1, fields.I32_MAX, optional=True))
    put("budget_bytes", fields.check_int(own, "budget_bytes", self.budget_bytes, 1, 2**62,
                                         optional=True))
    put("on_contiguous_failure", fields.check_bool(own, "on_contiguous_failure",
                                                   self.on_contiguous_failure))
    put("strategy", fields.check_choice(own, "strategy", self.strategy, STRATEGIES))
    put("step_fraction", fields.check_number(own, "step_fraction", self.step_fraction, 0.0, 1.0,
                                             low_open=True))
    for name in ("step_seconds", "copy_bandwidth"):
      put(name, fields.check_number(own, name, getattr(self, name), 0.0, math.inf,
                                    low_open=True, high_open=True))

  @property
  def step_bytes(self) -> int:
    """Bytes of blocks this policy may move per step (before the move cap)."""
    if self.budget_bytes is not None:
      return int(self.budget_bytes)
    return int(self.step_fraction * self.step_seconds * self.copy_bandwidth / 2)

  def max_moves(self, block_bytes: int | None = None) -> int:
    """Moves per step: `step_bytes // block_bytes` (at least 1), capped by `budget`.

    With `block_bytes=None`: `budget`, or `LEGACY_MOVES`.
    """
    if block_bytes is None:
      return int(self.budget) if self.budget is not None else LEGACY_MOVES
    if block_bytes < 1:
      raise ValueError(f"block_bytes must be >= 1, got {block_bytes!r}")
    moves = max(1, self.step_bytes // int(block_bytes))
    return int(min(moves, self.budget)) if self.budget is not None else int(moves)

  def num_moves(self, num_blocks: int, block_bytes: int | None = None) -> int:
    """`max_moves(block_bytes)` clamped to `[1, num_blocks // 2]`, the most moves that can exist."""
    return max(1, min(self.max_moves(block_bytes), int(num_blocks) // 2))

  def step_time_share(self, num_moves: int, block_bytes: int,
                      step_seconds: float | None = None) -> float:
    """Modelled share of a step that `num_moves` block moves take at `copy_bandwidth`."""
    seconds = 2 * num_moves * block_bytes / self.copy_bandwidth
    return seconds / (self.step_seconds if step_seconds is None else step_seconds)

  def plan(self, meta: BlockMeta, *, config: PoolConfig | None = None,
           block_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(src, dst)` of up to `num_moves` moves by this policy's strategy (host arrays).

    `block_bytes` overrides `config.block_bytes` for the byte budget.
    """
    if block_bytes is None and config is not None:
      block_bytes = config.block_bytes
    moves = self.num_moves(int(meta.ref_count.shape[0]), block_bytes)
    if self.strategy == "merge":
      return plan_defrag(meta.ref_count, meta.region, budget=moves)
    src, dst = plan_compaction(meta, budget=moves)
    return np.asarray(src), np.asarray(dst)

  def should_compact(self, ratio: float, contiguous_failed: bool = False) -> bool:
    """Host-side trigger: ratio above the threshold, or a failed contiguous request."""
    return bool(ratio > self.threshold or (self.on_contiguous_failure and contiguous_failed))


@functools.partial(jax.jit, static_argnames=("config", "policy", "impl", "interpret"),
                   donate_argnames=("state",))
def compact_step(state: PoolState, force: jax.Array | bool = False, *, config: PoolConfig,
                 policy: CompactionPolicy = CompactionPolicy(), impl: str = "xla",
                 interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """One budgeted compaction step on device, `"top_down"` whatever `policy.strategy` says.

  Moves nothing unless the dynamic region's ratio exceeds `policy.threshold` or
  `force` is set (after a `NO_CONTIGUOUS_RUN` failure). Returns `(state, (remap,
  num_moves))`.
  """
  ratio = fragmentation_ratio(state.meta)
  go = (ratio > policy.threshold) | jnp.asarray(force, bool)
  budget = max(1, min(policy.max_moves(config.block_bytes), config.num_blocks // 2))
  src, dst = plan_compaction(state.meta, budget=budget)
  src = jnp.where(go, src, -1)
  dst = jnp.where(go, dst, -1)
  state, (remap, _) = move_blocks(state, src, dst, config=config, dst_region=REGION_DYNAMIC,
                                  impl=impl, interpret=interpret)
  return state, (remap, jnp.sum(src >= 0, dtype=jnp.int32))


__all__ = ["CompactionPolicy", "DEFAULT_STEP_FRACTION", "DEFAULT_STEP_SECONDS",
           "H200_COPY_BANDWIDTH", "LEGACY_MOVES", "STRATEGIES", "compact_permute", "compact_step",
           "fragmentation_ratio", "largest_run", "move_blocks", "plan_compaction", "plan_defrag",
           "region_fragmentation"]
