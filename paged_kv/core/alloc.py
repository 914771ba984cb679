"""Block allocation: the free index, `allocate`, `apply_ref_deltas`, freeing.

The free index (`BlockMeta.free_bits`, `free_counts`, `num_free`) is a bitmap
of the free dynamic blocks with count levels above it (fan-out 32: one count per
32 words, one per 32 of those, ...; four levels at 1M blocks). Two operations,
both O(batch * 32 * levels) and independent of the pool size:

- `lowest_free(meta, ranks)`: the `r`-th lowest free block for each rank, by
  descending the counts (the "select" of a rank/select tree). Taking the `k`
  blocks of ranks `0..k-1` is lowest-address-first allocation, exactly what the
  ascending free list this replaced handed out. When every rank lies in the
  1024 blocks from the lowest free one (the usual decode step), one descent and
  one pick per rank in that window do it (a `lax.cond`).
- `mark_blocks(meta, blocks, delta)`: blocks become free (+1) or taken (-1):
  one scatter-add into the bitmap words and one into the counts.

So `take_blocks` (the decode path), `change_refs` (release, decrefs) and
`apply_ref_deltas` update the index from the blocks that were taken or freed,
never with a pass over the pool. Only a contiguous `allocate` of more than one
block unpacks the bitmap (O(num_blocks)) to search for a run. Why this and not
a free stack: a stack is O(batch) too, but hands out recently freed blocks
first, wherever they lie; the tree keeps allocation lowest-address-first (dense
low addresses, what compaction and shrinking want) at the same order of cost.

Atomicity never costs a whole-array select: a refused call scatters nothing
(every index it would write is pointed out of range and dropped).
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
  """`(reads, arrays)` unchanged, with every gather behind `reads` ordered first.

  XLA updates a donated per-block array in place only if no read of its old
  values is scheduled after the update; when it cannot order a gather first it
  copies the whole array (O(num_blocks)) instead. An optimization barrier on the
  gathered values and the arrays pins the order, so the scatters that follow
  are in place. `tests/core/test_complexity.py` checks the compiled code.
  """
  return jax.lax.optimization_barrier((reads, arrays))


def _pick(values: jax.Array, rank: jax.Array, small: bool = True
          ) -> tuple[jax.Array, jax.Array]:
  """For `values: i32[K, F]` counts and `rank: i32[K]`: the child holding each rank.

  Returns `(child, rank within the child)`; the child is the first whose
  running count exceeds the rank. `small`: every count is below 2**24, so the
  running sum may be an f32 matmul (exact there).
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

  O(size(ranks) * 32 * levels): a descent of the count levels, then the word,
  then the bit. Distinct ranks give distinct blocks, ascending with the rank.
  Fast path (a `lax.cond`): when every rank falls in the 32 words (1024 blocks)
  from the lowest free block's word, one descent (for rank 0) and one pick per
  rank inside that window replace the per-rank descents.
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

  O(size(blocks) * levels). The caller guarantees that the marked blocks are
  distinct dynamic blocks, currently taken (for +1) or free (for -1), so each
  bit flips once: the bitmap update is a scatter-add of the bits.
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
  """Takes the lowest free blocks for every granted request, in batch order.

  Args:
    meta: block metadata.
    need: `i32[B]` blocks per request (`<= max_per_request`).
    granted: `bool[B]` from `grant_prefix`; their total need fits.
    max_per_request: static width of the result.
    step: logical clock written to `last_use`.

  Returns:
    `(meta, ids)` with `ids: i32[B, max_per_request]` ascending block ids per
    request, `-1` where unused. Taken blocks get `ref_count = 1`. O(B *
    max_per_request * levels): no pass over the pool.
  """
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
  """`(free_list, num_free)` in the old ascending layout (`BlockMeta.free_list`). O(num_blocks).

  For callers that set the index through `dataclasses.replace(meta,
  free_list=..., num_free=...)`; new code calls `rebuild_free_index`.
  """
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
  `config.scrub_freed_blocks`, and return to the free index; a block that goes
  from zero to referenced leaves it. Only the touched entries are read or
  written: O(K log K) for K entries (the log from finding repeated ids), never
  O(num_blocks). `may_free=False` (increfs of live blocks) skips the index.
  Out-of-range ids (use `num_blocks` for padding) are dropped. The caller has
  validated that no count goes negative.
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
  """Allocates `num` blocks (ref_count 1 each, owned by the caller).

  Lowest address first. For `num > 1` a contiguous run is preferred: a run of
  `num` consecutive free blocks is taken when one exists
  (`contiguous="prefer"`) — the lowest-addressed one (`fit="first"`) or the
  start of the shortest free run that is long enough (`fit="best"`, which keeps
  long runs whole for later contiguous requests); with `contiguous="require"`
  the call fails with `NO_CONTIGUOUS_RUN` otherwise; with `"never"` the `num`
  lowest free blocks are taken. `"never"` (and any call with `max_blocks <= 1`,
  where every block is a run) costs O(max_blocks * levels), and so does a
  first-fit call whose `num` lowest free blocks are consecutive (they are then
  the lowest run); otherwise the run search unpacks the free bitmap
  (O(num_blocks)). The decode path (`reserve_tokens`)
  does not use this function.

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

  O(K * max_seqs * max_segments) compares for small batches, a sort of the
  tables' blocks (O(T log T), T = max_seqs * max_segments) for large ones;
  never O(num_blocks). Ids outside `[0, num_blocks)` get 0.
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
  """`i32[K]`: for each entry, the sum of `values` over the entries naming its block.

  O(K log K) (a sort); no `num_blocks`-sized array.
  """
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
