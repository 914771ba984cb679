"""Governance in the scheduler: watermark quotas at admission and eviction, two-phase GC."""

from __future__ import annotations

import dataclasses

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core.errors import InvalidArgument
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.cache.governance import CacheGovernance
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.sim.workload import ChatShape, ChatWorkload
from paged_kv.telemetry import metrics

CFG = paged_kv.PoolConfig(num_blocks=128, block_size=8, num_layers=1, num_kv_heads=1, head_dim=2,
                          dtype="float32", max_seqs=6, max_segments=24)


def _requests(seed: int, n: int, shared: int = 40) -> list[Request]:
  """A partial share of the system prompt, then a suffix of ids the prompt never uses."""
  return ChatWorkload(ChatShape(system_len=shared, shared_lens=(1, shared), own_lens=(8, 60),
                                output_lens=(1, 16), vocab=(0, 1000), own_vocab=(1000, 5000)),
                      seed).requests(n)


def _run(governance, reqs, *, max_batch=6, check_every=1):
  clock = [0.0]
  sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG),
                    SchedulerConfig(max_batch=max_batch, compaction=None, governance=governance,
                                    output_reserve_ratio=0.0), clock=lambda: clock[0])
  for r in reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    sched.step()
    clock[0] += 1.0
    steps += 1
    if steps % check_every == 0:
      sched.check_invariants()
  return sched


class QuotaTest(absltest.TestCase):

  def test_live_quota_holds_admission_yet_everything_finishes(self):
    reqs = _requests(0, 40)
    sched = _run(CacheGovernance(live_fraction=0.3, max_step=2), reqs, check_every=3)
    self.assertEqual(sched.stats.finished, 40)
    self.assertGreater(sched.stats.quota_holds, 0)
    plain = _run(None, _requests(0, 40), check_every=10)
    self.assertEqual(plain.stats.quota_holds, 0)
    # Held requests waited: more of them were delayed than without the quota.
    delayed = lambda s: sum(r.admit_step > r.submit_step for r in s.finished)
    self.assertGreater(delayed(sched), delayed(plain))

  @pytest.mark.slow
  def test_cached_blocks_above_the_cached_quota_are_evicted(self):
    gov = CacheGovernance(live_fraction=0.8, max_step=1)
    reqs = _requests(1, 30, shared=8)
    sched = _run(gov, reqs, max_batch=2)
    self.assertGreater(sched.stats.quota_evicted_blocks, 0)
    # After the run, once the next step governs, the cache holds at most its quota
    # (live borrowed nothing back: nothing runs).
    quota = gov.quota(CFG.num_blocks - CFG.num_base_blocks)
    sched.submit(Request("probe", np.array([7, 8, 9]), 1))
    sched.step()
    fig = metrics.step_stats(sched.pool.state, CFG)
    self.assertLessEqual(fig.cached_blocks, quota.cached_quota + quota.max_step)

  @pytest.mark.slow
  def test_a_tiny_quota_never_stalls(self):
    sched = _run(CacheGovernance(live_fraction=0.01), _requests(2, 20))
    self.assertEqual(sched.stats.finished, 20)

  def test_bad_policies_are_refused(self):
    for kw in (dict(gc_ttl=-1.0), dict(gc_every=0), dict(live_fraction=0.0),
               dict(low_watermark=0.9, high_watermark=0.5), dict(max_step=0)):
      with self.assertRaises(InvalidArgument, msg=kw):
        CacheGovernance(**kw)
    with self.assertRaises(InvalidArgument):
      SchedulerConfig(governance="on")


class GcTest(absltest.TestCase):

  def test_marked_idle_nodes_go_first_highest_address_first(self):
    cfg = dataclasses.replace(CFG, max_segments=128)
    gov = CacheGovernance(quotas=False, gc_ttl=5.0, gc_every=1)
    clock = [0.0]
    sched = Scheduler(paged_kv.BlockPool(cfg), DryExecutor(cfg),
                      SchedulerConfig(max_batch=2, compaction=None, governance=gov,
                                      output_reserve_ratio=0.0), clock=lambda: clock[0])
    rng = np.random.default_rng(3)

    def serve(prompt):
      sched.submit(Request(len(sched.finished), prompt, 1))
      while not sched.idle:
        sched.step()
        clock[0] += 1.0

    old = [rng.integers(1000 * i, 1000 * i + 999, 40) for i in range(3)]
    for p in old:  # served in order: lowest-first allocation puts old[2] highest
      serve(p)
    clock[0] += 100.0  # the old prompts sit idle past the TTL
    fresh = rng.integers(5000, 6000, 40)
    serve(fresh)
    cache = sched.cache
    self.assertEqual([cache.match("default", p).length for p in old + [fresh]], [40] * 4)
    # Pressure for a few blocks: 110 prompt blocks + 1 while 108 are free. GC-marked
    # nodes go first, highest address first: old[2], where LRU would take old[0].
    serve(rng.integers(7000, 8000, 8 * 110))
    sched.check_invariants()
    self.assertGreater(sched.stats.gc_marked_nodes, 0)
    self.assertGreater(sched.stats.gc_evicted_tokens, 0)
    left = [cache.match("default", p).length for p in old + [fresh]]
    self.assertLess(left[2], 40, left)
    self.assertEqual(left[0], 40, left)
    self.assertEqual(left[3], 40, left)


if __name__ == "__main__":
  absltest.main()
