"""The prefix cache driven against the real ``paged_kv.BlockPool``.

After every step the pool's one invariant checker runs with the tree's segment
references as ``extra_segments`` (ref_count == table refs + tree refs), and the K/V a
match hands to a new sequence is compared with the K/V first written for those tokens.

Conversions (the cache speaks ``int32[n, 3]`` rows, the pool ``(block, start, length)``
column arrays): ``pool.open_sequence(tuple(segments.T))`` and
``np.stack(pool.segments(seq), axis=1)``.
"""

import numpy as np
from absl.testing import absltest

import jax.numpy as jnp
import paged_kv
from radix.cache import PrefixCache

BLOCK_SIZE = 4
HEAD_DIM = 2


def kv_values(namespace, tokens):
  """float32[n]: a per-token K value that depends on namespace and whole prefix."""
  out, h = [], hash(("kv", namespace))
  for t in tokens:
    h = hash((h, int(t)))
    out.append(h % 65_521)  # exact in float32
  return np.asarray(out, np.float32)


class RadixPoolTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.config = paged_kv.PoolConfig(
        num_blocks=24,
        block_size=BLOCK_SIZE,
        num_layers=1,
        num_kv_heads=1,
        head_dim=HEAD_DIM,
        max_seqs=4,
        max_segments=16,
    )
    self.pool = paged_kv.BlockPool(self.config)
    self.now = 0.0
    self.cache = PrefixCache(block_size=BLOCK_SIZE, clock=lambda: self.now)

  def check(self):
    self.pool.check_invariants(extra_segments=self.cache.segment_refs())

  def ref_count(self):
    return np.asarray(self.pool.state.meta.ref_count)

  def apply(self, deltas):
    if len(deltas):
      self.pool.apply_ref_deltas(deltas.block_ids, deltas.deltas)

  def make_room(self, need):
    free = self.pool.num_free_blocks
    if free < need:
      ev = self.cache.evict(num_blocks=need - free, ref_count=self.ref_count())
      self.apply(ev.ref_deltas)
      self.assertEqual(self.pool.num_free_blocks - free, ev.num_freed_blocks)
      self.check()
    return self.pool.num_free_blocks >= need

  def assert_kv(self, seq, namespace, tokens):
    k, v = self.pool.gather_kv(seq)
    want = kv_values(namespace, tokens)
    np.testing.assert_array_equal(np.asarray(k)[0, 0, :, 0], want)
    np.testing.assert_array_equal(np.asarray(v)[0, 0, :, 1], -want)

  def serve(self, namespace, tokens):
    """match -> open_sequence -> reserve/write the rest -> insert -> release."""
    m = self.cache.match(namespace, tokens)
    seq = self.pool.open_sequence(tuple(m.segments.T) if m.length else None)
    self.check()
    self.assert_kv(seq, namespace, tokens[: m.length])  # the cached KV is the original
    rest = len(tokens) - m.length
    if not self.make_room(-(-rest // BLOCK_SIZE)):
      self.pool.release([seq])
      if m.node is not None:
        self.cache.unlock(m.node)
      return m, None
    if rest:
      slots = self.pool.reserve_tokens([seq], [rest])
      width = slots.shape[1]
      vals = np.zeros((1, width, 1, HEAD_DIM), np.float32)
      vals[0, :rest, 0, 0] = kv_values(namespace, tokens)[m.length :]
      vals[0, :rest, 0, 1] = 0.0
      k = jnp.asarray(vals)
      v = jnp.asarray(np.stack([np.zeros_like(vals[..., 0]), -vals[..., 0]], -1))
      self.pool.write_kv(0, slots, k, v)
    self.assert_kv(seq, namespace, tokens)
    self.check()
    out = self.cache.insert(namespace, tokens, np.stack(self.pool.segments(seq), axis=1))
    self.apply(out.ref_deltas)
    if m.node is not None:
      self.cache.unlock(m.node)
    self.pool.release([seq])
    self.check()
    return m, out

  def test_cache_against_real_pool(self):
    rng = np.random.default_rng(0)
    system = [9, 9, 9, 9, 9, 9]
    history = []
    for step in range(24):
      self.now = float(step)
      ns = "a" if rng.random() < 0.7 else "b"
      if history and rng.random() < 0.5:  # continue an earlier conversation
        prev_ns, prev = history[rng.integers(len(history))]
        ns, tokens = prev_ns, prev + rng.integers(0, 4, rng.integers(1, 6)).tolist()
      else:
        tokens = system + rng.integers(0, 4, rng.integers(1, 10)).tolist()
      m, out = self.serve(ns, tokens)
      if out is not None:
        history.append((ns, tokens))
      if step % 7 == 6:
        self.cache.gc_mark(ttl=3.0)
        ev = self.cache.gc_evict(num_blocks=2, ref_count=self.ref_count())
        self.apply(ev.ref_deltas)
        self.check()
    self.assertGreater(self.cache.stats().hit_tokens, 0)
    self.assertGreater(self.cache.counters().evicted_nodes, 0)  # pressure was reached
    # Evict everything: the pool is empty again.
    ev = self.cache.evict(num_tokens=self.cache.num_tokens, ref_count=self.ref_count())
    self.apply(ev.ref_deltas)
    self.check()
    self.assertEqual(self.pool.num_free_blocks, self.config.num_blocks)
    self.assertEqual(self.cache.num_tokens, 0)


if __name__ == "__main__":
  absltest.main()
