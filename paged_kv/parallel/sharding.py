"""Tensor-parallel pool: pages sharded over kv heads along one mesh axis, metadata replicated.

Every deciding transition then computes the same decision on every device with
no collective; the Pallas kernels, which XLA cannot partition, run per shard
through the `sharded_*` wrappers. Design: `docs/scaling.md`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from paged_kv.core.config import PoolConfig
from paged_kv.core.kv import write_kv
from paged_kv.core.page_copy import move_pages
from paged_kv.core.state import KVPages, PoolState, init_pool

DEFAULT_AXIS = "tp"


def page_spec(axis: str = DEFAULT_AXIS) -> P:
  """`PartitionSpec` of `pages.k` / `pages.v`: kv heads (axis 1) split over `axis`."""
  return P(None, axis, None, None, None)


def layer_page_spec(axis: str = DEFAULT_AXIS) -> P:
  """`PartitionSpec` of one layer's pages `[num_kv_heads, num_blocks, block_size, head_dim]`."""
  return P(axis, None, None, None)


def make_tp_mesh(num_devices: int | None = None, *, axis: str = DEFAULT_AXIS,
                 devices: list[jax.Device] | None = None) -> Mesh:
  """A one-axis `AxisType.Auto` mesh over `num_devices` of `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if num_devices is None else num_devices
  if not isinstance(n, int) or n < 1 or n > len(devices):
    raise ValueError(f"make_tp_mesh: num_devices must be in [1, {len(devices)}], got {n!r}")
  return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:n])


def axis_size(mesh: Mesh, axis: str) -> int:
  """Size of mesh axis `axis`; ValueError naming the mesh's axes when it is absent."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
  return int(mesh.shape[axis])


def validate_heads(num_kv_heads: int, mesh: Mesh, axis: str, *,
                   num_q_heads: int | None = None) -> int:
  """Returns the size of `axis`; `ValueError` unless the heads split evenly over it (GQA too)."""
  n = axis_size(mesh, axis)
  if num_kv_heads % n:
    raise ValueError(
        f"num_kv_heads={num_kv_heads} is not divisible by the size {n} of mesh axis "
        f"{axis!r}: tensor parallelism gives every device the same number of kv heads")
  if num_q_heads is not None and num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                     f"num_kv_heads={num_kv_heads} (GQA groups cannot be split)")
  return n


def pool_shardings(state: PoolState, mesh: Mesh, *, axis: str = DEFAULT_AXIS) -> PoolState:
  """`NamedSharding`s of `state`'s leaves: pages by `page_spec(axis)`, the rest replicated."""
  validate_heads(state.pages.k.shape[1], mesh, axis)
  replicated = NamedSharding(mesh, P())
  pages = NamedSharding(mesh, page_spec(axis))
  shardings = jax.tree.map(lambda _: replicated, state)
  return PoolState(pages=KVPages(k=pages, v=pages), meta=shardings.meta,
                   table=shardings.table, step=shardings.step)


def shard_pool(state: PoolState, mesh: Mesh, *, axis: str = DEFAULT_AXIS) -> PoolState:
  """Places a pool on `mesh`, pages split over `axis` (not donated); `ValueError` if uneven."""
  return jax.device_put(state, pool_shardings(state, mesh, axis=axis))


def init_sharded_pool(config: PoolConfig, mesh: Mesh, *, axis: str = DEFAULT_AXIS) -> PoolState:
  """`init_pool(config)` built sharded: each device allocates only its heads."""
  shardings = pool_shardings(jax.eval_shape(functools.partial(init_pool, config)), mesh,
                             axis=axis)
  return jax.jit(init_pool, static_argnums=0, out_shardings=shardings)(config)


def _place(x, mesh: Mesh, spec):
  """`x` resharded to `spec` under Explicit mesh axes (Auto axes reshard by themselves)."""
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.reshard(x, jax.tree.map(lambda sp: NamedSharding(mesh, sp), spec,
                                       is_leaf=lambda v: isinstance(v, P)))
  return x


def _check_pages(pages: KVPages, mesh: Mesh, axis: str) -> int:
  if pages.k.ndim != 5 or pages.k.shape != pages.v.shape:
    raise ValueError(f"pages k/v must both be [num_layers, num_kv_heads, num_blocks, "
                     f"block_size, head_dim], got {pages.k.shape} and {pages.v.shape}")
  return validate_heads(pages.k.shape[1], mesh, axis)


@functools.partial(jax.jit, static_argnames=("mesh", "axis"), donate_argnames=("pages",))
def sharded_write_kv(pages: KVPages, layer: int | jax.Array, slot_idx: jax.Array, k: jax.Array,
                     v: jax.Array, *, mesh: Mesh, axis: str = DEFAULT_AXIS) -> KVPages:
  """`write_kv` per shard: `k`, `v` split over `axis` on their heads, `pages` donated."""
  _check_pages(pages, mesh, axis)
  lead = (None,) * slot_idx.ndim
  kv_spec = P(*lead, axis, None)
  pspec = KVPages(k=page_spec(axis), v=page_spec(axis))

  def local(p, layer, slot_idx, k, v):
    return write_kv(p, layer, slot_idx, k, v)

  in_specs = (pspec, P(), P(), kv_spec, kv_spec)
  args = _place((pages, jnp.asarray(layer, jnp.int32), jnp.asarray(slot_idx, jnp.int32), k, v),
                mesh, in_specs)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=pspec)(*args)


@functools.partial(
    jax.jit, static_argnames=("mesh", "axis", "sm_scale", "soft_cap", "num_splits", "impl",
                              "interpret", "pages_per_step"))
def sharded_paged_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim], heads sharded
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim], heads sharded
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    mesh: Mesh,
    axis: str = DEFAULT_AXIS,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    impl: str = "xla",
    interpret: bool = False,
    pages_per_step: int | None = None,
) -> jax.Array:  # [B, num_q_heads, head_dim], q heads split over `axis`
  """`pallas_kernels.decode_attention` per shard: each device attends with its heads, no collective.

  Query heads split in `n` contiguous chunks, so each GQA group lands with its kv
  head; the table is replicated. Other arguments as `paged_attention`
  (`pages_per_step=None` keeps its default). Returns `[B, num_q_heads,
  head_dim]`, split over heads (ready for a row-parallel projection).
  """
  from pallas_kernels import decode_attention as pa  # lazy: kernels are optional for the core

  if q.ndim != 3 or k_pages.ndim != 4:
    raise ValueError(f"q must be [B, num_q_heads, head_dim] and pages [num_kv_heads, "
                     f"num_blocks, block_size, head_dim], got {q.shape} and {k_pages.shape}")
  validate_heads(k_pages.shape[0], mesh, axis, num_q_heads=q.shape[1])
  kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, num_splits=num_splits, impl=impl,
                interpret=interpret)
  if pages_per_step is not None:
    kwargs["pages_per_step"] = pages_per_step
  q_spec = P(None, axis, None)
  lp = layer_page_spec(axis)

  def local(q, kp, vp, sb, ss, sl, ns):
    return pa.decode_attention(q, kp, vp, sb, ss, sl, ns, **kwargs)

  in_specs = (q_spec, lp, lp, P(), P(), P(), P())
  args = _place((q, k_pages, v_pages, seg_block, seg_start, seg_length, num_segments), mesh,
                in_specs)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec)(*args)


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "impl", "interpret"),
                   donate_argnames=("pages",))
def sharded_move_pages(pages: KVPages,
                       src: jax.Array,  # i32[M], -1 = padding, replicated
                       dst: jax.Array,  # i32[M], -1 = padding, replicated
                       *, mesh: Mesh, axis: str = DEFAULT_AXIS, impl: str = "xla",
                       interpret: bool = False) -> KVPages:
  """`page_copy.move_pages` per shard, for the kernels XLA cannot partition; pages donated."""
  _check_pages(pages, mesh, axis)
  pspec = KVPages(k=page_spec(axis), v=page_spec(axis))

  def local(p, s, d):
    return move_pages(p, s, d, impl=impl, interpret=interpret)

  in_specs = (pspec, P(), P())
  args = _place((pages, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)), mesh,
                in_specs)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=pspec)(*args)


def bytes_per_device(state: PoolState) -> dict[jax.Device, int]:
  """Bytes of `pages.k + pages.v` on each addressable device."""
  out: dict[jax.Device, int] = {}
  for a in (state.pages.k, state.pages.v):
    for shard in a.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


__all__ = ["DEFAULT_AXIS", "axis_size", "bytes_per_device", "init_sharded_pool",
           "layer_page_spec", "make_tp_mesh", "page_spec", "pool_shardings", "shard_pool",
           "sharded_move_pages", "sharded_paged_attention", "sharded_write_kv", "validate_heads"]
