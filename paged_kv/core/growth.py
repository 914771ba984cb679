"""`grow_tails`: the device's half of a host reservation, in-place tail growth.

Rows whose step tokens all fit in their exclusive tail block (most of a decode
step) stay out of the commit; the step grows them here from the table it reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.sequences import range_mask
from paged_kv.core.state import PoolState


def grow_tails(state: PoolState, seq_ids: jax.Array, grow: jax.Array, clock: jax.Array, *,
               config: PoolConfig) -> PoolState:
  """Adds `grow[b]` tokens in place to the tail of row `seq_ids[b]`, and sets the clock (traced).

  Rows with `grow > 0` are distinct, active and own a tail block with room (the
  host checked); only their tail length, `seq_len`, slot bits and `last_use` change.
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
