"""Preemption by swap: a sequence's K/V copied to host memory and restored bit-exactly.

`swap_out` gathers the sequence's logical K/V (all layers, heads) to host
numpy arrays and releases it; `swap_in` opens a fresh row, reserves room for
the same number of tokens (wherever the allocator puts them now) and writes the
K/V back, so the sequence's logical K/V is bit-identical while its physical
blocks may differ.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_kv.pool import BlockPool


@dataclasses.dataclass(frozen=True)
class SwappedKV:
  """Host copy of one sequence.

  Attributes:
    k, v: `[num_layers, num_kv_heads, length, head_dim]` numpy arrays.
  """

  k: np.ndarray
  v: np.ndarray

  @property
  def length(self) -> int:
    return int(self.k.shape[2])

  @property
  def nbytes(self) -> int:
    return int(self.k.nbytes + self.v.nbytes)


def swap_out(pool: BlockPool, seq_id: int) -> SwappedKV:
  """Copies a live sequence's K/V to host and releases it from the pool.

  On an exception the sequence may or may not have been released (the release is
  the last call); the caller checks the row (the scheduler reconciles its rows).
  """
  k, v = pool.gather_kv(seq_id)
  swapped = SwappedKV(k=np.asarray(jax.device_get(k)), v=np.asarray(jax.device_get(v)))
  pool.release([seq_id])
  return swapped


def swap_in(pool: BlockPool, swapped: SwappedKV, seq_id: int | None = None) -> int:
  """Restores a swapped sequence into a fresh row; returns the row.

  Atomic: on any exception (`KeyboardInterrupt` included) in the reservation or
  in a `write_kv`, the opened row is released again, so the pool is as before.

  Raises:
    PoolExhausted: it does not fit (the pool unchanged).
  """
  seq = pool.open_sequence(seq_id=seq_id)
  if swapped.length == 0:
    return seq
  try:
    slots = pool.reserve_tokens([seq], [swapped.length])[0, :swapped.length]
    for layer in range(swapped.k.shape[0]):
      # [H, T, D] -> [T, H, D], the layout write_kv takes.
      pool.write_kv(layer, slots, np.swapaxes(swapped.k[layer], 0, 1),
                    np.swapaxes(swapped.v[layer], 0, 1))
  except BaseException:
    try:
      if np.asarray(pool.state.table.active)[seq]:
        pool.release([seq])
    except Exception:  # pylint: disable=broad-except
      pass  # the first error goes up; a caller that owns rows (the scheduler) reconciles them
    raise
  return seq
