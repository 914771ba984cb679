"""A seeded stateful fuzz of the scheduler: random configs, random request streams, pressure.

Each case draws a pool (block size, size, base region, scrubbing) and a scheduler
config (batch, prefill budget and chunk, recompute or swap preemption, tail packing,
compaction on/off with a random policy, promotion into the base pool, reserve ratio,
watermark, eviction policy), then a stream of requests over three namespaces whose
prompts share prefixes *with the same token ids across namespaces*, arriving a few per
step into a pool small enough to evict and preempt. A `kv_tags.TaggingExecutor` writes
K/V that encode (tenant, token, position). After every step:

* `sched.check_invariants()` (pool + cache references);
* every running sequence and every cache node reads back its tags bit-exact through
  its segments (so a reused prefix holds the values its tokens were computed with, in
  its own namespace, after packing, compaction, promotion, swap and recompute);
* with scrubbing, every slot handed out reads zero first and every slot not handed out
  holds zeros.

At the end the queue drains, the cache is evicted, and the pool is 100% free with
every reference count 0.

Scale: `PAGED_KV_FUZZ=N` runs N cases (CI: 3, well under a minute);
`PAGED_KV_FUZZ_SECONDS=S` stops starting new cases after S seconds;
`PAGED_KV_FUZZ_SEED=K` shifts the seeds. A failure names its seed and config; rerun one
case with `PAGED_KV_FUZZ=1 PAGED_KV_FUZZ_SEED=<seed>`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact
from paged_kv.serving import Request, Scheduler, SchedulerConfig
from tests.serving import kv_tags

NAMESPACES = ("alpha", "beta", 3)
_TENANT = {ns: i for i, ns in enumerate(NAMESPACES)}
_CASES = int(os.environ.get("PAGED_KV_FUZZ", "0") or 0) or 3
_SECONDS = float(os.environ.get("PAGED_KV_FUZZ_SECONDS", "0") or 0)
_SEED = int(os.environ.get("PAGED_KV_FUZZ_SEED", "0") or 0)


def tenant_of(namespace) -> int:
  return _TENANT[namespace]


@dataclasses.dataclass
class Case:
  seed: int
  pool: paged_kv.PoolConfig
  sched: SchedulerConfig
  num_requests: int
  max_new_tokens: int = 12


def draw_case(seed: int) -> Case:
  """A random pool and scheduler config (from a few pool shapes, to bound compiles)."""
  rng = np.random.default_rng(seed)
  # Every third case is a pressure case: 16-20 blocks of 8, no output reserve,
  # outputs up to 40 tokens, so running sequences outgrow the pool and get preempted.
  pressure = seed % 3 == 2  # so the 3 CI cases include one
  bs = 8 if pressure else int(rng.choice([4, 8]))
  num_blocks = int(rng.choice([16, 20])) if pressure else int(rng.choice([16, 24, 40]))
  max_seqs = int(rng.choice([4, 6]))
  pool = paged_kv.PoolConfig(
      num_blocks=num_blocks, block_size=bs, num_layers=1, num_kv_heads=1,
      head_dim=kv_tags.TAG_DIM, max_seqs=max_seqs, max_segments=24,
      base_pool_fraction=float(rng.choice([0.0, 0.15])),
      scrub_freed_blocks=bool(rng.integers(2)))
  compaction = None
  if rng.integers(3):
    compaction = compact.CompactionPolicy(
        threshold=float(rng.choice([0.0, 0.2, 0.35, 0.6])), budget=int(rng.integers(1, 9)),
        strategy=str(rng.choice(list(compact.STRATEGIES))))
  sched = SchedulerConfig(
      max_batch=max_seqs if pressure else int(rng.integers(1, max_seqs + 1)),
      # Without the cache's blocks to evict first, pressure preempts at once.
      enable_prefix_cache=not (pressure and rng.integers(2)),
      prefill_token_budget=int(rng.integers(4, 33)),
      prefill_chunk=int(rng.choice([4, 8, 16])),
      preemption=str(rng.choice(["recompute", "swap"])),
      evict_policy=str(rng.choice(["lru", "cost"])),
      pack_tails=bool(rng.integers(2)),
      compaction=compaction,
      promote_readers=int(rng.choice([0, 2, 3])) if pool.num_base_blocks else 0,
      promote_every=int(rng.integers(1, 9)),
      output_reserve_ratio=0.0 if pressure else float(rng.choice([0.0, 0.5, 1.0])),
      watermark_blocks=int(rng.integers(0, 3)),
      snapshot_every=int(rng.choice([0, 1, 5])))
  return Case(seed=seed, pool=pool, sched=sched, num_requests=int(rng.integers(15, 45)),
              max_new_tokens=40 if pressure else 12)


def request_stream(rng: np.random.Generator, n: int, max_new_tokens: int = 12) -> list[Request]:
  """Requests over `NAMESPACES`; prompts share prefixes (same ids across namespaces)."""
  prefixes = [rng.integers(0, kv_tags.TOKENS_PER_TENANT, int(rng.integers(3, 20)))
              for _ in range(3)]
  out = []
  for i in range(n):
    ns = NAMESPACES[int(rng.integers(len(NAMESPACES)))]
    p = prefixes[int(rng.integers(len(prefixes)))]
    own = tenant_of(ns) * kv_tags.TOKENS_PER_TENANT
    tail = own + rng.integers(0, kv_tags.TOKENS_PER_TENANT, int(rng.integers(0, 14)))
    prompt = np.concatenate([p[:int(rng.integers(1, p.size + 1))], tail])
    out.append(Request(f"r{i}", prompt, max_new_tokens=int(rng.integers(1, max_new_tokens + 1)),
                       namespace=ns))
  return out


@dataclasses.dataclass
class Totals:
  cases: int = 0
  steps: int = 0
  requests: int = 0
  refused: int = 0
  tokens_checked: int = 0
  preemptions: int = 0
  evictions: int = 0
  compactions: int = 0
  pack_moves: int = 0
  promotions: int = 0


def run_case(case: Case, totals: Totals) -> None:
  """One case to its drain; raises on any violation."""
  rng = np.random.default_rng(case.seed + 1_000_003)
  pool = paged_kv.BlockPool(case.pool)
  executor = kv_tags.TaggingExecutor(case.pool, tenant_of)
  clock = [0.0]
  sched = Scheduler(pool, executor, case.sched, clock=lambda: clock[0])
  executor.sched = sched
  pending = request_stream(rng, case.num_requests, case.max_new_tokens)
  accepted = 0
  steps = 0
  while pending or not sched.idle:
    for _ in range(int(rng.integers(0, 4))):
      if pending:
        req = pending.pop(0)
        try:
          sched.submit(req)
          accepted += 1
        except paged_kv.PoolExhausted:
          totals.refused += 1  # cannot fit even an empty pool: a typed refusal
    if sched.idle:
      continue
    sched.step()
    steps += 1
    clock[0] += 1.0
    if steps > 20_000:
      raise AssertionError("no progress after 20000 steps")
    sched.check_invariants()
    totals.tokens_checked += kv_tags.check_tags(sched, tenant_of)
    if case.pool.scrub_freed_blocks:
      kv_tags.check_clear_slots_zero(pool)
  assert sched.stats.finished == accepted, (sched.stats.finished, accepted)
  # Drain: evict the whole cache; the pool is 100% free, every count 0.
  sched.cached_pool.evict(num_blocks=case.pool.num_blocks)
  cache = sched.cached_pool.cache
  assert cache is None or len(cache.tree) == 0, len(cache.tree)
  ref_count = np.asarray(pool.state.meta.ref_count)
  assert not ref_count.any(), np.flatnonzero(ref_count)
  assert pool.num_free_blocks == case.pool.num_blocks - case.pool.num_base_blocks
  assert not np.asarray(pool.state.table.active).any()
  sched.check_invariants()
  if case.pool.scrub_freed_blocks:
    assert not np.any(np.asarray(pool.state.pages.k)), "a freed block kept K/V"
  totals.cases += 1
  totals.steps += steps
  totals.requests += accepted
  totals.preemptions += sched.stats.preemptions
  totals.evictions += sched.stats.evictions
  totals.compactions += sched.stats.compactions
  totals.pack_moves += sched.counters.pack_moves
  totals.promotions += sched.counters.promotions


class SchedulerFuzzTest(absltest.TestCase):

  def test_random_configs_and_streams_keep_invariants_and_kv_tags(self):
    totals = Totals()
    failures = []
    t0 = time.monotonic()
    for seed in range(_SEED, _SEED + _CASES):
      if _SECONDS and time.monotonic() - t0 > _SECONDS:
        break
      case = draw_case(seed)
      try:
        run_case(case, totals)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"seed {seed}: {type(e).__name__}: {e}\n  pool={case.pool}\n  "
                        f"sched={case.sched}\n{traceback.format_exc(limit=6)}")
    elapsed = time.monotonic() - t0
    print(f"\nscheduler fuzz: {totals} in {elapsed:.0f} s; {len(failures)} failing case(s)")
    for f in failures:
      print(f)
    self.assertEqual(failures, [])


if __name__ == "__main__":
  absltest.main()
