"""Checked K/V writes and gathers of a `BlockPool` (bound as its methods).

Model code writes inside its jitted step with `paged_kv.core.kv.write_kv`
instead, which checks nothing.
"""
# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import kv
from paged_kv.core.errors import BlockInUse, InvalidArgument, InvalidBlock, InvalidSegment
from paged_kv.core.state import PoolState
from paged_kv.pool.arguments import as_int_array, as_int_scalar, as_kv_array, bucket, single_int

if TYPE_CHECKING:
  from paged_kv.pool.block_pool import BlockPool


def gather_kv(pool: BlockPool, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Logical `k, v: [num_layers, num_kv_heads, seq_len, head_dim]` of one sequence,
  as host arrays (`gather_kv_padded` keeps them on the device)."""
  k, v, length = pool.gather_kv_padded(seq_id)
  k, v = jax.device_get((k, v))
  pool.runtime.read("data")
  return k[:, :, :length], v[:, :, :length]


def gather_kv_padded(pool: BlockPool, seq_id: int) -> tuple[jax.Array, jax.Array, int]:
  """`(k, v, length)`: the logical K/V on the device, zero-padded to a power of two
  (>= 16) tokens, so there is one program per bucket."""
  length = pool.seq_len(seq_id)
  state = pool.state
  k, v, _ = kv.gather_kv(state, np.int32(seq_id), max_len=bucket(length, 16))
  pool.runtime.dispatch("data")
  return k, v, length


def warm_data(pool: BlockPool, length: int) -> None:
  """Compiles the gather and the layered write at `length`'s bucket, changing nothing."""
  width = bucket(length, 16)
  state = pool.state
  k, v, _ = kv.gather_kv(state, np.int32(0), max_len=width)
  pool._state = write_layers(state, np.full((width,), -1, np.int32), k, v)
  pool.runtime.dispatch("data", 2)


def write_kv(pool: BlockPool, layer: int, slot_idx, k: jax.Array, v: jax.Array, *,
             seq_ids) -> None:
  """Writes new tokens' K/V of one layer; `k, v: slot_idx.shape + (kv_heads, head_dim)`.

  Every slot (`-1` = skip) must be an integer in `[0, num_slots)` (`2**32 + s`
  or `4.9` is refused, not cast), named once, handed out, and exclusively the
  writer's: covered by one live segment of the sequence `seq_ids` names, on a
  block nothing outside the tables references. So a write never lands in
  another sequence's tokens, a shared prefix, a cached or a free block.

  Args:
    layer: an integer scalar (not a bool) in `[0, num_layers)`.
    slot_idx: int array of flat physical slots (`block * block_size + offset`).
    k, v: arrays (JAX or numpy) of the config dtype.
    seq_ids: the writer of each row of `slot_idx` (`int[B]` for a `[B, ...]`
      `slot_idx`; a 1-D `slot_idx`'s rows are its slots), or one live sequence.

  Raises:
    InvalidArgument: bad layer, dtype, shape or value type; a slot named twice.
    InvalidBlock: a slot out of range or on a free block.
    InvalidSegment: a slot never handed out, or no live sequence's.
    BlockInUse: a slot shared, held outside the tables, or another sequence's.
    InvalidSequence: a `seq_ids` entry out of range or inactive.
  """
  c = pool.config
  layer = as_int_scalar(layer, "layer", low=0, high=c.num_layers)
  try:
    s = np.asarray(slot_idx)
  except (TypeError, ValueError) as e:
    raise InvalidArgument(f"write_kv: slot_idx must be an int array, got "
                          f"{type(slot_idx).__name__}") from e
  if isinstance(slot_idx, jax.Array):
    pool.runtime.read("data")
  if s.size and (s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.integer)):
    raise InvalidArgument(f"write_kv: slot_idx must be an int array, got {s.dtype}")
  if s.size and (s.min() < -1 or s.max() >= c.num_slots):
    raise InvalidBlock(f"write_kv: slot index outside [-1, {c.num_slots}): "
                       f"{s.min()}..{s.max()}")
  s = s.astype(np.int32)
  k, v = as_kv_array(k, "k"), as_kv_array(v, "v")
  _write(pool, lambda state: write_state(state, np.int32(layer), s, k, v), "write_kv", s, k, v,
         tuple(s.shape) + (c.num_kv_heads, c.head_dim), seq_ids)


def write_kv_layers(pool: BlockPool, slot_idx, k, v, *, seq_ids) -> None:
  """Writes every layer's K/V of the tokens at `slot_idx` in one jitted write.

  What restores a sequence (swap-in, a cache load): `k, v: [num_layers,
  num_kv_heads, T, head_dim]` (as `gather_kv` returns them), `slot_idx: int[T]`
  (`-1` = skip), `seq_ids` as `write_kv`'s; the same checks and errors. One
  program per `T`: pad `T` to a few sizes.
  """
  c = pool.config
  s = np.asarray(slot_idx)
  if s.ndim != 1 or (s.size and (s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.integer))):
    raise InvalidArgument(f"write_kv_layers: slot_idx must be a 1-D int array, got "
                          f"{s.dtype}{list(s.shape)}")
  if s.size and (s.min() < -1 or s.max() >= c.num_slots):
    raise InvalidBlock(f"write_kv_layers: slot index outside [-1, {c.num_slots}): "
                       f"{s.min()}..{s.max()}")
  s = s.astype(np.int32)
  _write(pool, lambda state: write_layers(state, s, k, v), "write_kv_layers", s, k, v,
         (c.num_layers, c.num_kv_heads, s.shape[0], c.head_dim), seq_ids)


def _write(pool: BlockPool, program, what: str, s: np.ndarray, k, v, want: tuple,
           seq_ids) -> None:
  """Checks `k`/`v` (shape `want`, the pool's dtype) and the slots' owners, then runs
  `program` on the flushed state."""
  dtype = pool.config.jnp_dtype
  for name, x in (("k", k), ("v", v)):
    if tuple(x.shape) != want or x.dtype != dtype:
      raise InvalidArgument(f"{what}: {name} is {x.dtype}{list(x.shape)}, expected "
                            f"{dtype}{list(want)}")
  _check_write_targets(pool, s, seq_ids)
  pool._state = program(pool.state)
  pool.runtime.dispatch("data")
  pool._done()


def _check_write_targets(pool: BlockPool, s: np.ndarray, seq_ids) -> None:
  """`write_kv`'s ownership checks, on the mirror."""
  c = pool.config
  bs = c.block_size
  h = pool.host
  one = single_int(seq_ids) if np.ndim(seq_ids) == 0 else None
  if one is not None:  # one writer for every slot
    pool._check_id(one, active=True)
    writer = np.full(s.size, one, np.int64)
  else:
    ids = as_int_array(seq_ids, "seq_ids")
    if s.ndim == 0 or ids.shape != s.shape[:1]:
      raise InvalidArgument(f"write_kv: seq_ids {ids.shape} must give one sequence per "
                            f"row of slot_idx {s.shape}, or be one sequence")
    writer = np.broadcast_to(ids.reshape((-1,) + (1,) * (s.ndim - 1)), s.shape).reshape(-1)
  flat = s.reshape(-1).astype(np.int64)
  keep = flat >= 0
  flat = flat[keep]
  writer = writer[keep]  # a padding slot's writer is not checked
  if one is None and writer.size:
    pool._check_ids(np.unique(writer), active=True)
  if flat.size == 0:
    return
  uniq, counts = np.unique(flat, return_counts=True)
  if (counts > 1).any():
    raise InvalidArgument(f"write_kv: slots {uniq[counts > 1][:8].tolist()} named more than "
                          "once in one call (the winner would be undefined)")
  blk, off = flat // bs, flat % bs
  ref = h.ref_count[blk].astype(np.int64)
  free = ref == 0
  if free.any():
    raise InvalidBlock(f"write_kv: slots {flat[free][:8].tolist()} lie on free blocks")
  words = h.slots[blk]
  bit = (words[np.arange(flat.size), off // 32] >> (off % 32).astype(np.uint32)) & 1
  if not bit.all():
    raise InvalidSegment(f"write_kv: slots {flat[bit == 0][:8].tolist()} were never handed "
                         "out (reserve_tokens first)")
  held_outside = ref > h.table_refs[blk]
  if held_outside.any():
    raise BlockInUse(f"write_kv: slots {flat[held_outside][:8].tolist()} lie on blocks held "
                     "outside the tables too (a prefix cache or an allocate() caller): "
                     "their K/V may be read elsewhere")
  used = h.used_mask()
  on = used & np.isin(h.block, np.unique(blk))
  rows = np.broadcast_to(np.arange(c.max_seqs)[:, None], used.shape)[on].astype(np.int64)
  segs = np.stack([h.block[on], h.start[on], h.length[on]], axis=1).astype(np.int64)
  rel = flat[:, None] - (segs[None, :, 0] * bs + segs[None, :, 1])
  cover = (rel >= 0) & (rel < segs[None, :, 2])
  num_cover = cover.sum(axis=1)
  if (num_cover == 0).any():
    raise InvalidSegment(f"write_kv: slots {flat[num_cover == 0][:8].tolist()} belong to "
                         "no live sequence")
  if (num_cover > 1).any():
    raise BlockInUse(f"write_kv: slots {flat[num_cover > 1][:8].tolist()} are shared by "
                     "several segments (a fork or a shared prefix): never overwritten")
  owner = rows[np.argmax(cover, axis=1)]
  wrong = owner != writer
  if wrong.any():
    i = int(np.argmax(wrong))
    raise BlockInUse(f"write_kv: slot {int(flat[i])} belongs to sequence {int(owner[i])}, "
                     f"not to the writer {int(writer[i])}")


@functools.partial(jax.jit, donate_argnames=("state",))
def write_state(state: PoolState, layer: jax.Array, slot_idx: jax.Array, k: jax.Array,
                v: jax.Array) -> PoolState:
  return dataclasses.replace(state, pages=kv.write_kv(state.pages, layer, slot_idx, k, v))


@functools.partial(jax.jit, donate_argnames=("state",))
def write_layers(state: PoolState, slot_idx: jax.Array, k: jax.Array,
                 v: jax.Array) -> PoolState:
  """Every layer's K/V (`[L, H, T, D]`) into slots `slot_idx: i32[T]` (-1 dropped)."""
  pages = state.pages
  n, bs = pages.k.shape[2], pages.k.shape[3]
  blk = jnp.where(slot_idx >= 0, slot_idx // bs, n)  # out of range: dropped
  off = jnp.where(slot_idx >= 0, slot_idx % bs, 0)
  def put(p, x):  # advanced (block, offset) indices: the update is [L, H, T, D], in place
    return p.at[:, :, blk, off].set(x.astype(p.dtype), mode="drop")
  return dataclasses.replace(state, pages=dataclasses.replace(pages, k=put(pages.k, k),
                                                              v=put(pages.v, v)))
