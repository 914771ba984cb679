"""Reading and writing K/V through segment tables: `write_kv`, `token_slots`, `gather_kv`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.state import KVPages, PoolState, SegmentTable


def write_kv(pages: KVPages, layer: int | jax.Array, slot_idx: jax.Array, k: jax.Array,
             v: jax.Array) -> KVPages:
  """Scatters one layer's new K/V (`[..., kv_heads, head_dim]`) into `slot_idx` (`-1` skips).

  UNSAFE by design (the decode fast path): nothing is checked inside jit, `layer`
  included. Slots must be the writer's own, fresh from this step's reservation: a
  wrong index overwrites another sequence's K/V, duplicates leave the winner
  undefined. Other callers use `BlockPool.write_kv`, which checks.
  """
  _, h, n, bs, d = pages.k.shape
  if k.shape != v.shape or k.shape != slot_idx.shape + (h, d):
    raise ValueError(f"write_kv: k {k.shape} and v {v.shape} must be "
                     f"{slot_idx.shape + (h, d)} (slot_idx.shape + (num_kv_heads, head_dim))")
  if k.dtype != pages.k.dtype or v.dtype != pages.v.dtype:
    raise ValueError(f"write_kv: k/v dtype {k.dtype}/{v.dtype} != pages dtype {pages.k.dtype}")
  flat = slot_idx.reshape(-1)
  blk = jnp.where(flat >= 0, flat // bs, n)  # out of range -> dropped
  off = jnp.where(flat >= 0, flat % bs, 0)
  layer = jnp.asarray(layer, jnp.int32)
  kf = k.reshape(-1, h, d)
  vf = v.reshape(-1, h, d)
  # Advanced indices (layer, blk, off) around a slice: the update is [T, H, D].
  return KVPages(
      k=pages.k.at[layer, :, blk, off].set(kf, mode="drop"),
      v=pages.v.at[layer, :, blk, off].set(vf, mode="drop"),
  )


@functools.partial(jax.jit, donate_argnames=("pages",))
def jit_write_kv(pages: KVPages, layer: jax.Array, slot_idx: jax.Array, k: jax.Array,
                 v: jax.Array) -> KVPages:
  """`write_kv` jitted on its own, pages donated (updated in place)."""
  return write_kv(pages, layer, slot_idx, k, v)


def token_slots(table: SegmentTable, seq_id: jax.Array, *, max_len: int,
                block_size: int) -> tuple[jax.Array, jax.Array]:
  """Flat physical slot of each logical token of row `seq_id` (not checked inside jit).

  Returns `(slots, valid)`: `i32[max_len]` (0 where invalid) and `bool[max_len]`
  (t < seq_len).
  """
  lengths = table.length[seq_id]
  cum = jnp.cumsum(lengths)
  t = jnp.arange(max_len, dtype=jnp.int32)
  s = jnp.clip(jnp.searchsorted(cum, t, side="right"), 0, lengths.shape[0] - 1)
  before = cum[s] - lengths[s]
  slot = table.block[seq_id, s] * block_size + table.start[seq_id, s] + (t - before)
  valid = t < table.seq_len[seq_id]
  return jnp.where(valid, slot, 0), valid


@functools.partial(jax.jit, static_argnames=("max_len",))
def gather_kv(state: PoolState, seq_id: jax.Array, *,
              max_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The logical K/V of one sequence in token order (for tests and references).

  Returns `(k, v, valid)`: `k, v: [num_layers, num_kv_heads, max_len, head_dim]`
  (zero beyond the sequence's length), `valid: bool[max_len]`.
  """
  _, _, _, bs, _ = state.pages.k.shape
  slots, valid = token_slots(state.table, jnp.asarray(seq_id, jnp.int32), max_len=max_len,
                             block_size=bs)
  def take(p):
    l, h, n, _, d = p.shape
    g = p.reshape(l, h, n * bs, d)[:, :, slots]
    return jnp.where(valid[None, None, :, None], g, jnp.zeros((), p.dtype))
  return take(state.pages.k), take(state.pages.v), valid
