"""Data movement inside the pages: slot-range copies and whole-block moves.

Every transition that moves K/V goes through one of these two functions. `impl`
picks `"xla"` (gather + scatter; a loop of block-slab copies on CPU) or the
kernels of `pallas_kernels/permute_blocks.py` (`"pallas"`, `"mosaic"`), imported
lazily so the core does not depend on Pallas. Callers guarantee destinations are
distinct and disjoint from sources, so copies are order-independent.
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
  """Copies slots `[src_start, +length)` of `src_block` to `[dst_start, +length)` of `dst_block`.

  All layers and heads, K and V. Every argument but `pages` is `i32[E]`; an entry
  of length 0 or block `-1` is padding. `impl`: `"xla"` or `"pallas"`.
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
  """Whole-block moves as a `fori_loop` of block-slab copies over the valid moves (the CPU path).

  XLA's CPU scatter copies element by element; slab copies in place cost about a
  third less (`benchmarks/bench_compaction.py`).
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
  """Copies whole blocks `src[i] -> dst[i]` (all layers and heads, K and V); sources unchanged.

  `-1` on either side is padding. `impl`: `"xla"`, `"pallas"` (grid kernel) or
  `"mosaic"` (Mosaic GPU kernel).
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
