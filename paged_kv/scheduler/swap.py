"""Preemption by swap: a sequence's K/V copied to host memory and restored bit-exactly.

`swap_out` gathers the sequence's K/V in one jitted gather at a power-of-two length,
starts its copy to the CPU device and releases the row; `swap_in` opens a fresh row,
reserves as many tokens and writes the K/V back in one jitted write of every layer.
Neither waits for the device; the physical blocks may differ, the logical K/V not.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_kv.pool.block_pool import BlockPool


def _host_device():
  """Where swapped K/V lives: the CPU device (host memory)."""
  return jax.devices("cpu")[0]


@dataclasses.dataclass(frozen=True)
class SwappedKV:
  """Host copy of one sequence: `k`, `v` `[num_layers, num_kv_heads, T, head_dim]`
  in host memory (CPU device or numpy); tokens past `length` (default `T`) are padding."""

  k: jax.Array | np.ndarray
  v: jax.Array | np.ndarray
  length: int = -1

  def __post_init__(self):
    if self.length < 0:
      object.__setattr__(self, "length", int(self.k.shape[2]))

  @property
  def nbytes(self) -> int:
    """Bytes of the sequence's K/V (its `length` tokens, K and V)."""
    per_token = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.dtype.itemsize
    return int(2 * per_token * self.length)


def swap_out(pool: BlockPool, seq_id: int) -> SwappedKV:
  """Copies a live sequence's K/V to host and releases it, without waiting (the
  runtime orders the gather's reads before later writes of the freed blocks). On an
  exception the row may or may not be released; the scheduler reconciles its rows."""
  k, v, length = pool.gather_kv_padded(seq_id)
  k, v = jax.device_put((k, v), _host_device())
  swapped = SwappedKV(k=k, v=v, length=length)
  pool.release([seq_id])
  return swapped


def swap_in(pool: BlockPool, swapped: SwappedKV, seq_id: int | None = None) -> int:
  """Restores a swapped sequence into a fresh row; returns the row. Atomic: on any
  exception the opened row is released again (`PoolExhausted`: it does not fit)."""
  seq = pool.open_sequence(seq_id=seq_id)
  if swapped.length == 0:
    return seq
  try:
    slots = pool.reserve_tokens([seq], [swapped.length])[0]
    width = swapped.k.shape[2]
    slot_idx = np.full((width,), -1, np.int32)
    slot_idx[:swapped.length] = slots[:swapped.length]
    pool.write_kv_layers(slot_idx, swapped.k, swapped.v, seq_ids=seq)
  except BaseException:
    try:
      if pool.host.active[seq]:
        pool.release([seq])
    except Exception:  # pylint: disable=broad-except
      pass  # the first error goes up; a caller that owns rows (the scheduler) reconciles them
    raise
  return seq
