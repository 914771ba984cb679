"""The scheduler's per-step telemetry: cheap pool figures, reports, latencies, no host copies."""

from __future__ import annotations

import dataclasses

import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.scheduler import scheduler as scheduler_mod
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig, StepReport
from paged_kv.sim.workload import ChatShape, ChatWorkload
from paged_kv.telemetry import metrics
from tests.testutil import HostTransfers

CFG = paged_kv.PoolConfig(num_blocks=512, block_size=8, num_layers=1, num_kv_heads=1, head_dim=2,
                          dtype="float32", max_seqs=4, max_segments=32)


def _requests(seed: int, n: int) -> list[Request]:
  return ChatWorkload(ChatShape(system_len=120, shared_lens=(4, 120), own_lens=(1, 60),
                                output_lens=(1, 24), vocab=(0, 1000)), seed).requests(n)


class FakeClock:
  """Advances by `tick` seconds on every read, so every latency is a known count of reads."""

  def __init__(self, tick: float = 0.5):
    self.now, self.tick = 0.0, tick

  def __call__(self) -> float:
    self.now += self.tick
    return self.now


@pytest.mark.slow
class StepStatsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("dynamic_only", CFG, {}),
      # A base region that promotion fills: free base blocks count as free.
      ("with_base_region", dataclasses.replace(CFG, base_pool_fraction=0.125),
       dict(promote_readers=2, promote_every=3)))
  def test_step_stats_agree_with_the_full_snapshot(self, cfg, extra):
    pool = paged_kv.BlockPool(cfg)
    sched = Scheduler(pool, DryExecutor(cfg), SchedulerConfig(max_batch=4, compaction=None,
                                                              **extra))
    for r in _requests(0, 40):
      sched.submit(r)
    checked = 0
    while not sched.idle:
      sched.step()
      if sched.stats.steps % 7:
        continue
      fig = metrics.step_stats(pool.state, cfg)
      snap = metrics.snapshot(pool.state, cfg, extra_segments=sched.extra_segments())
      self.assertEqual(fig.free_blocks, snap.num_free_blocks)
      self.assertEqual(fig.cached_blocks, snap.cached_only_blocks)
      self.assertEqual(fig.used_blocks, snap.live_blocks)
      self.assertAlmostEqual(fig.kv_usage_ratio, snap.kv_usage_ratio)
      self.assertAlmostEqual(fig.fragmentation_ratio, snap.fragmentation_ratio, places=6)
      self.assertEqual(fig.largest_contiguous_free_bytes, snap.largest_contiguous_free_bytes)
      checked += 1
    self.assertGreater(checked, 3)
    # A warm cache on an idle pool: its blocks are cached (evictable), not used.
    idle = metrics.step_stats(pool.state, cfg)
    self.assertGreater(idle.cached_blocks, 0)
    self.assertEqual(idle.used_blocks, 0)
    self.assertEqual(idle.kv_usage_ratio, 0.0)
    self.assertGreater(metrics.snapshot(pool.state, cfg).block_pool_utilization, 0.0)
    if extra:
      self.assertGreater(sched.stats.promotions, 0)


class StepReportTest(absltest.TestCase):

  def _run(self, config: SchedulerConfig, n: int = 12, seed: int = 1):
    clock = FakeClock()
    reports: list[StepReport] = []
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG), config, clock=clock, on_step=reports.append)
    reqs = _requests(seed, n)
    for r in reqs:
      sched.submit(r)
    sched.run()
    return sched, reqs, reports

  def test_reports_carry_finished_requests_and_latencies(self):
    sched, reqs, reports = self._run(SchedulerConfig(max_batch=4, compaction=None))
    self.assertEqual([r.step for r in reports], list(range(sched.stats.steps)))
    finished = [req for rep in reports for req in rep.finished]
    self.assertCountEqual([id(r) for r in finished], [id(r) for r in reqs])
    ttft = sorted(x for rep in reports for x in rep.first_token_latencies)
    self.assertEqual(ttft, sorted(r.first_token_time - r.submit_time for r in reqs))
    itl = [x for rep in reports for x in rep.inter_token_latencies]
    self.assertLen(itl, sum(len(r.output) - 1 for r in reqs))
    self.assertTrue(all(x > 0 for x in itl + ttft))
    for r in reqs:
      self.assertLessEqual(r.submit_time, r.admit_time)
      self.assertLess(r.admit_time, r.first_token_time)
      self.assertLessEqual(r.first_token_time, r.finish_time)
      self.assertEqual(r.last_token_time, r.finish_time if len(r.output) else -1.0)
    last = reports[-1]
    self.assertEqual((last.num_running, last.num_waiting, last.num_swapped), (0, 0, 0))
    self.assertIs(last.stats, sched.stats)
    self.assertTrue(all(rep.pool is not None for rep in reports))  # stats_every=1
    self.assertTrue(all(rep.host_seconds >= 0 for rep in reports))

  def test_full_snapshots_are_periodic_and_stats_optional(self):
    sched, _, reports = self._run(SchedulerConfig(max_batch=4, compaction=None,
                                                  snapshot_every=3, stats_every=0))
    with_snap = [rep.step for rep in reports if rep.snapshot is not None]
    self.assertEqual(with_snap, [s for s in range(len(reports)) if s % 3 == 0])
    self.assertLen(sched.snapshots, len(with_snap))
    self.assertTrue(all(rep.pool is None for rep in reports))
    self.assertIsInstance(sched.take_snapshot(), metrics.PoolSnapshot)

  @pytest.mark.slow
  def test_stats_budget_paces_the_figures(self):
    # A budget no reduction can meet: the figures on the first step, then every
    # MAX_STATS_INTERVAL steps.
    sched, _, reports = self._run(SchedulerConfig(max_batch=4, compaction=None,
                                                  stats_budget=1e-9), n=30)
    interval = scheduler_mod.MAX_STATS_INTERVAL
    self.assertEqual(sched.stats_interval, interval)
    self.assertGreater(len(reports), 2)
    self.assertEqual([r.step for r in reports if r.pool is not None],
                     list(range(0, len(reports), interval)))
    # The whole step as budget: the figures cost less than the rest of a step here.
    sched, _, reports = self._run(SchedulerConfig(max_batch=4, compaction=None,
                                                  stats_budget=1.0, stats_every=2))
    self.assertIsNotNone(reports[0].pool)
    self.assertGreaterEqual(sched.stats_interval, 2)
    for bad in (0.0, -0.1, 1.5, True, "0.02"):
      with self.assertRaises(paged_kv.InvalidArgument):
        SchedulerConfig(stats_budget=bad)

  @pytest.mark.slow
  def test_alerts_fire_in_the_step_they_cross(self):
    # A tiny pool that live sequences fill: KV usage crosses 0.95 and the alert
    # reaches the report of that very step (not only the end of the run).
    cfg = paged_kv.PoolConfig(num_blocks=24, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, dtype="float32", max_seqs=4, max_segments=16)
    reports = []
    pool = paged_kv.BlockPool(cfg)
    sched = Scheduler(pool, DryExecutor(cfg),
                      SchedulerConfig(max_batch=4, compaction=None, output_reserve_ratio=0.0,
                                      snapshot_every=0), on_step=reports.append)
    rng = np.random.default_rng(3)
    for i in range(8):
      sched.submit(Request(i, rng.integers(0, 1000, 40), 16))
    sched.run()
    fired = [(rep.step, a.metric) for rep in reports for a in rep.alerts]
    usage = [rep.step for rep in reports if rep.pool.kv_usage_ratio > 0.95]
    self.assertTrue(usage, "the workload should fill the pool")
    self.assertIn((usage[0], "kv_usage_ratio"), fired)
    self.assertEqual([a.metric for a in sched.alerts], [m for _, m in fired])


class CowSplitsTest(absltest.TestCase):
  """`stats.cow_splits` counts the rows that opened on a copy of a shared partial tail."""

  def test_a_continued_turn_copies_the_cached_partial_tail_once(self):
    cfg = paged_kv.PoolConfig(num_blocks=32, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=16)
    reports = []
    sched = Scheduler(paged_kv.BlockPool(cfg), DryExecutor(cfg),
                      SchedulerConfig(max_batch=4, prefill_chunk=16, prefill_token_budget=32,
                                      compaction=None), on_step=reports.append)
    first = Request("a", list(range(1, 22)), 3)  # 24 tokens cached: 2 blocks + 7 in a third
    sched.submit(first)
    sched.run()
    self.assertEqual(sched.stats.cow_splits, 0)
    full = Request("b", list(range(1, 17)), 2)  # only whole cached blocks: nothing to copy
    sched.submit(full)
    sched.run()
    self.assertEqual(sched.stats.cow_splits, 0)
    turn = Request("c", list(range(1, 22)) + list(first.output) + [5, 6], 3)
    sched.submit(turn)
    sched.run()
    self.assertEqual(turn.hit_tokens, 23)  # its prefix ends in the cached partial tail
    self.assertEqual(sched.stats.cow_splits, 1)
    self.assertEqual(reports[-1].stats.cow_splits, 1)
    sched.check_invariants()


@pytest.mark.slow
class NoPerBlockHostReadsTest(absltest.TestCase):
  """A scheduler step copies nothing of per-block size to the host (issue L)."""

  def test_steps_read_only_batch_sized_arrays(self):
    probe = HostTransfers()
    if not probe.available:
      self.skipTest("this JAX's array type has no patchable host-read hooks")
    cfg = paged_kv.PoolConfig(num_blocks=512, block_size=16, num_layers=1, num_kv_heads=1,
                              head_dim=2, dtype="float32", max_seqs=4, max_segments=48)
    pool = paged_kv.BlockPool(cfg, debug=False)  # debug mode compares everything, by design
    # Prefix cache with eviction under pressure, recompute preemption, cheap stats
    # every step; the periodic full snapshot off (it copies every block by design).
    sched = Scheduler(pool, DryExecutor(cfg),
                      SchedulerConfig(max_batch=4, compaction=None, snapshot_every=0,
                                      output_reserve_ratio=0.0))
    chat = ChatWorkload(ChatShape(system_len=400, shared_lens=(8, 400), own_lens=(1, 300),
                                  output_lens=(1, 32), vocab=(0, 1000)), seed=0)
    for r in chat.requests(400):
      sched.submit(r)
    for _ in range(10):  # warm-up: compile everything first
      sched.step()
    with probe:
      for _ in range(300):
        sched.step()
    self.assertGreater(sched.stats.evictions, 0, "the workload must exercise eviction")
    self.assertGreater(len(probe.sizes), 0, "the probe must see the scalar reads")
    table = cfg.max_seqs * cfg.max_segments
    self.assertLess(table, cfg.num_blocks)
    self.assertEqual(probe.at_least(cfg.num_blocks), 0,
                     f"per-block host reads: {sorted(set(probe.sizes))[-5:]}")


if __name__ == "__main__":
  absltest.main()
