"""Device-side state of a block pool: pages, block metadata and segment tables.

Every class here is a frozen dataclass registered as a JAX pytree; transitions
build new instances with `dataclasses.replace` and never mutate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig

# Values of BlockMeta.region.
REGION_DYNAMIC = 0
REGION_BASE = 1


def _pytree(cls):
  return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


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


@_pytree
class BlockMeta:
  """Per-block bookkeeping, plus the free list that makes allocation O(request).

  Attributes:
    ref_count: `i32[num_blocks]` segment references to the block (live tables
      plus holders outside the pool, such as prefix-cache nodes). A block is free
      iff `ref_count == 0`.
    slots: `u32[num_blocks, ceil(block_size / 32)]` bit i set = slot i has been
      handed out since the block was last free. Cleared when the block frees.
    last_use: `i32[num_blocks]` value of `PoolState.step` at the last reserve or
      open that touched the block (for LRU/TTL and metrics).
    region: `i8[num_blocks]` 0 dynamic, 1 base pool (pinned shared prefixes).
    free_list: `i32[num_blocks]` the free dynamic blocks in ascending address
      order, stored in the *last* `num_free` entries (`free_list[num_blocks -
      num_free:]`); allocation takes them from the front of that window, so it
      is lowest-address-first and costs O(blocks taken), not O(num_blocks).
      Entries before the window are stale and never read. The free list is an
      index of `ref_count == 0` (restricted to region 0), rebuilt whenever a
      block frees; the invariant checker verifies the two agree.
    num_free: `i32[]` length of the valid window of `free_list`.
  """

  ref_count: jax.Array
  slots: jax.Array
  last_use: jax.Array
  region: jax.Array
  free_list: jax.Array
  num_free: jax.Array


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
    meta: per-block bookkeeping and the free list.
    table: the segment tables of live sequences.
    step: `i32[]` logical clock, advanced by every `reserve_tokens` call that reserves a token.
  """

  pages: KVPages
  meta: BlockMeta
  table: SegmentTable
  step: jax.Array


def init_pool(config: PoolConfig) -> PoolState:
  """An empty pool: every block free, every sequence row inactive, pages zero."""
  n, bs = config.num_blocks, config.block_size
  shape = (config.num_layers, config.num_kv_heads, n, bs, config.head_dim)
  pages = KVPages(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))
  nb = config.num_base_blocks
  region = jnp.zeros((n,), jnp.int8).at[:nb].set(REGION_BASE)
  # Free dynamic blocks [nb, n) occupy the last n - nb entries, ascending.
  free_list = jnp.arange(n, dtype=jnp.int32)
  meta = BlockMeta(
      ref_count=jnp.zeros((n,), jnp.int32),
      slots=jnp.zeros((n, config.slot_words), jnp.uint32),
      last_use=jnp.zeros((n,), jnp.int32),
      region=region,
      free_list=free_list,
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
