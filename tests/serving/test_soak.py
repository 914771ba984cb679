"""A soak of the Mooncake conversation trace through the scheduler, every feature on.

The trace (`../shared/traces/conversation_trace.jsonl` beside the repository; from
github.com/kvcache-ai/Mooncake, `FAST25-release/traces/conversation_trace.jsonl`) is
replayed through a `Scheduler` over a small `BlockPool` with: the prefix cache (two
tenants whose prompts use the same token ids), swap preemption under pressure, tail
packing into slotted blocks, merge compaction, promotion into the base pool,
scrubbing of freed blocks, and a `kv_tags.TaggingExecutor` that writes K/V encoding
(tenant, token, position). Lengths are divided by `TOKEN_SCALE` (the prefix
structure stays). Requests are fed to keep the queue full (pressure, not trace time).

Every `CHECK_EVERY` steps: `check_invariants()`, every running sequence and every
cache node reads back its tags bit-exact, and with scrubbing every slot not handed
out holds zeros. Every `SAVE_EVERY` steps the cache is saved to disk (persist). At
the end the queue drains, the last saved cache restores into a fresh pool (its
invariants checked), the cache is evicted whole, and the pool is 100% free: every
ref count 0, no active row, cache empty, invariants hold, no K/V left in any block.

Scale: `PAGED_KV_SOAK_SECONDS=S` replays the trace (again and again, with new request
ids) until S seconds have passed, then drains; the default (CI) replays the first
`PAGED_KV_SOAK_REQUESTS` (default 40) requests once; `PAGED_KV_SOAK_TRACE=path`
reads another Mooncake-format trace. The test skips with a reason
when the trace is not there (a clone without `../shared`).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact
from paged_kv.serving import Request, Scheduler, SchedulerConfig
from paged_kv.serving.cached_pool import CachedPool
from paged_kv.serving.traces import TokenSource, load_mooncake, scaled_prompt
from tests.serving import kv_tags

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE = os.environ.get("PAGED_KV_SOAK_TRACE") or os.path.normpath(
    os.path.join(_REPO, "..", "shared", "traces", "conversation_trace.jsonl"))
_SECONDS = float(os.environ.get("PAGED_KV_SOAK_SECONDS", "0") or 0)
_REQUESTS = int(os.environ.get("PAGED_KV_SOAK_REQUESTS", "0") or 0) or 40
TOKEN_SCALE = 32
BLOCK_SIZE = 16
CHECK_EVERY = 25
SAVE_EVERY = 500
TENANTS = ("tenant-a", "tenant-b")


def tenant_of(namespace) -> int:
  return TENANTS.index(namespace)


class MooncakeSoakTest(absltest.TestCase):

  def test_soak_ends_in_a_clean_drain(self):
    if not os.path.exists(TRACE):
      self.skipTest(f"trace not found: {TRACE} (the Mooncake conversation trace, from "
                    f"github.com/kvcache-ai/Mooncake FAST25-release/traces/; lives in "
                    f"../shared/traces beside the repository)")
    trace = load_mooncake(TRACE, 0 if _SECONDS else _REQUESTS)
    tokens = TokenSource(trace)
    prompts = [scaled_prompt(r, tokens, TOKEN_SCALE) for r in trace]
    outputs = [max(1, -(-r.output_length // TOKEN_SCALE)) for r in trace]
    longest = max(p.size + o for p, o in zip(prompts, outputs))
    config = paged_kv.PoolConfig(
        num_blocks=1024, block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1,
        head_dim=kv_tags.TAG_DIM, dtype="float32", max_seqs=16,
        max_segments=longest // BLOCK_SIZE + 16, base_pool_fraction=0.05,
        scrub_freed_blocks=True)
    pool = paged_kv.BlockPool(config)
    executor = kv_tags.TaggingExecutor(config, tenant_of)
    clock = [0.0]
    sched = Scheduler(
        CachedPool(pool, pack_tails=True, clock=lambda: clock[0]), executor,
        SchedulerConfig(max_batch=16, prefill_token_budget=1024, prefill_chunk=256,
                        preemption="swap", pack_tails=True, output_reserve_ratio=0.0,
                        compaction=compact.CompactionPolicy(threshold=0.3, budget=16),
                        promote_readers=3, promote_every=16, snapshot_every=100),
        clock=lambda: clock[0])
    executor.sched = sched
    t0 = time.monotonic()
    submitted = refused = steps = tokens_checked = passes = 0
    saved = os.path.join(tempfile.mkdtemp(), "cache.npz")
    has_saved = False
    nxt = 0

    def feeding() -> bool:
      return (time.monotonic() - t0 < _SECONDS) if _SECONDS else passes == 0

    while True:
      while feeding() and len(sched.waiting) < 2 * sched.config.max_batch:
        i = nxt % len(trace)
        req = Request((passes, i), prompts[i], outputs[i], namespace=TENANTS[i % 2],
                      forced_output=tokens.unique(outputs[i]))
        try:
          sched.submit(req)
          submitted += 1
        except paged_kv.PoolExhausted:
          refused += 1
        nxt += 1
        if nxt % len(trace) == 0:
          passes += 1
      if sched.idle:
        break
      sched.step()
      steps += 1
      clock[0] += 0.05
      if steps % CHECK_EVERY == 0:
        sched.check_invariants()
        tokens_checked += kv_tags.check_tags(sched, tenant_of)
        kv_tags.check_clear_slots_zero(pool)
      if steps % SAVE_EVERY == 0:
        sched.cached_pool.save(saved)
        has_saved = True
    st = sched.stats
    self.assertEqual(st.finished, submitted)
    self.assertGreater(st.preemptions_swap + st.evictions, 0, "the soak must see pressure")
    sched.check_invariants()
    tokens_checked += kv_tags.check_tags(sched, tenant_of)
    if not has_saved:
      sched.cached_pool.save(saved)
    # The saved cache restores into a fresh pool with its references in place.
    fresh = CachedPool(paged_kv.BlockPool(config), pack_tails=True)
    fresh.restore(saved)
    fresh.check_invariants()
    restored_tokens = fresh.cache.num_tokens
    # Drain: evict the whole cache; the pool is 100% free, every count 0.
    sched.cached_pool.evict(num_blocks=config.num_blocks)
    self.assertEqual(len(sched.cached_pool.cache.tree), 0)
    ref_count = np.asarray(pool.state.meta.ref_count)
    self.assertFalse(ref_count.any(), np.flatnonzero(ref_count))
    self.assertEqual(pool.num_free_blocks, config.num_blocks - config.num_base_blocks)
    self.assertFalse(np.asarray(pool.state.table.active).any())
    sched.check_invariants()
    self.assertFalse(np.any(np.asarray(pool.state.pages.k)), "a freed block kept K/V")
    elapsed = time.monotonic() - t0
    print(f"\nMooncake soak: {elapsed:.0f} s, {passes} full pass(es) + {nxt % len(trace)} "
          f"requests, {submitted} submitted, {refused} refused, {st.finished} finished, "
          f"{steps} steps, {st.preemptions_swap} swap / {st.preemptions_recompute} "
          f"recompute preemptions, {st.evictions} evictions, {st.compactions} compactions, "
          f"{sched.counters.pack_moves} pack moves, {sched.counters.promotions} promotions, "
          f"hit rate {st.prefix_cache_hit_rate:.3f}, {tokens_checked} K/V tokens checked, "
          f"restored cache {restored_tokens} tokens; drain clean")


if __name__ == "__main__":
  absltest.main()
