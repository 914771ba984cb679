"""`grow_tails`: the device's half of a host reservation, in-place tail growth.

The serving loop reserves a step's slots on the host mirror
(`paged_kv.pool.block_pool.BlockPool.reserve_step`). A row whose tokens all fit after its
tail, in its exclusive tail block, changes only its tail segment's length, its
`seq_len` and that block's slot bits: values the step can compute from the table
it already reads. So those rows stay out of the commit (no change-log row, no
touched block: most rows of a decode step) and the step applies them here, before
it builds its metadata; rows that got a new block or segment come in the commit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.segments import range_mask
from paged_kv.core.state import PoolState


def grow_tails(state: PoolState, seq_ids: jax.Array, grow: jax.Array, clock: jax.Array, *,
               config: PoolConfig) -> PoolState:
  """Adds `grow[b]` tokens in place to the tail segment of row `seq_ids[b]` (traced).

  Args:
    state: the pool, after the commit that preceded the step.
    seq_ids: `i32[B]` the step's rows (`-1` = padding); rows with `grow > 0` are
      distinct, active, and own their tail block with room for `grow` tokens (the
      host checked: `paged_kv.pool.host_transitions.reserve`).
    grow: `i32[B]` tokens each row grows in place by (0: none, or in the commit).
    clock: `i32[]` the host's logical clock after the reservation.
    config: static pool config.

  Returns:
    The state with those rows' tail `length`, `seq_len` and tail blocks' slot bits
    (and `last_use`) updated and its clock set to `clock`; nothing else changes.
  """
  table, meta = state.table, state.meta
  s, m, n = config.max_seqs, config.max_segments, config.num_blocks
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  grow = jnp.asarray(grow, jnp.int32)
  live = (grow > 0) & (seq_ids >= 0)
  row = jnp.clip(seq_ids, 0, s - 1)
  tail = jnp.clip(table.num_segments[row] - 1, 0, m - 1)
  blk = table.block[row, tail]
  pos = table.start[row, tail] + table.length[row, tail]
  mask = range_mask(pos, grow, config.slot_words)  # u32[B, W]
  rows = jnp.where(live, row, s)  # out of range: dropped
  blocks = jnp.where(live, blk, n)
  slots = meta.slots.at[blocks].set(meta.slots[jnp.minimum(blocks, n - 1)] | mask, mode="drop")
  meta = dataclasses.replace(meta, slots=slots,
                             last_use=meta.last_use.at[blocks].set(state.step, mode="drop"))
  table = dataclasses.replace(
      table, length=table.length.at[rows, tail].add(grow, mode="drop"),
      seq_len=table.seq_len.at[rows].add(grow, mode="drop"))
  return dataclasses.replace(state, table=table, meta=meta,
                             step=jnp.asarray(clock, state.step.dtype))
