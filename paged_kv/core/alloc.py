"""Block allocation: the free index, `allocate`, `apply_ref_deltas`, freeing.

The free index is a bitmap of the free dynamic blocks with count levels above it
(fan-out 32): `lowest_free` and `mark_blocks` cost O(batch * 32 * levels), never
a pass over the pool. Unlike a free stack it hands out the lowest addresses
first, keeping the pool dense for compaction and shrinking.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.core.state import (FREE_FANOUT, REGION_DYNAMIC, BlockMeta, KVPages, PoolState,
                                 build_free_index, free_index_levels, free_list_view,
                                 free_mask_of)

CONTIGUOUS_MODES = ("prefer", "require", "never")
FIT_MODES = ("first", "best")

# ---------------------------------------------------------------------------
# Free-index primitives (traced helpers, used by the transitions).
# ---------------------------------------------------------------------------


def first_occurrence(ids: jax.Array) -> jax.Array:
  """`bool[B]`: True at the first occurrence of each value of `ids` (O(B log B))."""
  order = jnp.argsort(ids, stable=True)
  sorted_ids = ids[order]
  is_first_sorted = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
  return jnp.zeros_like(is_first_sorted).at[order].set(is_first_sorted)


def reads_before_writes(reads, arrays):
  """`(reads, arrays)` unchanged, with every gather behind `reads` ordered first."""
  # XLA updates a donated array in place only if no read of its old values comes after
  # the update, else it copies it whole; tests/core/test_complexity.py checks the HLO.
  return jax.lax.optimization_barrier((reads, arrays))


def _pick(values: jax.Array, rank: jax.Array, small: bool = True
          ) -> tuple[jax.Array, jax.Array]:
  """For counts `values: i32[K, F]` and `rank: i32[K]`: `(child, rank within child)`.

  `small`: every count is below 2**24, so the running sum may be an exact f32 matmul.
  """
  # A running sum over the 32 lanes as one small matmul (exact in f32: counts <= 2**24;
  # XLA's cumsum on CPU is a reduce-window, ~10x slower at these shapes).
  f = values.shape[1]
  if small:
    upper = (jnp.arange(f)[:, None] <= jnp.arange(f)[None, :]).astype(jnp.float32)
    cum = jnp.dot(values.astype(jnp.float32), upper,
                  precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)
  else:
    cum = jnp.cumsum(values, axis=1)
  below = cum <= rank[:, None]  # the lanes wholly before the rank (a prefix of lanes)
  child = jnp.minimum(jnp.sum(below, axis=1, dtype=jnp.int32), f - 1)
  before = jnp.sum(jnp.where(below, values, 0), axis=1, dtype=jnp.int32)
  return child, rank - before


def _descend(meta: BlockMeta, r: jax.Array) -> jax.Array:
  """Blocks of valid ranks `r: i32[K]` by a full descent of the count levels."""
  n = meta.ref_count.shape[0]
  sizes, offsets = free_index_levels(n)
  f = FREE_FANOUT
  small = n < 1 << 24
  lane = jnp.arange(f, dtype=jnp.int32)[None, :]
  node = jnp.zeros_like(r)
  for level in range(len(sizes) - 1, 0, -1):
    idx = node[:, None] * f + lane
    counts = meta.free_counts[offsets[level] + jnp.clip(idx, 0, sizes[level] - 1)]
    child, r = _pick(jnp.where(idx < sizes[level], counts, 0), r, small)
    node = node * f + child
  idx = node[:, None] * f + lane
  words = jnp.where(idx < sizes[0], meta.free_bits[jnp.clip(idx, 0, sizes[0] - 1)], 0)
  child, r = _pick(jax.lax.population_count(words).astype(jnp.int32), r)
  word = node * f + child
  w = meta.free_bits[jnp.clip(word, 0, sizes[0] - 1)]
  bits = ((w[:, None] >> lane.astype(jnp.uint32)) & 1).astype(jnp.int32)
  pos, _ = _pick(bits, r)
  return word * f + pos


def lowest_free(meta: BlockMeta, ranks: jax.Array) -> jax.Array:
  """The `ranks[...]`-th lowest free dynamic block (0 = the lowest), `-1` out of range.

  O(size(ranks) * 32 * levels). When every rank falls in the 1024 blocks from the
  lowest free one, one descent and a pick per rank replace the per-rank descents.
  """
  n = meta.ref_count.shape[0]
  sizes, _ = free_index_levels(n)
  f = FREE_FANOUT
  shape = ranks.shape
  r = jnp.asarray(ranks, jnp.int32).reshape(-1)
  valid = (r >= 0) & (r < meta.num_free)
  r = jnp.where(valid, r, 0)
  num_w = min(sizes[0], f)
  w0 = _descend(meta, jnp.zeros((1,), jnp.int32))[0] // f
  widx = w0 + jnp.arange(num_w, dtype=jnp.int32)
  window = jnp.where(widx < sizes[0], meta.free_bits[jnp.clip(widx, 0, sizes[0] - 1)], 0)
  cum = jnp.cumsum(jax.lax.population_count(window).astype(jnp.int32))
  in_window = jnp.max(jnp.where(valid, r, -1)) < cum[-1]

  def fast(r):
    child = jnp.minimum(jnp.sum(cum[None, :] <= r[:, None], axis=1, dtype=jnp.int32),
                        num_w - 1)
    r = r - jnp.where(child > 0, cum[jnp.maximum(child - 1, 0)], 0)
    lane = jnp.arange(f, dtype=jnp.int32)[None, :]
    bits = ((window[child][:, None] >> lane.astype(jnp.uint32)) & 1).astype(jnp.int32)
    pos, _ = _pick(bits, r)
    return (w0 + child) * f + pos

  block = jax.lax.cond(in_window, fast, functools.partial(_descend, meta), r)
  return jnp.where(valid, block, -1).reshape(shape)


def mark_blocks(meta: BlockMeta, blocks: jax.Array, delta: jax.Array) -> BlockMeta:
  """Marks blocks free (`delta = +1`) or taken (`-1`) in the free index; `0` skips.

  The blocks must be distinct dynamic blocks currently in the opposite state.
  """
  n = meta.ref_count.shape[0]
  sizes, offsets = free_index_levels(n)
  f = FREE_FANOUT
  b = jnp.asarray(blocks, jnp.int32).reshape(-1)
  d = jnp.asarray(delta, jnp.int32).reshape(-1)
  go = (d != 0) & (b >= 0) & (b < n)
  d = jnp.where(go, d, 0)
  bit = jnp.uint32(1) << (jnp.clip(b, 0, n - 1) % f).astype(jnp.uint32)
  free_bits = meta.free_bits.at[jnp.where(go, b // f, sizes[0])].add(
      jnp.where(d > 0, bit, jnp.uint32(0) - bit), mode="drop")
  free_counts = meta.free_counts
  if len(sizes) > 1:
    idx = jnp.stack([jnp.where(go, offsets[level] + b // f ** (level + 1),
                               free_counts.shape[0]) for level in range(1, len(sizes))], axis=1)
    free_counts = free_counts.at[idx].add(jnp.broadcast_to(d[:, None], idx.shape), mode="drop")
  return dataclasses.replace(meta, free_bits=free_bits, free_counts=free_counts,
                             num_free=meta.num_free + jnp.sum(d, dtype=jnp.int32))


def grant_prefix(need: jax.Array, ok: jax.Array, num_free: jax.Array, *,
                 atomic: bool) -> jax.Array:
  """`bool[B]`: the requests that get their `need` blocks, first come first served.

  A request needing no block is always granted; otherwise it is granted iff it and
  every earlier valid request fit in `num_free` together, so a large early request
  that does not fit also stops later ones. `atomic`: all valid requests or none.
  """
  need = jnp.where(ok, need, 0)
  granted = ok & ((need == 0) | (jnp.cumsum(need) <= num_free))
  if atomic:
    granted = granted & jnp.all(granted == ok)
  return granted


def take_blocks(meta: BlockMeta, need: jax.Array, granted: jax.Array, *, max_per_request: int,
                step: jax.Array) -> tuple[BlockMeta, jax.Array]:
  """The lowest free blocks of each granted request: `(meta, ids i32[B, max_per_request])`."""
  n = meta.ref_count.shape[0]
  eff = jnp.where(granted, need, 0)
  offset = jnp.cumsum(eff) - eff
  j = jnp.arange(max_per_request, dtype=jnp.int32)
  used = j[None, :] < eff[:, None]
  ids = jnp.where(used, lowest_free(meta, jnp.where(used, offset[:, None] + j[None, :], -1)), -1)
  flat = jnp.where(used, ids, n).reshape(-1)  # n = out of range -> dropped
  meta = mark_blocks(meta, ids, jnp.where(used, -1, 0))
  meta = dataclasses.replace(
      meta,
      ref_count=meta.ref_count.at[flat].set(1, mode="drop"),
      last_use=meta.last_use.at[flat].set(step, mode="drop"),
  )
  return meta, ids


def rebuild_free_index(ref_count: jax.Array, region: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(free_bits, free_counts, num_free)` from scratch. O(num_blocks)."""
  free = (ref_count == 0) & (region == REGION_DYNAMIC)
  free_bits, free_counts = build_free_index(free)
  return free_bits, free_counts, jnp.sum(free, dtype=jnp.int32)


def rebuild_free_list(ref_count: jax.Array, region: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(free_list, num_free)` in the ascending layout of `BlockMeta.free_list`. O(num_blocks)."""
  n = ref_count.shape[0]
  is_free = (ref_count == 0) & (region == REGION_DYNAMIC)
  num_free = jnp.sum(is_free, dtype=jnp.int32)
  (idx,) = jnp.nonzero(is_free, size=n, fill_value=0)
  free_list = jnp.take(idx, (jnp.arange(n, dtype=jnp.int32) - (n - num_free)) % n)
  return free_list.astype(jnp.int32), num_free


def change_refs(state: PoolState, block_ids: jax.Array, deltas: jax.Array, *,
                config: PoolConfig, may_free: bool = True) -> PoolState:
  """Adds `deltas` to `ref_count[block_ids]`; blocks reaching zero are freed (and scrubbed).

  O(K log K), never O(num_blocks); out-of-range ids drop. `may_free=False`
  (increfs of live blocks) skips the free index.
  """
  meta = state.meta
  n = meta.ref_count.shape[0]
  flat = jnp.asarray(block_ids, jnp.int32).reshape(-1)
  d = jnp.asarray(deltas, jnp.int32).reshape(-1)
  in_range = (flat >= 0) & (flat < n)
  safe = jnp.where(in_range, flat, n)
  if not may_free:
    new_ref = meta.ref_count.at[safe].add(d, mode="drop")
    return dataclasses.replace(state, meta=dataclasses.replace(meta, ref_count=new_ref))
  cb = jnp.clip(flat, 0, n - 1)
  once = in_range & first_occurrence(safe)
  # Per-entry counts from the old ones plus the batch's sums: the updated array is
  # never read back, so XLA updates it in place (no copy of ref_count).
  old = meta.ref_count[cb]
  new = old + block_totals(safe, jnp.where(in_range, d, 0))
  dynamic = meta.region[cb] == REGION_DYNAMIC
  (old, new, dynamic, flat, safe, d, once), meta = reads_before_writes(
      (old, new, dynamic, flat, safe, d, once), meta)
  new_ref = meta.ref_count.at[safe].add(d, mode="drop")
  freed = once & (old > 0) & (new == 0)
  taken = once & (old == 0) & (new > 0)
  freed_ids = jnp.where(freed, flat, n)
  meta = dataclasses.replace(
      meta, ref_count=new_ref,
      slots=meta.slots.at[freed_ids].set(jnp.zeros((), meta.slots.dtype), mode="drop"))
  meta = mark_blocks(meta, flat, jnp.where(dynamic & freed, 1, jnp.where(dynamic & taken, -1, 0)))
  pages = state.pages
  if config.scrub_freed_blocks:
    pages = KVPages(
        k=pages.k.at[:, :, freed_ids].set(0, mode="drop"),
        v=pages.v.at[:, :, freed_ids].set(0, mode="drop"),
    )
  return dataclasses.replace(state, pages=pages, meta=meta)


# ---------------------------------------------------------------------------
# Public transitions.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "max_blocks", "contiguous", "fit"),
                   donate_argnames=("state",))
def allocate(state: PoolState, num: jax.Array, *, config: PoolConfig, max_blocks: int,
             contiguous: str = "prefer",
             fit: str = "first") -> tuple[PoolState, tuple[jax.Array, jax.Array]]:
  """Allocates `num` blocks (ref_count 1 each, owned by the caller), lowest address first.

  For `num > 1`, `contiguous="prefer"` takes a run of consecutive free blocks when
  one exists (the lowest with `fit="first"`, the shortest that fits with
  `fit="best"`), `"require"` fails with `NO_CONTIGUOUS_RUN` without one, `"never"`
  takes the `num` lowest. A run search that cannot take the lowest blocks costs
  O(num_blocks). Returns `(state, (ids: i32[max_blocks] ascending, -1 padded,
  status: i32[]))`; on failure the state is unchanged.
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
  k = jnp.arange(max_blocks, dtype=jnp.int32)
  ids = lowest_free(meta, k)  # the max_blocks lowest free blocks
  has_run = jnp.asarray(True)
  if contiguous != "never" and max_blocks > 1:
    free_bits = meta.free_bits

    def search(_):
      free = free_mask_of(free_bits, n)
      j = jnp.arange(n, dtype=jnp.int32)
      if fit == "first":
        # Run length ending at j; the first j where it reaches num ends the lowest run.
        last_break = jax.lax.cummax(jnp.where(free, -1, j))
        reach = free & (j - last_break >= num)
        return jnp.any(reach), jnp.argmax(reach).astype(jnp.int32) - num + 1
      starts = free & jnp.concatenate([jnp.ones((1,), bool), ~free[:-1]])
      next_break = jax.lax.cummin(jnp.where(free, n, j)[::-1])[::-1]  # first taken >= j
      run_len = next_break - j
      fits = starts & (run_len >= num)
      shortest = jnp.min(jnp.where(fits, run_len, n + 1))
      best = fits & (run_len == shortest)  # the lowest of the shortest runs that fit
      return jnp.any(fits), jnp.argmax(best).astype(jnp.int32)

    # First fit: when the `num` lowest free blocks are consecutive they are the
    # lowest run, found without unpacking the bitmap (the common case in a pool
    # kept dense); only a fragmented low end pays the O(num_blocks) search.
    last = ids[jnp.clip(num - 1, 0, max_blocks - 1)]
    lowest_is_run = (num <= 1) | (enough & (last - ids[0] == num - 1))
    if fit == "first":
      found, run_start = jax.lax.cond(lowest_is_run, lambda _: (jnp.asarray(True), ids[0]),
                                      search, None)
    else:
      found, run_start = search(None)
    has_run = found | (num <= 1)
    ids = jnp.where(found & (num > 1), run_start + k, ids)
  status = jnp.where(~count_ok, Status.INVALID_COUNT,
                     jnp.where(~enough, Status.NO_FREE_BLOCK,
                               jnp.where((contiguous == "require") & ~has_run,
                                         Status.NO_CONTIGUOUS_RUN, Status.OK)))
  ok = status == Status.OK
  used = ok & (k < num)
  ids = jnp.where(used, ids, -1)
  flat = jnp.where(used, ids, n)  # a refused call scatters nothing
  meta = mark_blocks(meta, ids, jnp.where(used, -1, 0))
  meta = dataclasses.replace(meta, ref_count=meta.ref_count.at[flat].set(1, mode="drop"),
                             last_use=meta.last_use.at[flat].set(state.step, mode="drop"))
  return dataclasses.replace(state, meta=meta), (ids, status.astype(jnp.int32))


def table_ref_counts(state: PoolState, *, num_blocks: int) -> jax.Array:
  """`i32[num_blocks]`: references the live segment tables hold on each block (traced)."""
  t = state.table
  m = t.block.shape[1]
  used = t.active[:, None] & (jnp.arange(m)[None, :] < t.num_segments[:, None])
  ids = jnp.where(used, t.block, num_blocks).reshape(-1)
  return jnp.zeros((num_blocks,), jnp.int32).at[ids].add(1, mode="drop")


def table_refs_at(state: PoolState, block_ids: jax.Array) -> jax.Array:
  """`i32[K]`: references the live segment tables hold on each of `block_ids` (traced).

  Never O(num_blocks); ids outside `[0, num_blocks)` get 0.
  """
  t = state.table
  s, m = t.block.shape
  used = t.active[:, None] & (jnp.arange(m)[None, :] < t.num_segments[:, None])
  blocks = jnp.where(used, t.block, -1).reshape(-1)
  ids = jnp.where(block_ids >= 0, block_ids, -2)
  if block_ids.shape[0] * s * m <= 1 << 20:
    return jnp.sum(blocks[None, :] == ids[:, None], axis=1, dtype=jnp.int32)
  ordered = jnp.sort(blocks)
  return (jnp.searchsorted(ordered, ids, side="right")
          - jnp.searchsorted(ordered, ids, side="left")).astype(jnp.int32)


def block_totals(block_ids: jax.Array, values: jax.Array) -> jax.Array:
  """`i32[K]`: for each entry, the sum of `values` over the entries naming its block."""
  k = block_ids.shape[0]
  order = jnp.argsort(block_ids, stable=True)
  ids = block_ids[order]
  group = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                      (ids[1:] != ids[:-1]).astype(jnp.int32)]))
  sums = jax.ops.segment_sum(values[order], group, num_segments=k)
  return jnp.zeros((k,), values.dtype).at[order].set(sums[group])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def apply_ref_deltas(state: PoolState, block_ids: jax.Array, deltas: jax.Array, *,
                     config: PoolConfig) -> tuple[PoolState, jax.Array]:
  """Applies reference-count changes of holders outside the segment tables, atomically.

  An increment needs a live block; a decrement may not go below the live tables'
  segments on it (`BLOCK_IN_USE`); `-1` ids are padding; repeats add up. Returns
  `(state, status: i32[K])` (`INVALID_BLOCK`, `REF_UNDERFLOW`, `REF_OVERFLOW`,
  `BLOCK_IN_USE`, `ABORTED` for valid entries of a refused batch, or `OK`).
  """
  n = config.num_blocks
  block_ids = jnp.asarray(block_ids, jnp.int32)
  deltas = jnp.asarray(deltas, jnp.int32)
  pad = block_ids == -1
  in_range = (block_ids >= 0) & (block_ids < n)
  safe = jnp.where(in_range, block_ids, n)
  cb = jnp.clip(block_ids, 0, n - 1)
  # Every quantity per entry (its block's summed delta, count, table references):
  # O(K log K), no num_blocks-sized array.
  total = block_totals(safe, jnp.where(in_range, deltas, 0))
  ref = state.meta.ref_count[cb]
  i32_max = jnp.iinfo(jnp.int32).max
  # ref >= 0, so ref + total overflows iff total > 0 and ref > INT32_MAX - total (no wrap).
  overflow = in_range & (total > 0) & (ref > i32_max - jnp.maximum(total, 0))
  new_ref = jnp.where(overflow, i32_max, ref + total)
  table_refs = table_refs_at(state, jnp.where(in_range, block_ids, -1))
  underflow = in_range & (new_ref < 0)
  in_use = in_range & (total < 0) & (new_ref < table_refs)
  incref_free = in_range & (deltas > 0) & (ref == 0)
  status = jnp.where(underflow, Status.REF_UNDERFLOW,
                     jnp.where(in_use, Status.BLOCK_IN_USE, Status.OK))
  status = jnp.where(overflow, Status.REF_OVERFLOW, status)
  status = jnp.where(~in_range | incref_free, Status.INVALID_BLOCK, status)
  status = jnp.where(pad, Status.OK, status)
  all_ok = jnp.all(status == Status.OK)
  status = jnp.where(all_ok | (status != Status.OK) | pad, status, Status.ABORTED)
  applied = jnp.where(all_ok & in_range, safe, n)  # a refused batch scatters nothing
  (applied, status), state = reads_before_writes((applied, status), state)
  new_state = change_refs(state, applied, jnp.where(in_range, deltas, 0), config=config)
  return new_state, status.astype(jnp.int32)
