"""Data movement inside the pages: slot-range copies and whole-block moves.

Every transition that moves K/V (`cow_split`, `pack_slots`, `compact_permute`,
`promote_blocks`) goes through one of the two functions here, each with an
`impl` switch:

* `"xla"` (default): gather + scatter on the pages (whole blocks on CPU: a loop
  of block-slab copies, faster than XLA's CPU scatter). Inside a transition
  jitted with the state donated, XLA updates the buffers in place.
* `"pallas"` (and `"mosaic"` for whole blocks): the kernels of
  `pallas_kernels/permute_blocks.py` (`copy_slots`, `permute_blocks`), imported
  lazily so the core does not depend on Pallas. `interpret=True` runs them in
  interpret mode on CPU.

Callers guarantee that destination slots (blocks) are distinct and disjoint from
the source slots (blocks), so the copies are order-independent and race-free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv.core.errors import InvalidArgument
from paged_kv.core.state import KVPages

SLOT_COPY_IMPLS = ("xla", "pallas")
BLOCK_MOVE_IMPLS = ("xla", "pallas", "mosaic")


def _xla_copy_slots(p: jax.Array, src_block, src_start, dst_block, dst_start,
                    length) -> jax.Array:
  num_layers, num_heads, n, bs, d = p.shape
  j = jnp.arange(bs, dtype=jnp.int32)[None, :]
  live = (j < length[:, None]) & (src_block[:, None] >= 0) & (dst_block[:, None] >= 0)
  src = jnp.where(live, src_block[:, None] * bs + src_start[:, None] + j, 0).reshape(-1)
  dst = jnp.where(live, dst_block[:, None] * bs + dst_start[:, None] + j, n * bs).reshape(-1)
  flat = p.reshape(num_layers, num_heads, n * bs, d)
  flat = flat.at[:, :, dst].set(flat[:, :, src], mode="drop")
  return flat.reshape(p.shape)


def copy_slot_ranges(pages: KVPages,
                     src_block: jax.Array,  # i32[E], -1 = padding
                     src_start: jax.Array,  # i32[E]
                     dst_block: jax.Array,  # i32[E], -1 = padding
                     dst_start: jax.Array,  # i32[E]
                     length: jax.Array,  # i32[E], 0 = padding
                     *, impl: str = "xla", interpret: bool = False) -> KVPages:
  """Copies slots `[src_start, src_start + length)` of `src_block` to
  `[dst_start, dst_start + length)` of `dst_block`, for every entry, in K and V,
  across all layers and kv heads.

  Args:
    pages: the pool's pages (`[L, H, num_blocks, block_size, D]` each).
    src_block, src_start, dst_block, dst_start, length: `i32[E]`; an entry with
      `length == 0` or a block of `-1` is padding. Ranges lie inside their
      blocks; destination slots are distinct and disjoint from source slots.
    impl: `"xla"` or `"pallas"` (the `copy_slots` kernel).
    interpret: run the Pallas kernel in interpret mode (CPU).

  Returns:
    The pages with the ranges copied.
  """
  if impl not in SLOT_COPY_IMPLS:
    raise InvalidArgument(f"impl must be one of {SLOT_COPY_IMPLS}, got {impl!r}")
  args = [jnp.asarray(a, jnp.int32) for a in (src_block, src_start, dst_block, dst_start, length)]
  if impl == "xla":
    return KVPages(k=_xla_copy_slots(pages.k, *args), v=_xla_copy_slots(pages.v, *args))
  from pallas_kernels import permute_blocks as kernels  # lazy: optional dependency
  live = (args[0] >= 0) & (args[2] >= 0)
  sb, ss, db, ds = (jnp.where(live, a, 0) for a in args[:4])
  ln = jnp.where(live, args[4], 0)
  copy = lambda p: kernels.copy_slots(p, sb, ss, db, ds, ln, impl="pallas", interpret=interpret)
  return KVPages(k=copy(pages.k), v=copy(pages.v))


def _loop_move_pages(pages: KVPages, src: jax.Array, dst: jax.Array) -> KVPages:
  """Whole-block moves as a loop of block-sized slice copies (the CPU path).

  XLA's CPU scatter copies element by element; a `fori_loop` over the valid moves
  (packed first, dynamic trip count) of one `dynamic_slice` +
  `dynamic_update_slice` per block and per K/V copies `[L, H, 1, bs, D]` slabs
  in place (pages donated) and costs about a third less
  (`benchmarks/bench_compaction.py`). Sources and destinations are disjoint, so
  the sequential order does not matter.
  """
  live = (src >= 0) & (dst >= 0)
  order = jnp.argsort(~live, stable=True)  # valid moves first
  s, d = src[order], dst[order]
  num = jnp.sum(live, dtype=jnp.int32)

  def body(i, kv):
    k, v = kv
    bk = jax.lax.dynamic_slice_in_dim(k, s[i], 1, axis=2)
    bv = jax.lax.dynamic_slice_in_dim(v, s[i], 1, axis=2)
    return (jax.lax.dynamic_update_slice_in_dim(k, bk, d[i], axis=2),
            jax.lax.dynamic_update_slice_in_dim(v, bv, d[i], axis=2))

  k, v = jax.lax.fori_loop(0, num, body, (pages.k, pages.v))
  return KVPages(k=k, v=v)


def move_pages(pages: KVPages,
               src: jax.Array,  # i32[M], -1 = padding
               dst: jax.Array,  # i32[M], -1 = padding
               *, impl: str = "xla", interpret: bool = False) -> KVPages:
  """Copies whole blocks `src[i] -> dst[i]` (all layers, heads) in K and V.

  Sources and destinations are disjoint sets and destinations are distinct.

  Args:
    pages: the pool's pages.
    src, dst: `i32[M]` block ids; a move with either side `-1` is padding.
    impl: `"xla"`, `"pallas"` (grid kernel) or `"mosaic"` (Mosaic GPU kernel),
      the latter two from `pallas_kernels.permute_blocks`.
    interpret: interpret mode for the kernels (CPU).

  Returns:
    The pages with the blocks copied (sources keep their old contents).
  """
  if impl not in BLOCK_MOVE_IMPLS:
    raise InvalidArgument(f"impl must be one of {BLOCK_MOVE_IMPLS}, got {impl!r}")
  src = jnp.asarray(src, jnp.int32)
  dst = jnp.asarray(dst, jnp.int32)
  if impl == "xla":
    if jax.default_backend() == "cpu":
      return _loop_move_pages(pages, src, dst)
    n = pages.k.shape[2]
    live = (src >= 0) & (dst >= 0)
    s = jnp.where(live, src, 0)
    d = jnp.where(live, dst, n)  # out of range -> dropped
    move = lambda p: p.at[:, :, d].set(p[:, :, s], mode="drop", unique_indices=True)
    return KVPages(k=move(pages.k), v=move(pages.v))
  from pallas_kernels import permute_blocks as kernels  # lazy: optional dependency
  live = (src >= 0) & (dst >= 0)
  s, d = jnp.where(live, src, -1), jnp.where(live, dst, -1)
  move = lambda p: kernels.permute_blocks(p, s, d, impl=impl, interpret=interpret)
  return KVPages(k=move(pages.k), v=move(pages.v))
