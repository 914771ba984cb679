"""The counters a user reads: `RuntimeCounters` (live, or a reading of the same class) and
`SchedulerStats` (the one cumulative counters type, the pool's events included)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from paged_kv.core.errors import Status
from paged_kv.runtime import counters
from paged_kv.runtime.counters import RuntimeCounters
from paged_kv.scheduler import SchedulerStats


class RuntimeCountersTest(absltest.TestCase):

  def test_a_reading_is_fixed_and_since_is_the_difference(self):
    live = RuntimeCounters()
    live.dispatch("commit")
    live.dispatch("step", 2)
    live.read("tokens")
    before = live.snapshot()
    self.assertIsInstance(before, RuntimeCounters)
    live.dispatch("sync")
    live.read("status")
    live.deferred_checks += 1
    self.assertEqual(before.num_dispatches, 3)  # the reading did not move
    after = live.snapshot()
    delta = after.since(before)
    self.assertIsInstance(delta, RuntimeCounters)
    self.assertEqual(delta.dispatches, {"commit": 0, "step": 0, "sync": 1})
    self.assertEqual((delta.bookkeeping_dispatches, delta.blocking_reads), (1, 1))
    self.assertEqual((delta.num_host_reads, delta.deferred_checks), (1, 1))
    self.assertEqual(live.since(before).dispatches, delta.dispatches)  # live - reading

  def test_live_compiles_are_the_process_s_a_reading_s_are_fixed(self):
    live = RuntimeCounters()
    before = live.snapshot()
    self.assertEqual(live.backend_compiles, counters.backend_compiles())
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5, dtype=jnp.int32) + 17).block_until_ready()
    self.assertEqual(live.backend_compiles, counters.backend_compiles())
    self.assertGreater(live.backend_compiles, before.backend_compiles)
    self.assertEqual(live.snapshot().since(before).backend_compiles,
                     live.backend_compiles - before.backend_compiles)
    self.assertEqual(before.snapshot().backend_compiles, before.backend_compiles)


class SchedulerStatsTest(absltest.TestCase):

  def test_pool_events_count_in_the_one_counters_type(self):
    stats = SchedulerStats()
    n = stats.record_status(np.array([Status.OK, Status.NO_FREE_BLOCK, Status.TABLE_FULL]),
                            seq_lens=[3, 9, 33])
    stats.record_oom("no_free_block", seq_len=16)
    stats.record_compaction(moves=4, seconds=0.5)
    self.assertEqual(n, 2)
    self.assertEqual(stats.oom_by_reason, {"no_free_block": 2, "table_full": 1})
    self.assertEqual(stats.oom_by_seq_len, {16: 2, 64: 1})
    self.assertEqual((stats.compactions, stats.compaction_moves), (1, 4))
    # Plain dicts: `asdict` (the replicas' `stats` reply, JSONL) keeps them as they are.
    as_dict = dataclasses.asdict(stats)
    self.assertEqual(as_dict["oom_by_reason"], {"no_free_block": 2, "table_full": 1})
    self.assertEqual(as_dict["compaction_seconds"], 0.5)


if __name__ == "__main__":
  absltest.main()
