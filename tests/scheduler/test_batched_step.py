"""A scheduler step's device calls, batched (issue L): `CachedPool.open_many` and
`insert_and_release` equal their one-row calls in sequence, and a step opens all of
its admitted rows in one call and finishes all of its finished rows in one call."""

from unittest import mock

import jax
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.pool.block_pool import BlockPool
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

CFG = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=8, max_segments=16)


def _same(a: BlockPool, b: BlockPool) -> None:
  for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _cached(tokens, *, exhaust: bool):
  """A CachedPool holding `tokens` (a partial tail block), with every other block
  taken when `exhaust`; returns it and the blocks held outside."""
  cp = CachedPool(paged_kv.BlockPool(CFG))
  seq = cp.open()
  cp.pool.reserve_tokens([seq], [len(tokens)])
  cp.insert("ns", tokens, seq)
  cp.release([seq])
  taken = cp.pool.allocate(cp.pool.num_free_blocks - 1, contiguous="never") if exhaust else None
  return cp, taken


class CachedPoolBatchTest(absltest.TestCase):

  def test_open_many_equals_opens_in_sequence(self):
    tokens = list(range(6))  # one full block, a continuable tail of 2
    for exhaust in (False, True):  # True: one free block, for the first copy only
      batch, taken = _cached(tokens, exhaust=exhaust)
      single, _ = _cached(tokens, exhaust=exhaust)
      ms = [(batch.match("ns", tokens + [9]), single.match("ns", tokens + [9]))
            for _ in range(3)]
      self.assertTrue(ms[0][0].continuable)
      self.assertTrue(batch.continues_tail(ms[0][0].segments))
      segs = [m.segments for m, _ in ms] + [None]
      rows = batch.open_many(segs)
      self.assertEqual(rows.tolist(), [single.open(m.segments) for _, m in ms] + [single.open()])
      self.assertFalse(batch.continues_tail(ms[0][0].segments))  # the first open copied it
      _same(batch.pool, single.pool)
      batch.pool.check_invariants(batch.segment_refs(), extra_blocks=taken)

  def test_insert_and_release_equals_inserts_then_releases(self):
    pools = [CachedPool(paged_kv.BlockPool(CFG)) for _ in range(2)]
    prompts = [list(range(7)), list(range(5)) + [50, 51], [70, 71, 72]]
    for cp in pools:
      rows = [cp.open() for _ in prompts]
      cp.pool.reserve_tokens(rows, [len(p) for p in prompts])
    batch, single = pools
    out = batch.insert_and_release([("ns", p, r) for p, r in zip(prompts[:2], rows)], rows)
    for p, r in zip(prompts[:2], rows):
      single.insert("ns", p, r)
    single.release(rows)
    self.assertLen(out, 2)
    _same(batch.pool, single.pool)
    np.testing.assert_array_equal(batch.segment_refs(), single.segment_refs())
    batch.check_invariants()
    # Refused (a row not live): the tree and the pool are unchanged.
    before = batch.segment_refs()
    with self.assertRaises(paged_kv.InvalidSequence):
      batch.insert_and_release([("ns", [1], rows[0])], rows[:1])
    np.testing.assert_array_equal(batch.segment_refs(), before)
    batch.check_invariants()


class SchedulerBatchedStepTest(absltest.TestCase):

  def test_one_open_and_one_finish_call_per_step(self):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, DryExecutor(CFG), SchedulerConfig(
        max_batch=8, prefill_chunk=8, prefill_token_budget=64, compaction=None,
        output_reserve_ratio=0.0, stats_every=0, snapshot_every=0))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 100, 8)
    reqs = [Request(i, np.concatenate([system, rng.integers(0, 100, int(rng.integers(1, 6)))]),
                    int(rng.integers(1, 4))) for i in range(20)]
    for r in reqs:
      sched.submit(r)
    calls = {"open": 0, "finish": 0}
    cp = sched.cached_pool

    def counting(name, fn):
      def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
      return wrapper

    most_admitted = 0
    with mock.patch.object(pool, "open_sequences", counting("open", pool.open_sequences)), \
         mock.patch.object(cp, "insert_and_release", counting("finish", cp.insert_and_release)):
      while not sched.idle:
        admitted, running = sched.stats.admitted, len(sched.running)
        calls.update(open=0, finish=0)
        sched.step()
        self.assertLessEqual(calls["open"], 1)
        self.assertLessEqual(calls["finish"], 1)
        most_admitted = max(most_admitted, sched.stats.admitted - admitted)
        sched.check_invariants()
        self.assertLess(sched.stats.steps, 200)
    self.assertGreaterEqual(most_admitted, 4, "steps should admit several requests at once")
    self.assertEqual(sched.stats.preemptions, 0)
    self.assertGreater(sched.stats.hit_tokens, 0)
    for r in reqs:
      self.assertTrue(r.done)
      self.assertEqual(r.stop_reason, "length")
      self.assertLen(r.output, r.max_new_tokens)


if __name__ == "__main__":
  absltest.main()
