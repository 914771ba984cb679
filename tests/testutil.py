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
      self.pool.write_kv(layer, slot_idx, ks[layer], vs[layer])
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
