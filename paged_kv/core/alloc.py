"""Block allocation: the free list, `allocate`, `apply_ref_deltas`, freeing.

The free list (`BlockMeta.free_list`) keeps the free dynamic blocks in ascending
address order, so taking `k` blocks is a gather of `k` entries: the decode path
(`reserve_tokens`) never scans the pool. Freeing rebuilds the list from
`ref_count` with one vectorised pass, which keeps it an exact index of
`ref_count == 0` (no "ghost" blocks can exist) and happens between steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.core.state import REGION_DYNAMIC, BlockMeta, KVPages, PoolState

CONTIGUOUS_MODES = ("prefer", "require", "never")
FIT_MODES = ("first", "best")

# ---------------------------------------------------------------------------
# Free-list primitives (traced helpers, used by the transitions).
# ---------------------------------------------------------------------------


def grant_prefix(need: jax.Array, ok: jax.Array, num_free: jax.Array, *,
                 atomic: bool) -> jax.Array:
  """Which requests get their blocks: first come, first served, in batch order.

  Args:
    need: `i32[B]` blocks each request needs.
    ok: `bool[B]` requests still valid.
    num_free: `i32[]` free blocks.
    atomic: grant nothing unless every valid request can be granted.

  Returns:
    `bool[B]` granted. A request needing no block is always granted; one
    needing blocks is granted iff it and every earlier valid request fit in
    `num_free` together (prefix-greedy: O(B), first come first served, so a
    large early request that does not fit also stops later ones).
  """
  need = jnp.where(ok, need, 0)
  granted = ok & ((need == 0) | (jnp.cumsum(need) <= num_free))
  if atomic:
    granted = granted & jnp.all(granted == ok)
  return granted


def take_blocks(meta: BlockMeta, need: jax.Array, granted: jax.Array, *, max_per_request: int,
                step: jax.Array) -> tuple[BlockMeta, jax.Array]:
  """Pops blocks off the front of the free list for every granted request.

  Args:
    meta: block metadata.
    need: `i32[B]` blocks per request (`<= max_per_request`).
    granted: `bool[B]` from `grant_prefix`; their total need fits.
    max_per_request: static width of the result.
    step: logical clock written to `last_use`.

  Returns:
    `(meta, ids)` with `ids: i32[B, max_per_request]` ascending block ids per
    request, `-1` where unused. Taken blocks get `ref_count = 1`.
  """
  n = meta.ref_count.shape[0]
  eff = jnp.where(granted, need, 0)
  offset = jnp.cumsum(eff) - eff
  j = jnp.arange(max_per_request, dtype=jnp.int32)
  pos = (n - meta.num_free) + offset[:, None] + j[None, :]
  used = j[None, :] < eff[:, None]
  ids = jnp.where(used, meta.free_list[jnp.clip(pos, 0, n - 1)], -1)
  flat = jnp.where(used, ids, n).reshape(-1)  # n = out of range -> dropped
  meta = dataclasses.replace(
      meta,
      ref_count=meta.ref_count.at[flat].set(1, mode="drop"),
      last_use=meta.last_use.at[flat].set(step, mode="drop"),
      num_free=meta.num_free - jnp.sum(eff),
  )
  return meta, ids


def rebuild_free_list(ref_count: jax.Array, region: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The free list as an exact, ascending index of free dynamic blocks. O(num_blocks)."""
  n = ref_count.shape[0]
  is_free = (ref_count == 0) & (region == REGION_DYNAMIC)
  num_free = jnp.sum(is_free, dtype=jnp.int32)
  (idx,) = jnp.nonzero(is_free, size=n, fill_value=0)
  free_list = jnp.take(idx, (jnp.arange(n, dtype=jnp.int32) - (n - num_free)) % n)
  return free_list.astype(jnp.int32), num_free


def change_refs(state: PoolState, block_ids: jax.Array, deltas: jax.Array, *,
                config: PoolConfig, may_free: bool = True) -> PoolState:
  """Adds `deltas` to `ref_count[block_ids]`; blocks reaching zero become free.

  Freed blocks get their slot bitmap cleared, are zeroed when
  `config.scrub_freed_blocks`, and return to the free list (an O(num_blocks)
  rebuild, skipped when `may_free=False`, i.e. for increfs of live blocks).
  Out-of-range ids (use `num_blocks` for padding) are dropped. The caller has
  validated that no count goes negative and that no free block is increfed.
  """
  meta = state.meta
  n = meta.ref_count.shape[0]
  flat_ids = block_ids.reshape(-1)
  new_ref = meta.ref_count.at[flat_ids].add(deltas.reshape(-1), mode="drop")
  if not may_free:
    return dataclasses.replace(state, meta=dataclasses.replace(meta, ref_count=new_ref))
  freed = (new_ref == 0) & (meta.ref_count > 0)
  slots = jnp.where(freed[:, None], jnp.zeros_like(meta.slots), meta.slots)
  rebuilt, rebuilt_num = rebuild_free_list(new_ref, meta.region)
  # Keep the list bit-identical when nothing was freed (a refused call changes nothing).
  any_freed = jnp.any(freed)
  free_list = jnp.where(any_freed, rebuilt, meta.free_list)
  num_free = jnp.where(any_freed, rebuilt_num, meta.num_free)
  pages = state.pages
  if config.scrub_freed_blocks:
    # Only the blocks this call touched can have been freed: scrub those.
    touched_freed = jnp.where(freed[jnp.clip(flat_ids, 0, n - 1)] & (flat_ids < n), flat_ids, n)
    pages = KVPages(
        k=pages.k.at[:, :, touched_freed].set(0, mode="drop"),
        v=pages.v.at[:, :, touched_freed].set(0, mode="drop"),
    )
  meta = dataclasses.replace(meta, ref_count=new_ref, slots=slots, free_list=free_list,
                             num_free=num_free)
  return dataclasses.replace(state, pages=pages, meta=meta)


# ---------------------------------------------------------------------------
# Public transitions.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "max_blocks", "contiguous", "fit"),
                   donate_argnames=("state",))
def allocate(state: PoolState, num: jax.Array, *, config: PoolConfig, max_blocks: int,
             contiguous: str = "prefer",
             fit: str = "first") -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Allocates `num` blocks (ref_count 1 each, owned by the caller).

  Lowest address first. For `num > 1` a contiguous run is preferred: a run of
  `num` consecutive free blocks is taken when one exists
  (`contiguous="prefer"`) — the lowest-addressed one (`fit="first"`) or the
  start of the shortest free run that is long enough (`fit="best"`, which keeps
  long runs whole for later contiguous requests); with `contiguous="require"`
  the call fails with `NO_CONTIGUOUS_RUN` otherwise; with `"never"` the `num`
  lowest free blocks are taken. Searching for a run scans the free list
  (O(num_blocks)); the decode path (`reserve_tokens`) does not use this function.

  Args:
    state: the pool (donated).
    num: `i32[]` blocks wanted, `0 <= num <= max_blocks`.
    config: the pool's static config.
    max_blocks: static width of the result.
    contiguous: `"prefer"`, `"require"` or `"never"`.
    fit: `"first"` or `"best"` (which run, when several are long enough).

  Returns:
    `(state, (ids, status))`: `ids: i32[max_blocks]` ascending, `-1` padded;
    `status: i32[]` a `Status`. On failure the state is unchanged.
  """
  if contiguous not in CONTIGUOUS_MODES:
    raise InvalidArgument(f"contiguous must be one of {CONTIGUOUS_MODES}, got {contiguous!r}")
  if fit not in FIT_MODES:
    raise InvalidArgument(f"fit must be one of {FIT_MODES}, got {fit!r}")
  meta = state.meta
  n = config.num_blocks
  num = jnp.asarray(num, jnp.int32)
  count_ok = (num >= 0) & (num <= max_blocks)
  enough = num <= meta.num_free
  window = n - meta.num_free
  if contiguous == "never":
    has_run = jnp.asarray(True)
    run_pos = window
  else:
    j = jnp.arange(n, dtype=jnp.int32)
    last = jnp.clip(j + num - 1, 0, n - 1)
    is_run = (j >= window) & (j + num - 1 < n) & (
        meta.free_list[last] - meta.free_list[j] == num - 1)
    has_run = jnp.any(is_run) | (num == 0)
    if fit == "first":
      run_pos = jnp.where(jnp.any(is_run), jnp.argmax(is_run), window).astype(jnp.int32)
    else:
      # Runs of consecutive ids in the free-list window: start positions and lengths.
      prev = meta.free_list[jnp.clip(j - 1, 0, n - 1)]
      starts = (j >= window) & ((j == window) | (meta.free_list != prev + 1))
      next_start = jax.lax.cummin(jnp.where(starts, j, n)[::-1])[::-1]  # first start >= j
      end = jnp.concatenate([next_start[1:], jnp.full((1,), n, next_start.dtype)])
      run_len = end - j
      fits = starts & (run_len >= num)
      shortest = jnp.min(jnp.where(fits, run_len, n + 1))
      best = fits & (run_len == shortest)  # the lowest of the shortest runs that fit
      run_pos = jnp.where(jnp.any(fits), jnp.argmax(best), window).astype(jnp.int32)
  status = jnp.where(~count_ok, Status.INVALID_COUNT,
                     jnp.where(~enough, Status.NO_FREE_BLOCK,
                               jnp.where((contiguous == "require") & ~has_run,
                                         Status.NO_CONTIGUOUS_RUN, Status.OK)))
  ok = status == Status.OK
  k = jnp.arange(max_blocks, dtype=jnp.int32)
  used = ok & (k < num)
  ids = jnp.where(used, meta.free_list[jnp.clip(run_pos + k, 0, n - 1)], -1)
  flat = jnp.where(used, ids, n)
  ref_count = meta.ref_count.at[flat].set(1, mode="drop")
  rebuilt, rebuilt_num = rebuild_free_list(ref_count, meta.region)
  free_list = jnp.where(ok, rebuilt, meta.free_list)  # a refused call changes nothing
  num_free = jnp.where(ok, rebuilt_num, meta.num_free)
  meta = dataclasses.replace(meta, ref_count=ref_count,
                             last_use=meta.last_use.at[flat].set(state.step, mode="drop"),
                             free_list=free_list, num_free=num_free)
  return dataclasses.replace(state, meta=meta), (ids, status.astype(jnp.int32))


def table_ref_counts(state: PoolState, *, num_blocks: int) -> jax.Array:
  """`i32[num_blocks]`: references the live segment tables hold on each block (traced)."""
  t = state.table
  m = t.block.shape[1]
  used = t.active[:, None] & (jnp.arange(m)[None, :] < t.num_segments[:, None])
  ids = jnp.where(used, t.block, num_blocks).reshape(-1)
  return jnp.zeros((num_blocks,), jnp.int32).at[ids].add(1, mode="drop")


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def apply_ref_deltas(state: PoolState, block_ids: jax.Array, deltas: jax.Array, *,
                     config: PoolConfig) -> tuple[PoolState, jax.Array]:
  """Applies a batch of reference-count changes (e.g. the prefix cache's), atomically.

  These are the references of holders *outside* the segment tables (a prefix
  cache, a caller of `allocate`); the tables' own references move only through
  the sequence transitions. So an increment is only allowed on a live block
  (ref_count > 0): new blocks come from `allocate`/`reserve_tokens`, never from an
  incref of a free block; and a decrement may not take a block below the number
  of live table segments on it (`BLOCK_IN_USE`): that would free, or leave
  under-counted, a block a live sequence still reads. Blocks whose count reaches
  zero are freed. Entries with `block_ids == -1` are padding. If any entry is
  invalid nothing is applied.

  Each block's summed delta must fit in int32 (the host API checks that with
  int64 arithmetic); a sum that takes `ref_count` beyond int32 is `REF_OVERFLOW`.

  Args:
    state: the pool (donated).
    block_ids: `i32[K]` blocks (repeats allowed; their deltas add up).
    deltas: `i32[K]` changes.
    config: the pool's static config.

  Returns:
    `(state, status)` with `status: i32[K]` (`INVALID_BLOCK`, `REF_UNDERFLOW`,
    `REF_OVERFLOW`, `BLOCK_IN_USE`, `ABORTED` for valid entries of a refused
    batch, else `OK`).
  """
  n = config.num_blocks
  block_ids = jnp.asarray(block_ids, jnp.int32)
  deltas = jnp.asarray(deltas, jnp.int32)
  pad = block_ids == -1
  in_range = (block_ids >= 0) & (block_ids < n)
  safe = jnp.where(in_range, block_ids, n)
  total = jnp.zeros((n,), jnp.int32).at[safe].add(jnp.where(in_range, deltas, 0), mode="drop")
  ref = state.meta.ref_count
  i32_max = jnp.iinfo(jnp.int32).max
  # ref >= 0, so ref + total overflows iff total > 0 and ref > INT32_MAX - total (no wrap).
  overflow_blk = (total > 0) & (ref > i32_max - jnp.maximum(total, 0))
  new_ref = jnp.where(overflow_blk, i32_max, ref + total)
  table_refs = table_ref_counts(state, num_blocks=n)
  cb = jnp.clip(block_ids, 0, n - 1)
  overflow = in_range & overflow_blk[cb]
  underflow = in_range & (new_ref[cb] < 0)
  in_use = in_range & (total[cb] < 0) & (new_ref[cb] < table_refs[cb])
  incref_free = in_range & (deltas > 0) & (ref[cb] == 0)
  status = jnp.where(underflow, Status.REF_UNDERFLOW,
                     jnp.where(in_use, Status.BLOCK_IN_USE, Status.OK))
  status = jnp.where(overflow, Status.REF_OVERFLOW, status)
  status = jnp.where(~in_range | incref_free, Status.INVALID_BLOCK, status)
  status = jnp.where(pad, Status.OK, status)
  all_ok = jnp.all(status == Status.OK)
  status = jnp.where(all_ok | (status != Status.OK) | pad, status, Status.ABORTED)
  applied = jnp.where(all_ok & in_range, safe, n)
  new_state = change_refs(state, applied, jnp.where(in_range, deltas, 0), config=config)
  return new_state, status.astype(jnp.int32)
