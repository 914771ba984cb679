"""Host API: typed errors on bad input with the state unchanged, scrubbing,
buffer donation, and a recompile guard."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core import kv, sequences
from paged_kv.core.errors import InvalidSegmentLayout

CFG = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2,
                          head_dim=4, max_seqs=4, max_segments=8)


def _snapshot(pool):
  return jax.tree.map(np.asarray, pool.state)


def _filled_pool(cfg=CFG):
  pool = paged_kv.BlockPool(cfg)
  a, b = pool.open_sequence(), pool.open_sequence()
  slots = pool.reserve_tokens([a, b], [6, 3])
  kv_ = jax.random.normal(jax.random.key(0), slots.shape + (cfg.num_kv_heads, cfg.head_dim),
                          cfg.jnp_dtype)
  for layer in range(cfg.num_layers):
    pool.write_kv(layer, slots, kv_, kv_ * 2, seq_ids=[a, b])
  return pool, a, b, slots


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("reserve_unknown_seq", lambda p, a, b, s: p.reserve_tokens([7], [1]),
       paged_kv.InvalidSequence),
      ("reserve_out_of_range_seq", lambda p, a, b, s: p.reserve_tokens([99], [1]),
       paged_kv.InvalidSequence),
      ("reserve_inactive_seq", lambda p, a, b, s: p.reserve_tokens([2], [1]),
       paged_kv.InvalidSequence),
      ("reserve_negative_count", lambda p, a, b, s: p.reserve_tokens([a], [-1]),
       paged_kv.InvalidArgument),
      ("reserve_oversized_count", lambda p, a, b, s: p.reserve_tokens([a], [10_000]),
       paged_kv.PoolExhausted),
      ("reserve_batch_beyond_pool", lambda p, a, b, s: p.reserve_tokens([a, b], [20, 16]),
       paged_kv.PoolExhausted),
      ("reserve_batch_beyond_free", lambda p, a, b, s: p.reserve_tokens([a, b], [1, 22]),
       paged_kv.PoolExhausted),
      ("reserve_repeated_seq", lambda p, a, b, s: p.reserve_tokens([a, a], [1, 1]),
       paged_kv.InvalidSequence),
      ("release_unknown", lambda p, a, b, s: p.release([3]), paged_kv.InvalidSequence),
      ("fork_inactive_src", lambda p, a, b, s: p.fork(3), paged_kv.InvalidSequence),
      ("fork_active_dst", lambda p, a, b, s: p.fork(a, b), paged_kv.InvalidSequence),
      ("deltas_block_out_of_range", lambda p, a, b, s: p.apply_ref_deltas([8], [1]),
       paged_kv.InvalidBlock),
      ("deltas_negative_block", lambda p, a, b, s: p.apply_ref_deltas([-3], [1]),
       paged_kv.InvalidBlock),
      ("deltas_incref_free_block", lambda p, a, b, s: p.apply_ref_deltas([7], [1]),
       paged_kv.InvalidBlock),
      ("deltas_underflow", lambda p, a, b, s: p.apply_ref_deltas([0, 0], [-1, -1]),
       paged_kv.RefCountUnderflow),
      ("write_wrong_shape", lambda p, a, b, s: p.write_kv(0, s, jnp.zeros(s.shape + (2, 3)),
                                                           jnp.zeros(s.shape + (2, 3)),
                                                           seq_ids=[a, b]),
       paged_kv.InvalidArgument),
      ("write_wrong_dtype", lambda p, a, b, s: p.write_kv(
          0, s, jnp.zeros(s.shape + (2, 4), jnp.bfloat16), jnp.zeros(s.shape + (2, 4),
                                                                     jnp.bfloat16),
          seq_ids=[a, b]),
       paged_kv.InvalidArgument),
      ("write_slot_out_of_range", lambda p, a, b, s: p.write_kv(
          0, jnp.array([32]), jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4)), seq_ids=a),
       paged_kv.InvalidBlock),
      ("write_bad_layer", lambda p, a, b, s: p.write_kv(2, s, jnp.zeros(s.shape + (2, 4)),
                                                         jnp.zeros(s.shape + (2, 4)),
                                                         seq_ids=[a, b]),
       paged_kv.InvalidArgument),
      ("open_block_out_of_range", lambda p, a, b, s: p.open_sequence([[9, 0, 1]]),
       paged_kv.InvalidBlock),
      ("open_free_block", lambda p, a, b, s: p.open_sequence([[6, 0, 1]]),
       paged_kv.InvalidBlock),
      ("open_segment_outside_block", lambda p, a, b, s: p.open_sequence([[0, 3, 2]]),
       paged_kv.InvalidSegment),
      ("open_active_row", lambda p, a, b, s: p.open_sequence(seq_id=a), paged_kv.InvalidSequence),
      ("open_column_layout", lambda p, a, b, s: p.open_sequence(tuple(p.segments(a).T)),
       InvalidSegmentLayout),
      ("open_transposed", lambda p, a, b, s: p.open_sequence(p.segments(a)[:2].T),
       InvalidSegmentLayout),
      ("pack_bad_layout", lambda p, a, b, s: p.pack_slots(extra_segments=[[0, 0]]),
       InvalidSegmentLayout),
      ("allocate_negative", lambda p, a, b, s: p.allocate(-2), paged_kv.InvalidArgument),
      ("allocate_too_many", lambda p, a, b, s: p.allocate(6), paged_kv.PoolExhausted),
      ("allocate_beyond_pool", lambda p, a, b, s: p.allocate(9), paged_kv.PoolExhausted),
  )
  def test_refused_call_changes_nothing(self, call, error):
    pool, a, b, slots = _filled_pool()
    before = _snapshot(pool)
    with self.assertRaises(error):
      call(pool, a, b, slots)
    jax.tree.map(np.testing.assert_array_equal, before, _snapshot(pool))
    pool.check_invariants()

  def test_release_of_released_sequence(self):
    pool, a, b, _ = _filled_pool()
    pool.release([a])
    before = _snapshot(pool)
    with self.assertRaises(paged_kv.InvalidSequence):
      pool.release([a])
    jax.tree.map(np.testing.assert_array_equal, before, _snapshot(pool))

  def test_pool_exhausted_reason(self):
    pool, a, b, _ = _filled_pool()
    with self.assertRaises(paged_kv.PoolExhausted) as ctx:
      pool.reserve_tokens([a, b], [1, 22])
    self.assertEqual(ctx.exception.reason, "no_free_block")
    with self.assertRaises(paged_kv.PoolExhausted) as ctx:
      pool.reserve_tokens([a], [40])
    self.assertEqual(ctx.exception.reason, "no_free_block")


class ScrubTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_freed_blocks_scrubbed_only_when_asked(self, scrub):
    cfg = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2,
                              head_dim=4, max_seqs=4, max_segments=4, scrub_freed_blocks=scrub)
    pool, a, b, slots = _filled_pool(cfg)
    blocks_a = pool.segments(a)[:, 0]
    pool.release([a])
    k = np.asarray(pool.state.pages.k)[:, :, blocks_a]
    self.assertEqual(bool((k == 0).all()), scrub)
    k_b, _ = pool.gather_kv(b)
    self.assertFalse(bool((np.asarray(k_b) == 0).all()))  # live data untouched
    pool.check_invariants()


class DonationTest(absltest.TestCase):

  def test_write_kv_updates_pages_in_place(self):
    state = paged_kv.init_pool(CFG)
    slots = jnp.arange(4, dtype=jnp.int32)
    k = jnp.ones((4, 2, 4))
    compiled = kv.jit_write_kv.lower(state.pages, jnp.int32(0), slots, k, k).compile()
    pages_bytes = state.pages.k.nbytes + state.pages.v.nbytes
    self.assertGreaterEqual(compiled.memory_analysis().alias_size_in_bytes, pages_bytes)

  def test_reserve_tokens_aliases_state(self):
    state = paged_kv.init_pool(CFG)
    compiled = sequences.reserve_tokens.lower(
        state, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32), config=CFG,
        max_new_tokens=4).compile()
    pages_bytes = state.pages.k.nbytes + state.pages.v.nbytes
    self.assertGreaterEqual(compiled.memory_analysis().alias_size_in_bytes, pages_bytes)

  def test_second_step_compiles_nothing(self):
    pool = paged_kv.BlockPool(CFG)
    seqs = [pool.open_sequence() for _ in range(3)]

    def step():
      slots = pool.reserve_tokens(seqs, [1, 1, 1])
      pool.write_kv(0, slots, jnp.ones(slots.shape + (2, 4)), jnp.ones(slots.shape + (2, 4)),
                    seq_ids=seqs)

    step()
    sizes = (sequences.reserve_tokens._cache_size(),)
    with jax.log_compiles(False):
      step()
      step()
    self.assertEqual(sizes, (sequences.reserve_tokens._cache_size(),))

  def test_jitted_step_traces_once(self):
    """A user's decode step (reserve + write) inside one jit: traced exactly once."""
    traces = []

    @jax.jit
    def decode_step(state, seq_ids, k):
      traces.append(1)
      state, (slots, status) = sequences.reserve_tokens.__wrapped__(
          state, seq_ids, jnp.ones_like(seq_ids), config=CFG, max_new_tokens=1)
      pages = kv.write_kv(state.pages, 0, slots, k, k)
      return state.__class__(pages=pages, meta=state.meta, table=state.table,
                             step=state.step), status

    pool = paged_kv.BlockPool(CFG)
    seqs = jnp.array([pool.open_sequence(), pool.open_sequence()], jnp.int32)
    state = pool.state
    for _ in range(3):
      state, status = decode_step(state, seqs, jnp.ones((2, 1, 2, 4)))
      np.testing.assert_array_equal(status, 0)
    self.assertLen(traces, 1)

class DeadSlotsTest(absltest.TestCase):
  """`open_sequence(segments=)` refuses slots no live holder covers any more."""

  def _pool_with_dead_slots(self):
    cfg = paged_kv.PoolConfig(num_blocks=8, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=4)
    pool = paged_kv.BlockPool(cfg)
    a = pool.open_sequence()
    pool.reserve_tokens([a], [6])
    blk = int(pool.segments(a)[0, 0])
    b = pool.open_sequence(segments=[[blk, 0, 4]])  # shares slots 0..3
    pool.release([a])  # slots 4..5 stay handed out, but nothing covers them: dead
    return pool, blk, b

  def test_dead_slots_refused_state_unchanged(self):
    pool, blk, _ = self._pool_with_dead_slots()
    before = _snapshot(pool)
    with self.assertRaisesRegex(paged_kv.InvalidSegment, "dead slots"):
      pool.open_sequence(segments=[[blk, 4, 2]])
    with self.assertRaisesRegex(paged_kv.InvalidSegment, "dead slots"):
      pool.open_sequence(segments=[[blk, 2, 3]])  # straddles live and dead slots
    jax.tree.map(np.testing.assert_array_equal, before, _snapshot(pool))
    pool.check_invariants()

  def test_live_slots_and_outside_holders_accepted(self):
    pool, blk, b = self._pool_with_dead_slots()
    c = pool.open_sequence(segments=[[blk, 1, 3]])  # covered by b's segment
    pool.apply_ref_deltas([blk], [1])  # an outside holder (a cache) vouches for the block
    d = pool.open_sequence(segments=[[blk, 4, 2]])
    pool.check_invariants(extra_blocks=[blk])
    pool.release([b, c, d])
    pool.apply_ref_deltas([blk], [-1])
    pool.check_invariants()
    self.assertEqual(pool.num_free_blocks, pool.config.num_blocks)


if __name__ == "__main__":
  absltest.main()
