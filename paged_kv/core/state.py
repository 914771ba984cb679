"""Device-side state of a block pool: pages, block metadata and segment tables.

Every class here is a frozen dataclass registered as a JAX pytree; transitions
build new instances with `dataclasses.replace` and never mutate.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig

# Values of BlockMeta.region.
REGION_DYNAMIC = 0
REGION_BASE = 1


def _pytree(cls):
  if not dataclasses.is_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
  return jax.tree_util.register_dataclass(cls)


@_pytree
class KVPages:
  """The K and V pages of every layer.

  Attributes:
    k: `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` (config dtype).
    v: same shape and dtype as `k`.

  The head axis precedes the block axis so tensor-parallel sharding splits axis 1
  and one kv head of one block is `block_size * head_dim` contiguous elements.
  """

  k: jax.Array
  v: jax.Array


# ---------------------------------------------------------------------------
# The free index: which dynamic blocks are free, in a form that finds the k-th
# lowest free block in O(log num_blocks) and updates in O(1) per block.
# ---------------------------------------------------------------------------

FREE_FANOUT = 32  # bits per word of `free_bits`; children per entry of `free_counts`


def free_index_levels(num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`(sizes, offsets)` of the free index of a pool of `num_blocks` blocks (static).

  `sizes[0]` is the number of `free_bits` words (`ceil(num_blocks / 32)`);
  `sizes[l]` for `l >= 1` the entries of count level `l`, each covering 32
  entries of level `l - 1` (so `32**(l + 1)` blocks), up to the first level of at
  most 32 entries. `offsets[l]` is where level `l >= 1` starts in `free_counts`
  (`offsets[0]` is unused, 0).
  """
  sizes = [max(1, -(-num_blocks // FREE_FANOUT))]
  while sizes[-1] > FREE_FANOUT:
    sizes.append(-(-sizes[-1] // FREE_FANOUT))
  offsets = [0] + [sum(sizes[1:l]) for l in range(1, len(sizes))]
  return tuple(sizes), tuple(offsets)


def build_free_index(free: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(free_bits, free_counts)` of a `bool[num_blocks]` free mask. O(num_blocks)."""
  n = free.shape[0]
  sizes, _ = free_index_levels(n)
  f = FREE_FANOUT
  padded = jnp.zeros((sizes[0] * f,), bool).at[:n].set(free).reshape(sizes[0], f)
  shifts = jnp.arange(f, dtype=jnp.uint32)
  bits = jnp.sum(padded.astype(jnp.uint32) << shifts, axis=1, dtype=jnp.uint32)
  level = jax.lax.population_count(bits).astype(jnp.int32)
  counts = []
  for size in sizes[1:]:
    level = jnp.zeros((size * f,), jnp.int32).at[:level.shape[0]].set(level)
    level = jnp.sum(level.reshape(size, f), axis=1, dtype=jnp.int32)
    counts.append(level)
  # At least one entry, so the array is never empty (an unused 0 for small pools).
  free_counts = jnp.concatenate(counts) if counts else jnp.zeros((1,), jnp.int32)
  return bits, free_counts


def free_mask_of(free_bits: jax.Array, num_blocks: int) -> jax.Array:
  """`bool[num_blocks]`: the blocks `free_bits` marks free. O(num_blocks)."""
  shifts = jnp.arange(FREE_FANOUT, dtype=jnp.uint32)
  bits = (free_bits[:, None] >> shifts[None, :]) & jnp.uint32(1)
  return bits.reshape(-1)[:num_blocks].astype(bool)


def free_list_view(free: jax.Array, num_free: jax.Array) -> jax.Array:
  """The free blocks of `free: bool[n]`, ascending, in the last `num_free` entries of `i32[n]`.

  The layout `BlockMeta.free_list` had before the free index: entries before the
  window are -1. A `num_free` larger than the mask's count pads the window's end
  with -1 (a corrupted state stays visible to a checker). O(num_blocks).
  """
  n = free.shape[0]
  (idx,) = jnp.nonzero(free, size=n, fill_value=-1)
  j = jnp.arange(n, dtype=jnp.int32)
  first = n - jnp.clip(num_free, 0, n)
  return jnp.where(j >= first, idx[jnp.clip(j - first, 0, n - 1)], -1).astype(jnp.int32)


@_pytree
@dataclasses.dataclass(frozen=True, init=False)
class BlockMeta:
  """Per-block bookkeeping, plus the free index that makes allocation O(request).

  Attributes:
    ref_count: `i32[num_blocks]` segment references to the block (live tables
      plus holders outside the pool, such as prefix-cache nodes). A block is free
      iff `ref_count == 0`.
    slots: `u32[num_blocks, ceil(block_size / 32)]` bit i set = slot i has been
      handed out since the block was last free. Cleared when the block frees.
    last_use: `i32[num_blocks]` value of `PoolState.step` at the last reserve or
      open that touched the block (for LRU/TTL and metrics).
    region: `i8[num_blocks]` 0 dynamic, 1 base pool (pinned shared prefixes).
    free_bits: `u32[ceil(num_blocks / 32)]` bit `b % 32` of word `b // 32` set iff
      block `b` is a free *dynamic* block (an index of `ref_count == 0` restricted
      to region 0; the invariant checker verifies the two agree).
    free_counts: `i32[...]` the count levels above `free_bits`
      (`free_index_levels`): entry `i` of level `l` is the number of free blocks
      among blocks `[i * 32**(l+1), (i+1) * 32**(l+1))`. With them the `k`-th
      lowest free block is found in `O(32 * levels)` and a block is marked free
      or taken in `O(levels)` (`paged_kv.core.alloc`), so no transition that
      takes or frees a few blocks touches the whole pool.
    num_free: `i32[]` free dynamic blocks (the number of bits set).

  `free_list` (a property, O(num_blocks)) is the layout of the older ascending
  free list, kept for readers of it: the free dynamic blocks ascending in the
  last `num_free` entries, `-1` before them. Passing `free_list=` (with
  `num_free=`) to the constructor or to `dataclasses.replace` sets the index from
  such a window (O(num_blocks)). Without `free_list` the fields are stored as
  given (as a pytree unflatten does, whatever the leaves are).
  """

  ref_count: jax.Array
  slots: jax.Array
  last_use: jax.Array
  region: jax.Array
  free_bits: jax.Array
  free_counts: jax.Array
  num_free: jax.Array

  def __init__(self, ref_count, slots, last_use, region, free_bits=None, free_counts=None,
               num_free=None, *, free_list=None):
    if free_list is not None:
      # Compatibility: an old-layout window (the last `num_free` entries).
      n = ref_count.shape[0]
      free_list = jnp.asarray(free_list, jnp.int32)
      num_free = jnp.asarray(num_free, jnp.int32)
      j = jnp.arange(n, dtype=jnp.int32)
      listed = (j >= n - num_free) & (free_list >= 0) & (free_list < n)
      free = jnp.zeros((n,), bool).at[jnp.where(listed, free_list, n)].set(True, mode="drop")
      free_bits, free_counts = build_free_index(free)
    for name, value in (("ref_count", ref_count), ("slots", slots), ("last_use", last_use),
                        ("region", region), ("free_bits", free_bits),
                        ("free_counts", free_counts), ("num_free", num_free)):
      object.__setattr__(self, name, value)

  @property
  def free_list(self) -> jax.Array:
    """`i32[num_blocks]` the old ascending free-list layout (see the class docstring)."""
    n = self.ref_count.shape[0]
    return free_list_view(free_mask_of(jnp.asarray(self.free_bits), n),
                          jnp.asarray(self.num_free))


@_pytree
class SegmentTable:
  """Per-sequence segment tables: each row is a list of `(block, start, length)`.

  Logical token `t` of sequence `i` lives in the segment `s` whose cumulative
  length covers `t`, at slot `start[i, s] + t - sum(length[i, :s])` of block
  `block[i, s]`. A classic page table is the case `start = 0, length = block_size`.

  Attributes:
    block: `i32[max_seqs, max_segments]` physical block of each segment.
    start: `i32[max_seqs, max_segments]` first slot of the segment in its block.
    length: `i32[max_seqs, max_segments]` tokens in the segment (>= 1 when used).
    num_segments: `i32[max_seqs]` used segments; entries beyond are zero.
    seq_len: `i32[max_seqs]` tokens of the sequence (sum of its lengths).
    active: `bool[max_seqs]` whether the row holds a live sequence.
  """

  block: jax.Array
  start: jax.Array
  length: jax.Array
  num_segments: jax.Array
  seq_len: jax.Array
  active: jax.Array


@_pytree
class PoolState:
  """The whole pool: one pytree, donated to and returned by every transition.

  Attributes:
    pages: the K/V data.
    meta: per-block bookkeeping and the free index.
    table: the segment tables of live sequences.
    step: `i32[]` logical clock, advanced by every `reserve_tokens` call that reserves a token.
  """

  pages: KVPages
  meta: BlockMeta
  table: SegmentTable
  step: jax.Array


def init_pool(config: PoolConfig) -> PoolState:
  """An empty pool: every block free, every sequence row inactive, pages zero.

  One jitted program per config (module level, so `paged_kv.runtime.executables`
  can release it with the library's other programs; eager `jnp` calls would leave
  one program per op and shape in JAX's own caches)."""
  return _init_pool(config)


@functools.partial(jax.jit, static_argnames=("config",))
def _init_pool(config: PoolConfig) -> PoolState:
  n, bs = config.num_blocks, config.block_size
  shape = (config.num_layers, config.num_kv_heads, n, bs, config.head_dim)
  pages = KVPages(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))
  nb = config.num_base_blocks
  region = jnp.zeros((n,), jnp.int8).at[:nb].set(REGION_BASE)
  free_bits, free_counts = build_free_index(jnp.arange(n) >= nb)  # dynamic blocks [nb, n)
  meta = BlockMeta(
      ref_count=jnp.zeros((n,), jnp.int32),
      slots=jnp.zeros((n, config.slot_words), jnp.uint32),
      last_use=jnp.zeros((n,), jnp.int32),
      region=region,
      free_bits=free_bits,
      free_counts=free_counts,
      num_free=jnp.asarray(n - nb, jnp.int32),
  )
  s, m = config.max_seqs, config.max_segments
  table = SegmentTable(
      block=jnp.zeros((s, m), jnp.int32),
      start=jnp.zeros((s, m), jnp.int32),
      length=jnp.zeros((s, m), jnp.int32),
      num_segments=jnp.zeros((s,), jnp.int32),
      seq_len=jnp.zeros((s,), jnp.int32),
      active=jnp.zeros((s,), bool),
  )
  return PoolState(pages=pages, meta=meta, table=table, step=jnp.zeros((), jnp.int32))
