"""Preemption by swap: a sequence's K/V copied to host memory and restored bit-exactly.

`swap_out` gathers the sequence's logical K/V (all layers, heads) with one
jitted gather at a power-of-two length (`BlockPool.gather_kv_padded`), starts
its copy to host memory (`jax.device_put` to the CPU device: asynchronous, no
wait) and releases the sequence. `swap_in` opens a fresh row, reserves room
for the same number of tokens (wherever the allocator puts them now) and
writes the K/V back in one jitted write of every layer
(`BlockPool.write_kv_layers`), so the sequence's logical K/V is bit-identical
while its physical blocks may differ. Neither waits for the device, and both
run programs of a few power-of-two lengths only.
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
  """Host copy of one sequence.

  Attributes:
    k, v: `[num_layers, num_kv_heads, T, head_dim]` arrays in host memory (on
      the CPU device, or numpy), `T >= length`; tokens beyond `length` are
      padding.
    length: the sequence's tokens (default: `T`).
  """

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
  """Copies a live sequence's K/V to host and releases it from the pool.

  No wait: the gather is dispatched, its copy to host memory started, and the
  release queued; the runtime orders the gather's reads before any later write
  of the freed blocks.

  On an exception the sequence may or may not have been released (the release is
  the last call); the caller checks the row (the scheduler reconciles its rows).
  """
  k, v, length = pool.gather_kv_padded(seq_id)
  k, v = jax.device_put((k, v), _host_device())
  swapped = SwappedKV(k=k, v=v, length=length)
  pool.release([seq_id])
  return swapped


def swap_in(pool: BlockPool, swapped: SwappedKV, seq_id: int | None = None) -> int:
  """Restores a swapped sequence into a fresh row; returns the row.

  Atomic: on any exception (`KeyboardInterrupt` included) in the reservation or
  in the write, the opened row is released again, so the pool is as before.

  Raises:
    PoolExhausted: it does not fit (the pool unchanged).
  """
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
