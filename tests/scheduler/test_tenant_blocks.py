"""Tenant isolation by block: by default a physical block holds one namespace's tokens.

A mixed-tenant run with tail packing (three namespaces whose prompts share token ids,
short tails packed into slotted blocks) counts, after every step, the namespaces of
the holders of every block (cache nodes and running rows): no block ever has two.
With `SchedulerConfig(mix_namespaces=True)` (the opt-in) blocks with two or more
appear, which is what packing across tenants gains: the cache's blocks at the end are
printed and compared for no packing, packing by namespace, and mixed packing. A save
and restore lays the cache out the same way (`load_prefix_cache`'s `mix_namespaces`).
"""

from __future__ import annotations

import collections
import os
import tempfile

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.cache import persist
from radix.cache import PrefixCache
from tests.scheduler import kv_tags

# A mixed-tenant run, three times.
pytestmark = pytest.mark.slow

NAMESPACES = ("alpha", "beta", 3)
TENANT = {ns: i for i, ns in enumerate(NAMESPACES)}
POOL = paged_kv.PoolConfig(num_blocks=48, block_size=8, num_layers=1, num_kv_heads=1,
                           head_dim=kv_tags.TAG_DIM, max_seqs=6, max_segments=16)


def block_namespaces(cache, pool, running) -> dict[int, set]:
  """block -> the namespaces of the cache nodes and running rows holding it."""
  out = collections.defaultdict(set)
  if cache is not None:
    for node in cache.tree.nodes():
      for b in node.value[:, 0].tolist():
        out[b].add(node.namespace)
  host = pool.host
  for r in running:
    n = int(host.num_segments[r.seq_id])
    for b in host.block[r.seq_id, :n].tolist():
      out[b].add(r.namespace)
  return out


def serve(config: SchedulerConfig) -> tuple[Scheduler, int]:
  """Runs the mixed-tenant stream; returns the scheduler and the most blocks that
  held two or more namespaces after any step."""
  rng = np.random.default_rng(7)
  pool = paged_kv.BlockPool(POOL)
  executor = kv_tags.TaggingExecutor(POOL, TENANT.get)
  clock = [0.0]
  sched = Scheduler(pool, executor, config, clock=lambda: clock[0])
  executor.sched = sched
  shared = rng.integers(0, 1000, 6)
  pending = []
  for i in range(21):
    ns = NAMESPACES[i % 3]
    own = TENANT[ns] * kv_tags.TOKENS_PER_TENANT + rng.integers(0, 1000, int(rng.integers(1, 7)))
    prompt = np.concatenate([shared[:int(rng.integers(1, 7))], own])
    pending.append(Request(f"r{i}", prompt, max_new_tokens=int(rng.integers(1, 6)),
                           namespace=ns))
  mixed = 0
  while pending or not sched.idle:
    for _ in range(3):
      if pending:
        sched.submit(pending.pop(0))
    sched.step()
    clock[0] += 1.0
    held = block_namespaces(sched.cache, pool, sched.running)
    mixed = max(mixed, sum(len(v) > 1 for v in held.values()))
  sched.check_invariants()
  kv_tags.check_tags(sched, TENANT.get)
  return sched, mixed


def cache_blocks(sched: Scheduler) -> int:
  return len(np.unique(sched.cache.segment_refs()[:, 0]))


class TenantBlocksTest(absltest.TestCase):

  def test_no_block_holds_two_namespaces_unless_mixing_is_asked(self):
    base = dict(max_batch=6, prefill_token_budget=64, prefill_chunk=16, pack_tails=True,
                compaction=None)
    plain, plain_mixed = serve(SchedulerConfig(**{**base, "pack_tails": False}))
    apart, apart_mixed = serve(SchedulerConfig(**base))
    mixed, mixed_mixed = serve(SchedulerConfig(**base, mix_namespaces=True))
    print(f"\ncache blocks at the end: no packing {cache_blocks(plain)}, packing by "
          f"namespace {cache_blocks(apart)} ({apart.stats.pack_moves} moves), mixed "
          f"{cache_blocks(mixed)} ({mixed.stats.pack_moves} moves); most blocks with "
          f"2+ namespaces: {plain_mixed}, {apart_mixed}, {mixed_mixed}")
    self.assertEqual(plain_mixed, 0)
    self.assertEqual(apart_mixed, 0)
    self.assertGreater(mixed_mixed, 0)  # the count can see a mixed block
    self.assertGreater(apart.stats.pack_moves, 0)
    self.assertLess(cache_blocks(apart), cache_blocks(plain))  # packing still gains
    self.assertLessEqual(cache_blocks(mixed), cache_blocks(apart))
    # A save and restore lays the cache out by namespace too (unless asked to mix).
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "cache.pkv")
      mixed.cached_pool.save(path)
      for mix, want_mixed in ((False, False), (True, True)):
        pool = paged_kv.BlockPool(POOL)
        cache = persist.load_prefix_cache(path, pool, PrefixCache(block_size=8),
                                          mix_namespaces=mix)
        held = block_namespaces(cache, pool, [])
        self.assertEqual(any(len(v) > 1 for v in held.values()), want_mixed, mix)


if __name__ == "__main__":
  absltest.main()
