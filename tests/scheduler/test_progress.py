"""Every scheduler step with work advances, or a typed error says why.

* A lone row whose shared layout (short packed tails matched from the cache, a tail
  it copied away from still locked) outgrows the pool is unstuck: its lock is
  dropped, it is recomputed in fresh blocks, and every request finishes with its
  tagged K/V exact (a 12-block pool of 4-token blocks, recompute preemption, tail
  packing: before, every step failed its reservation and `run()` never returned).
* A request preempted to make room for a running row's next token is not admitted
  again into that room (admission keeps the running rows' next-token blocks free).
* A compact lone row that pinned cache entries keep from its next block ends with
  `stop_reason="pool_exhausted"` and a `PoolExhausted` naming the cause.
* The progress guard raises `SchedulerStalled` after `max_stalled_steps` steps that
  computed nothing, naming what holds the pool.
* `Scheduler`'s and `run`'s arguments are typed (`InvalidArgument`).
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core.errors import InvalidArgument, PoolExhausted
from paged_kv.scheduler import Request, Scheduler, SchedulerConfig, SchedulerStalled
from tests.scheduler import kv_tags
from tests.scheduler.test_scheduler_parts import Parts, _running

NAMESPACES = ("a", "b", "c")
TENANT = {ns: i for i, ns in enumerate(NAMESPACES)}

POOL = paged_kv.PoolConfig(num_blocks=12, block_size=4, num_layers=1, num_kv_heads=1,
                           head_dim=kv_tags.TAG_DIM, max_seqs=4, max_segments=24)
CONFIG = SchedulerConfig(max_batch=4, prefill_token_budget=16, prefill_chunk=4,
                         preemption="recompute", pack_tails=True, output_reserve_ratio=0.0,
                         watermark_blocks=0, max_stalled_steps=0)


def stream(seed: int) -> list[Request]:
  """A few requests over three namespaces sharing two short prefixes (same ids)."""
  rng = np.random.default_rng(seed)
  prefixes = [rng.integers(0, 1000, int(rng.integers(2, 9))) for _ in range(2)]
  out = []
  for i in range(int(rng.integers(4, 12))):
    ns = NAMESPACES[int(rng.integers(3))]
    p = prefixes[int(rng.integers(2))]
    shared = p[:int(rng.integers(1, p.size + 1))]
    own = TENANT[ns] * 1000 + rng.integers(0, 1000, int(rng.integers(0, 5)))
    prompt = np.concatenate([shared, own])
    out.append(Request(f"r{i}", prompt, max_new_tokens=int(rng.integers(8, 33)), namespace=ns))
  return out


def scheduler(config: SchedulerConfig = CONFIG, clock=None) -> Scheduler:
  pool = paged_kv.BlockPool(POOL)
  executor = kv_tags.TaggingExecutor(POOL, TENANT.get)
  kwargs = {} if clock is None else {"clock": clock}
  sched = Scheduler(pool, executor, config, **kwargs)
  executor.sched = sched
  return sched


# The livelock reproductions.
@pytest.mark.slow
class UnstickTest(absltest.TestCase):

  def test_lone_row_on_a_shared_layout_finishes(self):
    # Seed 315's stream: after 5 preemptions r7 (7 + 31 tokens) runs alone on a row of
    # two short shared tails and full blocks; locked cache nodes hold the other blocks.
    clock = [0.0]  # one unit a step: the cache's LRU order is the same every run
    sched = scheduler(clock=lambda: clock[0])
    requests = []
    for r in stream(315):
      try:
        sched.submit(r)
        requests.append(r)
      except PoolExhausted:  # more than an empty pool holds
        pass
    tick = lambda s: clock.__setitem__(0, clock[0] + 1.0)
    sched.run(max_steps=2000, before_step=tick)
    self.assertTrue(sched.idle, f"{len(sched.running)} running after 2000 steps: stalled")
    self.assertEqual([r.stop_reason for r in requests], ["length"] * len(requests))
    st = sched.stats
    self.assertGreater(st.unstick_unlocks + st.unstick_preemptions, 0)
    self.assertEqual(st.unstick_refusals, 0)
    sched.check_invariants()
    self.assertGreater(kv_tags.check_tags(sched, TENANT.get), 0)  # the cache's K/V

  def test_a_victim_is_not_readmitted_into_the_block_a_running_row_needs(self):
    # Seed 780's stream: r5's tail segment is shared, so its next token needs a fresh
    # block the count of full tails misses; r8 was admitted into it, preempted by the
    # step's failed reservation, admitted again by the next step: every step after
    # step ~400 preempted once and advanced nothing.
    clock = [0.0]
    sched = scheduler(clock=lambda: clock[0])
    requests = []
    for r in stream(780):
      try:
        sched.submit(r)
        requests.append(r)
      except PoolExhausted:
        pass
    sched.run(max_steps=1000, before_step=lambda s: clock.__setitem__(0, clock[0] + 1.0))
    self.assertTrue(sched.idle, f"{sched.stats.preemptions} preemptions in 1000 steps")
    self.assertEqual([r.stop_reason for r in requests], ["length"] * len(requests))
    sched.check_invariants()

  def test_compact_lone_row_held_by_pinned_entries_ends_typed(self):
    sched = scheduler(clock=lambda: 0.0)
    first = Request("pinned", np.arange(16, dtype=np.int32), max_new_tokens=1, namespace="a")
    sched.submit(first)
    sched.run()
    self.assertEqual(sched.cached_pool.pin("a", first.prompt, ttl=1e9), 16)  # 4 blocks
    # 4 + 33 tokens fit an empty pool (submit accepts it) but not the 8 blocks left.
    big = Request("big", 1000 + np.arange(4, dtype=np.int32), max_new_tokens=33,
                  namespace="b")
    sched.submit(big)
    sched.run(max_steps=200)
    self.assertTrue(sched.idle)
    self.assertEqual(big.stop_reason, "pool_exhausted")
    self.assertIsInstance(big.error, PoolExhausted)
    self.assertIn("pinned", str(big.error))
    self.assertEqual(sched.stats.unstick_refusals, 1)
    sched.check_invariants()


class UnstickPartsTest(absltest.TestCase):

  def test_a_lone_row_on_a_shared_layout_is_recomputed_in_fresh_blocks(self):
    # A row of three 1-token segments in three blocks (a layout of shared tails)
    # and a pool held elsewhere: no lock to drop, so it is preempted and re-admitted
    # without its cached prefix, which would bring the same layout back.
    p = Parts()
    pool = p.pool
    helpers = [pool.open_sequence() for _ in range(3)]
    pool.reserve_tokens(helpers, [1, 1, 1])
    segs = np.array([[int(pool.segments(h)[0][0]), 0, 1] for h in helpers], np.int32)
    row = pool.open_sequence(segs)
    pool.release(helpers)
    req = _running("frag", 3, cached=3, output=[9], seq_id=row)
    p.queues.running.append(req)
    held = pool.allocate(pool.num_free_blocks)  # the rest of the pool, held elsewhere
    p.preemption.relieve(1)
    self.assertEqual((p.stats.unstick_unlocks, p.stats.unstick_preemptions), (0, 1))
    self.assertEqual(list(p.queues.waiting), [req])
    self.assertIn(id(req), p.queues.unshared)
    self.assertEqual(p.cp.match("default", np.arange(3, dtype=np.int32), lock=False).length, 3)
    held = np.asarray(held).reshape(-1)
    pool.apply_ref_deltas(held, -np.ones_like(held))
    p.admission.admit()
    self.assertEqual(p.queues.running, [req])
    self.assertEqual(req.num_cached, 0)  # the cached prefix was not matched
    self.assertNotIn(id(req), p.queues.unshared)  # admitted alone: the oldest row now
    p.cp.check_invariants()


class ProgressGuardTest(absltest.TestCase):

  def test_steps_that_compute_nothing_raise_a_typed_error(self):
    sched = scheduler(SchedulerConfig(max_batch=4, max_stalled_steps=5))
    sched.submit(Request("r", np.arange(6, dtype=np.int32), max_new_tokens=4, namespace="a"))
    sched.forward_pass.run = lambda executor: None  # a step loop that never computes
    for _ in range(5):  # 5 stalled steps
      sched.step()
    with self.assertRaises(SchedulerStalled) as ctx:
      sched.step()  # raised at its start, before it changed anything
    self.assertIn("no progress in 5 steps", str(ctx.exception))
    self.assertIn("'r'", str(ctx.exception))
    self.assertEqual(sched.stats.steps, 5)
    del sched.forward_pass.run  # the loop computes again: the request finishes
    sched.run(max_steps=50)
    self.assertTrue(sched.idle)

  def test_max_stalled_steps_is_checked(self):
    with self.assertRaises(InvalidArgument):
      SchedulerConfig(max_stalled_steps=-1)


class TypedArgumentsTest(absltest.TestCase):

  def test_run_and_init_arguments_raise_invalid_argument(self):
    sched = scheduler()
    for bad in ("x", 1.5, True, -1):
      with self.assertRaises(InvalidArgument, msg=repr(bad)):
        sched.run(max_steps=bad)
    with self.assertRaises(InvalidArgument):
      sched.run(before_step="not callable")
    sched.run(max_steps=np.int64(0))  # a numpy int is an int
    pool = paged_kv.BlockPool(POOL)
    executor = kv_tags.TaggingExecutor(POOL, TENANT.get)
    for kwargs in ({"clock": 3.0}, {"on_step": 1}, {"on_snapshot": "x"}, {"cache": {}}):
      with self.assertRaises(InvalidArgument, msg=repr(kwargs)):
        Scheduler(pool, executor, CONFIG, **kwargs)


if __name__ == "__main__":
  absltest.main()
