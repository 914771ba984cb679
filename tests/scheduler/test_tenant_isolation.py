"""Tenant isolation as a property: two tenants' tagged K/V through a scheduler under pressure.

Two namespaces submit requests whose prompts share a system prompt *with the same token
ids* in both tenants; a `TaggingExecutor` writes K/V that encode (tenant, token,
position). With scrubbing, tail packing (slotted blocks), compaction, eviction and
preemption under a small pool, after every step:

* every slot a live sequence of either tenant reads through its segments, and every
  slot a cache node of that tenant holds, carries exactly its own tags (never the other
  tenant's, never stale data);
* every slot handed out to a sequence reads zero before its new owner writes it, and
  every slot not handed out (bit clear, or a free block) holds zeros;
* the invariants hold; at the end the pool drains to 100% free.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.core import compact
from paged_kv.scheduler import Request, Scheduler, SchedulerConfig
from tests.scheduler import kv_tags

pytestmark = pytest.mark.slow

TENANTS = {"tenant-a": 0, "tenant-b": 1}


def tenant_of(namespace) -> int:
  return TENANTS[namespace]


def _config() -> paged_kv.PoolConfig:
  return paged_kv.PoolConfig(num_blocks=24, block_size=4, num_layers=1, num_kv_heads=1,
                             head_dim=kv_tags.TAG_DIM, max_seqs=4, max_segments=16,
                             scrub_freed_blocks=True)


def _requests(rng: np.random.Generator, n: int) -> list[Request]:
  system = rng.integers(0, kv_tags.TOKENS_PER_TENANT, 7)  # same ids in both tenants
  out = []
  for i in range(n):
    ns = ("tenant-a", "tenant-b")[i % 2]
    own = tenant_of(ns) * kv_tags.TOKENS_PER_TENANT
    tail = own + rng.integers(0, kv_tags.TOKENS_PER_TENANT, int(rng.integers(1, 11)))
    prompt = np.concatenate([system[:int(rng.integers(3, 8))], tail])
    out.append(Request(i, prompt, max_new_tokens=int(rng.integers(1, 9)), namespace=ns))
  return out


class TenantIsolationTest(parameterized.TestCase):

  @parameterized.named_parameters(("recompute", "recompute", 0), ("swap", "swap", 1))
  def test_no_slot_readable_by_one_tenant_ever_holds_the_others_kv(self, preemption, seed):
    config = _config()
    pool = paged_kv.BlockPool(config)
    executor = kv_tags.TaggingExecutor(config, tenant_of)
    sched = Scheduler(pool, executor, SchedulerConfig(
        max_batch=4, prefill_token_budget=16, prefill_chunk=8, preemption=preemption,
        pack_tails=True, compaction=compact.CompactionPolicy(threshold=0.2, budget=4),
        output_reserve_ratio=0.0, snapshot_every=0), clock=lambda: float(sched_steps[0]))
    executor.sched = sched
    sched_steps = [0]
    rng = np.random.default_rng(seed)
    pending = _requests(rng, 40)
    checked = 0
    while pending or not sched.idle:
      for _ in range(int(rng.integers(0, 3))):
        if pending:
          sched.submit(pending.pop(0))
      if sched.idle:
        continue
      sched.step()
      sched_steps[0] += 1
      sched.check_invariants()
      checked += kv_tags.check_tags(sched, tenant_of)
      kv_tags.check_clear_slots_zero(pool)
    self.assertEqual(sched.stats.finished, 40)
    self.assertGreater(sched.stats.evictions, 0)  # the pool was under pressure
    self.assertGreater(sched.stats.pack_moves, 0)  # slotted blocks were used
    self.assertGreater(checked, 0)
    # Drain: the cache lets go of everything, the pool is 100% free and all zeros.
    sched.cached_pool.evict(num_blocks=config.num_blocks)
    self.assertEqual(len(sched.cached_pool.cache.tree), 0)
    self.assertEqual(int(np.asarray(pool.state.meta.ref_count).sum()), 0)
    self.assertEqual(pool.num_free_blocks, config.num_blocks - config.num_base_blocks)
    self.assertFalse(np.any(np.asarray(pool.state.pages.k)))
    self.assertFalse(np.any(np.asarray(pool.state.pages.v)))
    sched.check_invariants()


if __name__ == "__main__":
  absltest.main()
