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
  """K and V pages, each `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`.

  Heads precede blocks so tensor parallelism splits axis 1.
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

  `sizes[0]` is the number of `free_bits` words; `sizes[l]` the entries of count
  level `l`, each covering 32 of level `l - 1`; `offsets[l]` is where level
  `l >= 1` starts in `free_counts`.
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
  """The free blocks of `free: bool[n]` ascending in the last `num_free` entries of `i32[n]`.

  Entries before are -1; a `num_free` above the mask's count pads with -1, so a
  corrupted state stays visible.
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
    ref_count: `i32[num_blocks]` segment references (tables plus outside holders); 0 = free.
    slots: `u32[num_blocks, ceil(block_size / 32)]` bit i = slot i handed out since last free.
    last_use: `i32[num_blocks]` `PoolState.step` at the last reserve or open touching it.
    region: `i8[num_blocks]` 0 dynamic, 1 base pool.
    free_bits, free_counts, num_free: the free index of the dynamic blocks
      (`free_index_levels`); `free_list=` with `num_free=` sets it from the
      ascending free-list view.
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
    """`i32[num_blocks]`: the free dynamic blocks ascending in the last `num_free` entries."""
    n = self.ref_count.shape[0]
    return free_list_view(free_mask_of(jnp.asarray(self.free_bits), n),
                          jnp.asarray(self.num_free))


@_pytree
class SegmentTable:
  """Per-sequence segment tables: row `i` lists `(block, start, length)`, `num_segments[i]` used.

  Attributes (`i32[max_seqs, max_segments]` unless said): block, start, length;
  num_segments, seq_len (`i32[max_seqs]`); active (`bool[max_seqs]`).
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

  `step: i32[]` is the logical clock, advanced by every call that reserves a token.
  """

  pages: KVPages
  meta: BlockMeta
  table: SegmentTable
  step: jax.Array


def init_pool(config: PoolConfig) -> PoolState:
  """An empty pool: every block free, every row inactive, pages zero.

  One jitted program per config, at module level so `paged_kv.runtime.executables`
  can release it.
  """
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
