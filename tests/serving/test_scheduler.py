"""Scheduler in dry mode: invariants after every step, under pressure, both preemption modes."""

import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core import compact
from paged_kv.serving.cached_pool import CachedPool, CacheView
from paged_kv.serving.scheduler import DryExecutor, Phase, Request, Scheduler, SchedulerConfig
from radix.cache import PrefixCache

CFG = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=8, max_segments=40)


def _workload(seed, n=24, shared=10):
  rng = np.random.default_rng(seed)
  system = rng.integers(0, 100, shared)
  reqs = []
  for i in range(n):
    prompt = np.concatenate([system, rng.integers(0, 100, rng.integers(1, 30))])
    reqs.append(Request(i, prompt, int(rng.integers(1, 30)),
                        forced_output=rng.integers(100, 200, 30)))
  return reqs


def _run(sched, reqs, check=True, limit=3000):
  for r in reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    sched.step()
    if check:
      sched.check_invariants()
    steps += 1
    assert steps < limit, "scheduler made no progress"
  return steps


class SchedulerTest(parameterized.TestCase):

  @parameterized.parameters("recompute", "swap")
  def test_pressure_keeps_invariants_and_finishes_everything(self, mode):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, prefill_token_budget=32,
                                      preemption=mode, output_reserve_ratio=0.0))
    reqs = _workload(0)
    _run(sched, reqs)
    self.assertEqual(sched.stats.finished, len(reqs))
    for r in reqs:
      self.assertEqual(r.phase, Phase.FINISHED)
      np.testing.assert_array_equal(r.output, r.forced_output[:r.max_new_tokens])
    self.assertGreater(sched.stats.preemptions, 0)  # the pool is small on purpose
    if mode == "swap":
      self.assertGreater(sched.stats.swap_to_host_bytes, 0)
      self.assertEqual(sched.stats.swap_to_host_bytes, sched.stats.swap_in_bytes)
    self.assertGreater(sched.stats.hit_tokens, 0)  # the shared system prompt
    # Only the cache holds blocks at the end; evicting it all empties the pool.
    self.assertEqual(len(pool.active_sequences()), 0)
    sched._evict(CFG.num_blocks)
    self.assertEqual(pool.num_free_blocks, CFG.num_blocks)

  def test_full_output_reserve_never_preempts(self):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, prefill_token_budget=32,
                                      output_reserve_ratio=1.0))
    reqs = _workload(0)
    _run(sched, reqs)
    self.assertEqual(sched.stats.finished, len(reqs))
    self.assertEqual(sched.stats.preemptions, 0)

  def test_unlimited_pool_hits_exact_prefix_bound(self):
    cfg = paged_kv.PoolConfig(num_blocks=2048, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=8, max_segments=64)
    pool = paged_kv.BlockPool(cfg)
    sched = Scheduler(pool, DryExecutor(cfg), SchedulerConfig(max_batch=1, compaction=None))
    reqs = _workload(1, n=6)
    _run(sched, reqs)
    self.assertEqual(sched.stats.preemptions, 0)
    # Sequential requests sharing a 10-token system prompt: each later one matches
    # at least those 10 tokens (prompt[:-1] is probed).
    for r in reqs[1:]:
      self.assertGreaterEqual(r.hit_tokens, 10)
    self.assertEqual(reqs[0].hit_tokens, 0)

  def test_namespaces_do_not_share(self):
    cfg = paged_kv.PoolConfig(num_blocks=512, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=64)
    pool = paged_kv.BlockPool(cfg)
    sched = Scheduler(pool, DryExecutor(cfg), SchedulerConfig(max_batch=1))
    prompt = np.arange(20)
    a = Request("a", prompt, 3, namespace="tenant-a")
    b = Request("b", prompt, 3, namespace="tenant-b")
    c = Request("c", prompt, 3, namespace="tenant-a")
    _run(sched, [a, b, c])
    self.assertEqual((a.hit_tokens, b.hit_tokens, c.hit_tokens), (0, 0, 19))

  def test_compaction_runs_and_cache_follows_remap(self):
    pool = paged_kv.BlockPool(CFG)
    policy = compact.CompactionPolicy(threshold=0.0, budget=4)
    sched = Scheduler(pool, DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, compaction=policy))
    _run(sched, _workload(2, n=12))
    self.assertGreater(sched.stats.compactions, 0)
    self.assertGreater(sched.counters.compaction_moves, 0)

  def test_oversized_request_refused_at_submit(self):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG), SchedulerConfig(max_batch=8))
    with self.assertRaises(paged_kv.PoolExhausted):
      sched.submit(Request(0, np.arange(300), 10))
    self.assertTrue(sched.idle)


if __name__ == "__main__":
  absltest.main()


class PackTailsTest(absltest.TestCase):

  def test_pack_tails_lowers_internal_fragmentation(self):
    cfg = paged_kv.PoolConfig(num_blocks=256, block_size=8, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=8, max_segments=40)
    frag = {}
    for pack in (False, True):
      pool = paged_kv.BlockPool(cfg)
      sched = Scheduler(pool, DryExecutor(cfg),
                        SchedulerConfig(max_batch=8, prefill_chunk=16, pack_tails=pack,
                                        compaction=None))
      rng = np.random.default_rng(5)
      reqs = [Request(i, rng.integers(0, 50, int(rng.integers(1, 6))), int(rng.integers(1, 4)))
              for i in range(20)]  # short turns: every sequence is one partial block
      _run(sched, reqs)
      snap = paged_kv.telemetry.metrics.snapshot(pool.state, cfg, extra_segments=sched.extra_segments())
      frag[pack] = snap.internal_fragmentation
      if pack:
        self.assertGreater(sched.counters.pack_moves, 0)
    self.assertLess(frag[True], frag[False] / 2)


class PromotionTest(absltest.TestCase):

  def test_shared_prefix_blocks_move_to_the_base_pool(self):
    cfg = paged_kv.PoolConfig(num_blocks=128, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=8, max_segments=40, base_pool_fraction=0.25)
    pool = paged_kv.BlockPool(cfg)
    sched = Scheduler(pool, DryExecutor(cfg),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, promote_readers=3,
                                      promote_every=1))
    _run(sched, _workload(4, n=16))  # invariants after every step
    self.assertGreater(sched.counters.promotions, 0)
    refs = np.asarray(pool.state.meta.ref_count)
    self.assertTrue((refs[:cfg.num_base_blocks] > 0).any())
    # The cache now points into the base pool for the shared system prompt.
    self.assertTrue((sched.cache.segment_refs()[:, 0] < cfg.num_base_blocks).any())


class CachedPoolSchedulerTest(absltest.TestCase):
  """The scheduler over a `CachedPool`: it never applies a reference delta itself."""

  def test_runs_on_a_cached_pool(self):
    pool = paged_kv.BlockPool(CFG)
    cp = CachedPool(pool, policy="cost")
    sched = Scheduler(cp, DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, prefill_token_budget=32,
                                      output_reserve_ratio=0.0))
    self.assertIs(sched.cached_pool, cp)
    self.assertIs(sched.pool, pool)
    self.assertIsInstance(sched.cache, CacheView)
    _run(sched, _workload(3, n=12))
    self.assertGreater(sched.stats.hit_tokens, 0)
    cp.check_invariants()
    self.assertGreater(len(sched.extra_segments()), 0)
    with self.assertRaises(paged_kv.InvariantViolation):  # the pool alone misses the tree's refs
      pool.check_invariants()
    self.assertFalse(hasattr(sched, "_apply"))

  def test_cache_beside_a_cached_pool_is_refused(self):
    cp = CachedPool(paged_kv.BlockPool(CFG))
    with self.assertRaises(ValueError):
      Scheduler(cp, DryExecutor(CFG), cache=PrefixCache(block_size=CFG.block_size))

  def test_caching_off(self):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, enable_prefix_cache=False))
    self.assertIsNone(sched.cache)
    _run(sched, _workload(0, n=6))
    self.assertEqual(sched.stats.hit_tokens, 0)
    self.assertEqual(sched.extra_segments().shape, (0, 3))
    self.assertEqual(pool.num_free_blocks, CFG.num_blocks)
