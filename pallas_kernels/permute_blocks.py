"""In-place block moves (compaction) and slot-range copies (COW, slot packing).

Both work in place on a donated pool `[num_layers, num_kv_heads, num_blocks,
block_size, head_dim]`, all layers and heads. `permute_blocks` copies whole blocks
`src[i] -> dst[i]` (-1: padding); sources and destinations are disjoint and
destinations distinct, so copies are independent (`dynamic_validate_moves`).
`copy_slots` copies slot ranges between blocks (length 0: padding); destination
slots are distinct and disjoint from sources (`dynamic_validate_slot_copies`).

Implementations (`impl=`): "xla" (gather + scatter, the CPU default), "pallas"
(grid (move, layer), aliased through `input_output_aliases`) and, for
`permute_blocks` only, "mosaic" (TMA through an SMEM ring, `mosaic_permute_config`).
On a GPU target the wrapper refuses a shape an impl cannot build for.
`ref_permute_blocks` / `ref_copy_slots` apply the moves one by one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Constants ------------------------------------------------------------------

_PERMUTE_IMPLS = ("xla", "pallas", "mosaic")
_COPY_IMPLS = ("xla", "pallas")
# Mosaic GPU permutation: moves per program (TMA boxes hold <= 256 per dimension;
# a multiple of 4 keeps the i32 table rows 16-byte aligned), bytes per ring slot,
# bytes of the whole ring (Hopper: 227 KiB of shared memory per block), and the
# deepest ring.
_MOSAIC_MOVES_PER_PROGRAM = 32
_MOSAIC_SLOT_BYTES = 16 << 10
_MOSAIC_RING_BYTES = 128 << 10
_MOSAIC_MAX_RING = 8
# Preference order on a GPU; not yet timed on one (see tools/gpu_check.py).
GPU_PERMUTE_PREFERENCE = ("xla", "mosaic", "pallas")


# References -------------------------------------------------------------------


def ref_permute_blocks(
    pages: jax.Array,  # [L, KVH, num_blocks, bs, D]
    src: jax.Array,  # i32[M], -1 = padding
    dst: jax.Array,  # i32[M], -1 = padding
) -> jax.Array:
  """Applies the moves one at a time (reads the *original* source blocks)."""
  out = pages
  for i in range(src.shape[0]):
    s, d = int(src[i]), int(dst[i])
    if s >= 0 and d >= 0:
      out = out.at[:, :, d].set(pages[:, :, s])
  return out


def ref_copy_slots(
    pages: jax.Array,  # [L, KVH, num_blocks, bs, D]
    src_block: jax.Array,  # i32[E]
    src_start: jax.Array,  # i32[E]
    dst_block: jax.Array,  # i32[E]
    dst_start: jax.Array,  # i32[E]
    length: jax.Array,  # i32[E], 0 = padding
) -> jax.Array:
  """Copies the slot ranges one entry at a time from the original pages."""
  out = pages
  for e in range(length.shape[0]):
    n = int(length[e])
    if n > 0:
      sb, ss, db, ds = (int(a[e]) for a in (src_block, src_start, dst_block,
                                            dst_start))
      out = out.at[:, :, db, ds:ds + n].set(pages[:, :, sb, ss:ss + n])
  return out


# Validators --------------------------------------------------------------------


def static_validate_pages(pages, *index_arrays, names, impl, impls):
  if pages.ndim != 5:
    raise ValueError("pages must be [num_layers, num_kv_heads, num_blocks, "
                     f"block_size, head_dim], got {pages.shape}")
  n = index_arrays[0].shape
  for name, a in zip(names, index_arrays):
    if a.ndim != 1 or a.shape != n or a.dtype != jnp.int32:
      raise ValueError(f"{name} must be a 1-D int32 array shaped like "
                       f"{names[0]} {list(n)}, got {a.dtype}{list(a.shape)}")
  if impl not in impls:
    raise ValueError(f"impl must be one of {impls}, got {impl!r}")


def dynamic_validate_moves(src, dst, *, num_blocks: int):
  """Host check: indices in range or -1, destinations distinct, and the set of
  (non-padding) sources disjoint from the set of destinations."""
  src, dst = np.asarray(src), np.asarray(dst)
  live = (src >= 0) & (dst >= 0)
  for name, a in (("src", src), ("dst", dst)):
    if np.any((a < -1) | (a >= num_blocks)):
      raise ValueError(f"{name} entries must be -1 or in [0, {num_blocks}): {a}")
  s, d = src[live], dst[live]
  if len(np.unique(d)) != len(d):
    raise ValueError(f"destination blocks are not distinct: {d}")
  both = np.intersect1d(s, d)
  if both.size:
    raise ValueError(f"blocks {both} are both a source and a destination; the "
                     "in-place permutation needs disjoint sets")


def dynamic_validate_slot_copies(src_block, src_start, dst_block, dst_start,
                                 length, *, num_blocks: int, block_size: int):
  """Host check: ranges inside their blocks, destination slots distinct and
  disjoint from source slots."""
  sb, ss, db, ds, ln = (np.asarray(a) for a in (src_block, src_start, dst_block,
                                                dst_start, length))
  live = ln > 0
  if np.any(ln < 0):
    raise ValueError(f"length must be >= 0: {ln}")
  for name, blk, st in (("src", sb, ss), ("dst", db, ds)):
    bad = live & ((blk < 0) | (blk >= num_blocks) | (st < 0) |
                  (st + ln > block_size))
    if np.any(bad):
      e = int(np.argmax(bad))
      raise ValueError(f"{name} range of entry {e} is outside its block: block="
                       f"{blk[e]} start={st[e]} length={ln[e]}")
  slots = lambda blk, st: {(int(blk[e]), int(st[e]) + j)
                           for e in np.flatnonzero(live) for j in range(ln[e])}
  dst_slots = slots(db, ds)
  if len(dst_slots) != int(ln[live].sum()):
    raise ValueError("two copies write the same destination slot")
  if dst_slots & slots(sb, ss):
    raise ValueError("a destination slot is also a source slot")


# XLA paths ---------------------------------------------------------------------


def _xla_permute_blocks(pages, src, dst):
  num_blocks = pages.shape[2]
  live = (src >= 0) & (dst >= 0)
  safe_src = jnp.where(live, src, 0)
  safe_dst = jnp.where(live, dst, num_blocks)  # out of bounds -> dropped
  return pages.at[:, :, safe_dst].set(pages[:, :, safe_src], mode="drop",
                                      unique_indices=True)


def _xla_copy_slots(pages, src_block, src_start, dst_block, dst_start, length):
  num_layers, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  j = jnp.arange(block_size)[None, :]
  live = j < length[:, None]  # [E, bs]
  src = jnp.where(live, src_block[:, None] * block_size + src_start[:, None] + j, 0)
  dst = jnp.where(live, dst_block[:, None] * block_size + dst_start[:, None] + j,
                  num_blocks * block_size)
  flat = pages.reshape(num_layers, num_kv_heads, num_blocks * block_size, head_dim)
  flat = flat.at[:, :, dst.reshape(-1)].set(flat[:, :, src.reshape(-1)],
                                             mode="drop")
  return flat.reshape(pages.shape)


# Generic Pallas kernels -------------------------------------------------------


def permute_blocks_kernel(src_ref, dst_ref, pages_ref, out_ref):
  """Program (move i, layer l): out[l, :, dst[i]] = pages[l, :, src[i]].

  `out_ref` aliases `pages_ref`; sources and destinations are disjoint, so no
  program reads a block another program writes.
  """
  i, layer = pl.program_id(0), pl.program_id(1)
  s, d = src_ref[i], dst_ref[i]

  @pl.when((s >= 0) & (d >= 0))
  def _():
    out_ref[layer, :, d] = pages_ref[layer, :, s]


def copy_slots_kernel(src_block_ref, src_start_ref, dst_block_ref, dst_start_ref,
                      length_ref, pages_ref, out_ref):
  """Program (entry e, layer l): copies `length[e]` slots one at a time, so two
  entries that fill different slot ranges of one block never overwrite each
  other (no read-modify-write of whole blocks)."""
  e, layer = pl.program_id(0), pl.program_id(1)
  sb, ss = src_block_ref[e], src_start_ref[e]
  db, ds = dst_block_ref[e], dst_start_ref[e]

  def body(j, carry):
    out_ref[layer, :, db, ds + j] = pages_ref[layer, :, sb, ss + j]
    return carry

  jax.lax.fori_loop(0, length_ref[e], body, 0)


def _pallas_permute_blocks(pages, src, dst, *, interpret):
  num_layers = pages.shape[0]
  smem_like = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      permute_blocks_kernel,
      grid=(src.shape[0], num_layers),
      in_specs=[smem_like(src), smem_like(dst), any_spec],
      out_specs=any_spec,
      out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
      input_output_aliases={2: 0},
      interpret=interpret,
      name="permute_blocks",
  )(src, dst, pages)


def _pallas_copy_slots(pages, src_block, src_start, dst_block, dst_start, length,
                       *, interpret):
  num_layers = pages.shape[0]
  vec = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      copy_slots_kernel,
      grid=(length.shape[0], num_layers),
      in_specs=[vec(src_block), vec(src_start), vec(dst_block), vec(dst_start),
                vec(length), any_spec],
      out_specs=any_spec,
      out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
      input_output_aliases={5: 0},
      interpret=interpret,
      name="copy_slots",
  )(src_block, src_start, dst_block, dst_start, jnp.maximum(length, 0), pages)


# Mosaic GPU kernel ------------------------------------------------------------


def mosaic_permute_config(*, num_kv_heads: int, block_size: int, head_dim: int,
                          dtype) -> tuple[int, int]:
  """(heads per program, ring slots): as many kv heads as fit `_MOSAIC_SLOT_BYTES`
  (a divisor of `num_kv_heads`, at least one) and 2..`_MOSAIC_MAX_RING` slots within
  `_MOSAIC_RING_BYTES`, so the ring fits shared memory for any head count."""
  head_bytes = block_size * head_dim * jnp.dtype(dtype).itemsize
  heads = max([h for h in range(1, num_kv_heads + 1)
               if num_kv_heads % h == 0 and h * head_bytes <= _MOSAIC_SLOT_BYTES]
              or [1])
  slots = max(2, min(_MOSAIC_MAX_RING, _MOSAIC_RING_BYTES // (heads * head_bytes)))
  return heads, slots


def mosaic_permute_blocks_kernel(table_gmem, pages_gmem, table_smem, ring_smem,
                                 table_barrier, ring_barriers):
  """Program (move chunk c, layer l, head chunk h): copies
  `pages[l, heads of h, src[i]] -> pages[l, heads of h, dst[i]]` for the live
  moves i of chunk c.

  table_gmem i32[num_chunks, 3, M]: rows src, dst and `[count, 0, ...]`, live moves
  first. R-1 loads and up to two stores are in flight: a slot is reloaded once the
  store of the move before has finished reading it.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  # NOTE: `pl.program_id` is always 0 in the Mosaic GPU interpreter (JAX 0.12);
  # named grid axes read with `lax.axis_index` are what it simulates.
  chunk = jax.lax.axis_index("chunk")
  layer = jax.lax.axis_index("layer")
  head_chunk = jax.lax.axis_index("heads")
  num_slots, heads_per_chunk = ring_smem.shape[0], ring_smem.shape[1]
  moves_per_chunk = table_smem.shape[1]
  heads = pl.ds(head_chunk * heads_per_chunk, heads_per_chunk)

  plgpu.copy_gmem_to_smem(table_gmem.at[chunk], table_smem, table_barrier)
  plgpu.barrier_wait(table_barrier)
  count = jnp.clip(table_smem[2, 0], 0, moves_per_chunk)

  def load(i, slot):
    plgpu.copy_gmem_to_smem(pages_gmem.at[layer, heads, table_smem[0, i]],
                            ring_smem.at[slot], ring_barriers.at[slot])

  for i in range(num_slots - 1):  # prologue
    @pl.when(i < count)
    def _():
      load(i, i)

  def body(i, carry):
    slot = jax.lax.rem(i, num_slots)
    plgpu.barrier_wait(ring_barriers.at[slot])
    plgpu.copy_smem_to_gmem(ring_smem.at[slot],
                            pages_gmem.at[layer, heads, table_smem[1, i]])
    nxt = i + num_slots - 1

    @pl.when(nxt < count)
    def _():
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      load(nxt, jax.lax.rem(nxt, num_slots))

    return carry

  jax.lax.fori_loop(0, count, body, 0)
  plgpu.wait_smem_to_gmem(0)


def _mosaic_permute_blocks(pages, src, dst, *, interpret):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  num_layers, num_kv_heads, _, block_size, head_dim = pages.shape
  heads, slots = mosaic_permute_config(num_kv_heads=num_kv_heads,
                                       block_size=block_size, head_dim=head_dim,
                                       dtype=pages.dtype)
  num_moves = src.shape[0]
  per_chunk = _MOSAIC_MOVES_PER_PROGRAM
  num_chunks = max(1, pl.cdiv(num_moves, per_chunk))
  live = (src >= 0) & (dst >= 0)
  order = jnp.argsort(~live, stable=True)  # live moves first
  pad = lambda a: jnp.pad(a[order], (0, num_chunks * per_chunk - num_moves),
                          constant_values=-1).reshape(num_chunks, per_chunk)
  num_live = jnp.sum(live.astype(jnp.int32))
  count = jnp.clip(num_live - jnp.arange(num_chunks) * per_chunk, 0, per_chunk)
  count = jnp.zeros((num_chunks, per_chunk), jnp.int32).at[:, 0].set(count)
  table = jnp.stack([pad(src), pad(dst), count], axis=1)  # [chunks, 3, M]
  if interpret is True:
    from pallas_kernels import lowering
    interpret = lowering.gpu_interpret_params()
  # In place: the pages travel as a mutable Ref that the kernel updates through
  # TMA stores (`plgpu.kernel` has no `input_output_aliases`).
  pages_ref = jax.new_ref(pages)
  plgpu.kernel(
      mosaic_permute_blocks_kernel,
      out_type=(),
      grid=(num_chunks, num_layers, num_kv_heads // heads),
      grid_names=("chunk", "layer", "heads"),
      scratch_types=[
          plgpu.SMEM((3, per_chunk), jnp.int32),
          plgpu.SMEM((slots, heads, block_size, head_dim), pages.dtype),
          plgpu.Barrier(num_arrivals=1),
          plgpu.Barrier(num_arrivals=1, num_barriers=slots),
      ],
      interpret=interpret or None,
  )(table, pages_ref)
  return jax.freeze(pages_ref)


def permute_impl_problem(impl: str, *, num_layers: int, num_kv_heads: int,
                         block_size: int, head_dim: int, dtype, num_moves: int,
                         platform: str | None = None) -> str | None:
  """Why `permute_blocks(impl=impl)` cannot be built for this pool and move count
  on `platform` (default: the trace's target), or None."""
  from pallas_kernels import lowering

  platform = platform or lowering.target_platform()
  if impl not in _PERMUTE_IMPLS:
    return f"impl must be one of {_PERMUTE_IMPLS}, got {impl!r}"
  if platform not in ("cuda", "rocm") or impl in ("xla", "pallas"):
    return None
  if impl == "mosaic" and platform != "cuda":
    return "impl='mosaic' needs an NVIDIA (cuda) GPU"
  for name, n in (("block_size", block_size), ("head_dim", head_dim)):
    if n > 256:
      return f"impl='mosaic': TMA boxes hold <= 256 per dimension, {name}={n}"
  if head_dim * jnp.dtype(dtype).itemsize % 16:
    return (f"impl='mosaic': TMA rows must be 16-byte multiples, head_dim "
            f"{head_dim} x {jnp.dtype(dtype).itemsize} bytes")
  del num_layers, num_moves  # any number: grid over (move chunk, layer, heads)
  return None


def lowerable_permute_impls(*, num_layers: int, num_kv_heads: int,
                            block_size: int, head_dim: int, dtype, num_moves: int,
                            platform: str | None = None) -> tuple[str, ...]:
  """The permutation impls that build here, in `GPU_PERMUTE_PREFERENCE` order on
  a GPU, "xla" first elsewhere; "xla" is always in it."""
  from pallas_kernels import lowering

  return lowering.lowerable_impls(
      GPU_PERMUTE_PREFERENCE, permute_impl_problem, platform=platform,
      num_layers=num_layers, num_kv_heads=num_kv_heads, block_size=block_size,
      head_dim=head_dim, dtype=dtype, num_moves=num_moves)


# Public wrappers -----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "interpret"),
                   donate_argnames=("pages",))
def permute_blocks(
    pages: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    src: jax.Array,  # i32[num_moves], -1 = padding
    dst: jax.Array,  # i32[num_moves], -1 = padding
    *,
    impl: str = "xla",
    interpret=False,
) -> jax.Array:  # pages with the moves applied (aliases the donated input)
  """Moves whole blocks (all layers, heads) in place: `pages[..., dst[i], :, :] =
  pages[..., src[i], :, :]`. Sources and destinations must be disjoint (see
  `dynamic_validate_moves`); padding moves are ignored.

  Args:
    impl: "xla" (CPU default), "pallas" (generic grid kernel) or "mosaic"
      (Mosaic GPU kernel).
    interpret: False, True (interpret mode on CPU) or, for "mosaic", a
      `plgpu.InterpretGPUParams` (e.g. with `detect_races=True`).
  """
  static_validate_pages(pages, src, dst, names=("src", "dst"), impl=impl,
                        impls=_PERMUTE_IMPLS)
  from pallas_kernels import lowering

  platform = lowering.target_platform()
  if impl == "mosaic" and not interpret and platform != "cuda":
    raise ValueError(
        f"impl='mosaic' is not implemented on the {platform!r} backend (Mosaic "
        "GPU needs a GPU); pass interpret=True or a plgpu.InterpretGPUParams")
  if not interpret:
    num_layers, num_kv_heads, _, block_size, head_dim = pages.shape
    problem = permute_impl_problem(
        impl, num_layers=num_layers, num_kv_heads=num_kv_heads,
        block_size=block_size, head_dim=head_dim, dtype=pages.dtype,
        num_moves=src.shape[0], platform=platform)
    if problem is not None:
      raise ValueError(f"cannot build on {platform}: {problem}")
  if impl == "xla":
    return _xla_permute_blocks(pages, src, dst)
  if impl == "pallas":
    return _pallas_permute_blocks(pages, src, dst, interpret=bool(interpret))
  return _mosaic_permute_blocks(pages, src, dst, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("impl", "interpret"),
                   donate_argnames=("pages",))
def copy_slots(
    pages: jax.Array,  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
    src_block: jax.Array,  # i32[E]
    src_start: jax.Array,  # i32[E]
    dst_block: jax.Array,  # i32[E]
    dst_start: jax.Array,  # i32[E]
    length: jax.Array,  # i32[E], 0 = padding entry
    *,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:  # pages with the slot ranges copied (aliases the donated input)
  """Copies slot ranges between blocks (all layers, heads), in place.

  Used by copy-on-write (`cow_split`) and slot packing (`pack_slots`).
  Destination slots must be distinct and disjoint from source slots (see
  `dynamic_validate_slot_copies`). `impl`: "xla" (CPU default) or "pallas".
  """
  static_validate_pages(pages, src_block, src_start, dst_block, dst_start, length,
                        names=("src_block", "src_start", "dst_block", "dst_start",
                               "length"), impl=impl, impls=_COPY_IMPLS)
  if impl == "xla":
    return _xla_copy_slots(pages, src_block, src_start, dst_block, dst_start,
                           length)
  return _pallas_copy_slots(pages, src_block, src_start, dst_block, dst_start,
                            length, interpret=interpret)
