"""Shared helpers of the fragmentation tests: a pool with random K/V and its model.

`KVModel` keeps, for every live sequence, the logical K/V it must read back
(numpy, `[num_layers, num_kv_heads, seq_len, head_dim]`), so any transition that
moves data can be checked bit for bit with `paged_kv.gather_kv`.
"""

from __future__ import annotations

import numpy as np

import paged_kv


def small_config(**kw) -> paged_kv.PoolConfig:
  """The tests' pool config. Tests share it (and shapes) so jitted code compiles once."""
  base = dict(num_blocks=32, block_size=8, num_layers=2, num_kv_heads=2, head_dim=3,
              max_seqs=8, max_segments=16)
  base.update(kw)
  return paged_kv.PoolConfig(**base)


def exhaust(pool: paged_kv.BlockPool) -> np.ndarray:
  """Takes every free block (held by the caller, ref_count 1); returns their ids."""
  return pool.allocate(pool.num_free_blocks, contiguous="never")


def give_back(pool: paged_kv.BlockPool, ids) -> None:
  """Drops the references taken by `exhaust`."""
  pool.apply_ref_deltas(ids, -np.ones(len(ids), np.int64))


class KVModel:
  """Expected logical K/V of every live sequence of a `BlockPool`."""

  def __init__(self, pool: paged_kv.BlockPool, seed: int = 0):
    self.pool = pool
    self.rng = np.random.default_rng(seed)
    self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _empty(self):
    c = self.pool.config
    z = np.zeros((c.num_layers, c.num_kv_heads, 0, c.head_dim), np.float32)
    return z, z.copy()

  def open(self, segments=None, prefix_of: int | None = None, prefix_len: int = 0) -> int:
    """Opens a sequence on `segments` (`int32[n, 3]` rows, a prefix of `prefix_of`)."""
    seq = self.pool.open_sequence(segments)
    if prefix_of is None:
      self.kv[seq] = self._empty()
    else:
      k, v = self.kv[prefix_of]
      self.kv[seq] = (k[:, :, :prefix_len].copy(), v[:, :, :prefix_len].copy())
    return seq

  def append(self, seqs, counts) -> None:
    """Reserves and writes random K/V for `counts[i]` new tokens of `seqs[i]`."""
    c = self.pool.config
    slot_idx = np.asarray(self.pool.reserve_tokens(seqs, counts))
    shape = slot_idx.shape + (c.num_kv_heads, c.head_dim)
    ks = self.rng.standard_normal((c.num_layers,) + shape).astype(np.float32)
    vs = self.rng.standard_normal((c.num_layers,) + shape).astype(np.float32)
    for layer in range(c.num_layers):
      self.pool.write_kv(layer, slot_idx, ks[layer], vs[layer], seq_ids=seqs)
    for i, (seq, cnt) in enumerate(zip(seqs, counts)):
      # [L, T, H, D] -> [L, H, T, D]
      nk = ks[:, i, :cnt].transpose(0, 2, 1, 3)
      nv = vs[:, i, :cnt].transpose(0, 2, 1, 3)
      k, v = self.kv[seq]
      self.kv[seq] = (np.concatenate([k, nk], axis=2), np.concatenate([v, nv], axis=2))

  def fork(self, src: int) -> int:
    dst = self.pool.fork(src)
    k, v = self.kv[src]
    self.kv[dst] = (k.copy(), v.copy())
    return dst

  def release(self, seqs) -> None:
    self.pool.release(seqs)
    for s in seqs:
      del self.kv[s]

  def check(self, extra_segments=None) -> None:
    """Invariants hold and every live sequence reads back its K/V bit for bit."""
    paged_kv.check_invariants(self.pool.state, extra_segments)
    live = set(np.nonzero(np.asarray(self.pool.state.table.active))[0].tolist())
    assert live == set(self.kv), (live, set(self.kv))
    c = self.pool.config
    max_len = c.max_segments * c.block_size  # one shape: gather_kv compiles once
    for seq, (k, v) in self.kv.items():
      gk, gv, valid = paged_kv.gather_kv(self.pool.state, seq, max_len=max_len)
      n = k.shape[2]
      assert int(np.asarray(valid).sum()) == n
      np.testing.assert_array_equal(np.asarray(gk)[:, :, :n], k, err_msg=f"K of seq {seq}")
      np.testing.assert_array_equal(np.asarray(gv)[:, :, :n], v, err_msg=f"V of seq {seq}")


def read_segment(pool: paged_kv.BlockPool, seg) -> np.ndarray:
  """K of one `(block, start, length)` segment: `[L, H, length, D]`."""
  b, s, ln = (int(x) for x in seg)
  return np.asarray(pool.state.pages.k[:, :, b, s:s + ln])


class HostTransfers:
  """Counts device-to-host reads of `jax.Array`s by size while active.

  `jax.transfer_guard` does not fire on CPU (reads are zero-copy there), so this
  wraps the three ways an array reaches the host: the buffer protocol
  (`np.asarray` on CPU), `__array__` and `_value` (`int()`, `device_get`,
  `tolist`, and every read on a GPU). `sizes` lists the element count of each
  read. Test-only: it patches private attributes of JAX's array type and
  `available` is False (use `skipTest`) where they do not exist.
  """

  _NAMES = ("__buffer__", "__array__", "_value")

  def __init__(self):
    import jax.numpy as jnp
    self._type = type(jnp.zeros(1))
    self.available = all(hasattr(self._type, n) for n in self._NAMES)
    self.sizes: list[int] = []
    self._saved = {}

  def __enter__(self) -> "HostTransfers":
    if not self.available:
      return self
    t, sizes = self._type, self.sizes
    self._saved = {n: t.__dict__[n] for n in self._NAMES}
    buffer, array, value = (self._saved[n] for n in self._NAMES)

    def _buffer(a, flags):
      sizes.append(a.size)
      return buffer(a, flags)

    def _array(a, *args, **kw):
      sizes.append(a.size)
      return array(a, *args, **kw)

    def _value(a):
      sizes.append(a.size)
      return value.fget(a)

    t.__buffer__, t.__array__, t._value = _buffer, _array, property(_value)
    return self

  def __exit__(self, *exc) -> None:
    for name, attr in self._saved.items():
      setattr(self._type, name, attr)
    self._saved = {}

  def at_least(self, size: int) -> int:
    """Reads of arrays with `size` or more elements."""
    return sum(s >= size for s in self.sizes)
