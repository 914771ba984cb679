"""Tests of the simulated replay: paged_kv.sim.block_accounting and paged_kv.sim.replay."""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized

from paged_kv.sim import traces
from paged_kv.sim.block_accounting import BlockAccounting
from paged_kv.sim.replay import (ReplayConfig, ReplayResult, SimState, replay_sim,
                                     serve_request)
from paged_kv.sim.traces import TraceRequest
from tests.sim.trace_files import BLOCK, session_trace, tmp_file, write_azure, write_mooncake


class BlockAccountingTest(absltest.TestCase):

  def test_lowest_address_first_and_reuse(self):
    pool = BlockAccounting(8, 16)
    np.testing.assert_array_equal(pool.allocate(3), [0, 1, 2])
    np.testing.assert_array_equal(pool.allocate(2), [3, 4])
    pool.change_refs(np.array([1, 3]), -1)
    self.assertEqual(pool.num_free, 5)
    np.testing.assert_array_equal(pool.allocate(3), [1, 3, 5])
    self.assertEqual(pool.peak_used, 6)

  def test_refs_free_only_at_zero(self):
    pool = BlockAccounting(4, 16)
    ids = pool.allocate(2)
    pool.change_refs(np.array([ids[0], ids[0]]), 1)  # repeats add up
    self.assertEqual(int(pool.ref_count[ids[0]]), 3)
    pool.change_refs(np.array([ids[0]]), -2)
    self.assertEqual(pool.num_free, 2)
    pool.change_refs(np.array([ids[0]]), -1)
    self.assertEqual(pool.num_free, 3)
    with self.assertRaisesRegex(RuntimeError, "underflow"):
      pool.change_refs(np.array([ids[0]]), -1)

  def test_limited_and_unlimited(self):
    limited = BlockAccounting(4, 16)
    self.assertIsNone(limited.allocate(5))
    self.assertEqual(limited.num_free, 4)
    unlimited = BlockAccounting(None, 16)
    ids = unlimited.allocate(70_000)
    self.assertLen(np.unique(ids), 70_000)
    self.assertGreaterEqual(unlimited.num_blocks, 70_000)

  def test_fresh_segments(self):
    pool = BlockAccounting(8, 16)
    segs = pool.fresh_segments(40)
    np.testing.assert_array_equal(segs, [[0, 0, 16], [1, 0, 16], [2, 0, 8]])
    self.assertEqual(pool.fresh_segments(0).shape, (0, 3))
    self.assertIsNone(pool.fresh_segments(6 * 16))


class ReplayTest(parameterized.TestCase):

  def test_unlimited_equals_exact_bound(self):
    trace = session_trace(seed=1, num=80, num_sessions=6, partial=True)
    result = replay_sim(trace, ReplayConfig(capacity_tokens=0, label="t"))
    hit, total = traces.exact_hit_bound(trace)
    self.assertEqual((result.hit_tokens, result.prompt_tokens), (hit, total))
    self.assertEqual((result.num_requests, result.rejected, result.evicted_tokens), (80, 0, 0))
    self.assertLen(result.match_s, 80)
    self.assertAlmostEqual(result.hit_rate, hit / total)

  @parameterized.named_parameters(("lru", "lru"), ("cost", "cost"))
  def test_limited_capacity_evicts_and_keeps_accounting(self, policy):
    trace = session_trace(seed=2, num=80, num_sessions=6, partial=True)
    bound, _ = traces.exact_hit_bound(trace)
    config = ReplayConfig(capacity_tokens=12 * BLOCK, policy=policy)
    result = replay_sim(trace, config)  # checks pool refs == cache refs at the end
    self.assertGreater(result.evicted_tokens, 0)
    self.assertGreater(result.eviction_calls, 0)
    self.assertLess(result.hit_tokens, bound)
    self.assertLessEqual(result.peak_blocks, 12 * BLOCK // 16)

  def test_request_larger_than_pool_is_rejected(self):
    trace = [TraceRequest(0.0, BLOCK, 1, np.array([0], np.int64)),
             TraceRequest(1.0, 4 * BLOCK, 1, np.array([0, 1, 2, 3], np.int64)),
             TraceRequest(2.0, 2 * BLOCK, 1, np.array([0, 5], np.int64))]
    result = replay_sim(trace, ReplayConfig(capacity_tokens=3 * BLOCK))
    self.assertEqual(result.rejected, 1)
    self.assertEqual(result.hit_tokens, BLOCK)  # only the third hits (block 0)

  def test_insert_output_costs_capacity(self):
    trace = session_trace(seed=3, num=60, num_sessions=6)
    plain = replay_sim(trace, ReplayConfig(capacity_tokens=0))
    with_output = replay_sim(trace, ReplayConfig(capacity_tokens=0, insert_output=True))
    outputs = sum(r.output_length for r in trace)
    self.assertEqual(with_output.hit_tokens, plain.hit_tokens)  # unique ids never match
    self.assertGreaterEqual(with_output.peak_blocks, plain.peak_blocks + outputs // 16)

  def test_serve_request_step_by_step(self):
    trace = [TraceRequest(0.0, 2 * BLOCK, 1, np.array([0, 1], np.int64)),
             TraceRequest(3.0, 3 * BLOCK, 1, np.array([0, 1, 2], np.int64))]
    sim = SimState(trace, ReplayConfig(capacity_tokens=0))
    result = ReplayResult("t", 0)
    serve_request(sim, trace[0], result)
    self.assertEqual(result.hit_tokens, 0)
    sim.check_accounting()
    serve_request(sim, trace[1], result)
    self.assertEqual((result.hit_tokens, sim.now), (2 * BLOCK, 3.0))
    sim.check_accounting()
    self.assertEqual(int(sim.pool.ref_count.sum()), 3 * BLOCK // 16)

  def test_replay_of_written_files(self):
    trace = session_trace(seed=4, num=40, partial=True)
    path = write_mooncake(tmp_file(self, "t.jsonl"), trace)
    from_file = replay_sim(traces.load_trace(path), ReplayConfig(capacity_tokens=0))
    in_memory = replay_sim(trace, ReplayConfig(capacity_tokens=0))
    self.assertEqual(from_file.hit_tokens, in_memory.hit_tokens)
    csv = write_azure(tmp_file(self, "t.csv"), trace)
    azure = replay_sim(traces.load_trace(csv), ReplayConfig(capacity_tokens=8 * BLOCK))
    self.assertEqual(azure.hit_tokens, 0)  # no prefix information
    self.assertEqual(azure.prompt_tokens, in_memory.prompt_tokens)

  def test_progress_wraps_the_requests(self):
    seen = []

    def progress(items):
      for x in items:
        seen.append(x)
        yield x

    trace = session_trace(seed=5, num=10)
    replay_sim(trace, ReplayConfig(capacity_tokens=0), progress=progress)
    self.assertLen(seen, 10)

  def test_invalid_config(self):
    with self.assertRaises(ValueError):
      ReplayConfig(capacity_tokens=-1)
    with self.assertRaises(ValueError):
      ReplayConfig(capacity_tokens=0, block_size=0)


if __name__ == "__main__":
  absltest.main()
