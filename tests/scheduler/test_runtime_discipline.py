"""Compile once, never wait: the scheduler's device traffic, counted exactly.

After `Scheduler.warmup()` a steady workload (admission with prefix matches,
chunked prefill, decode, finish into the cache, eviction, compaction) runs with:

* one bookkeeping dispatch (the pool's commit) per step that changed anything,
  none otherwise, and no synchronous transition;
* one executor dispatch per step with work;
* no blocking host read at all (the step's reservation is the host's own,
  committed before it runs);
* no XLA compile.

And a device that disagrees with the host mirror is caught: later in normal
mode (`InternalInconsistency` at a following call), at once in debug mode.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core import compact
from paged_kv.core.errors import InternalInconsistency
from paged_kv.pool import step_reservation
from paged_kv.runtime import counters
from paged_kv.scheduler.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig

pytestmark = pytest.mark.slow

CFG = paged_kv.PoolConfig(num_blocks=256, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=16, max_segments=32)


def _requests(rng, n, start=0):
  system = np.arange(40)
  out = []
  for i in range(n):
    prompt = np.concatenate([system[:rng.integers(4, 40)], rng.integers(100, 1000,
                                                                        rng.integers(1, 30))])
    out.append(Request(start + i, prompt, int(rng.integers(1, 24))))
  return out


def _scheduler(config=CFG, **kw) -> Scheduler:
  # The counts are the production path's: debug mode (`PAGED_KV_DEBUG=1` in the
  # environment) syncs every call on purpose.
  pool = paged_kv.BlockPool(config, debug=False)
  sched_config = SchedulerConfig(max_batch=8, prefill_chunk=8, prefill_token_budget=24,
                                 compaction=compact.CompactionPolicy(threshold=0.2, budget=4),
                                 **kw)
  return Scheduler(pool, DryExecutor(config), sched_config)


class SteadyStateTest(absltest.TestCase):

  def _run(self):
    sched = _scheduler()
    report = sched.warmup(progress=False)
    self.assertGreater(report.programs, 0)
    rng = np.random.default_rng(0)
    for r in _requests(rng, 60):
      sched.submit(r)
    for _ in range(10):  # past the first admissions
      sched.step()
    per_step = []
    while not sched.idle:
      before = sched.runtime
      compiles = counters.backend_compiles()
      sched.step()
      d = sched.runtime.since(before)
      per_step.append(d)
      self.assertEqual(counters.backend_compiles() - compiles, 0, "a compile after warm-up")
      self.assertEqual(d.num_host_reads, 0, d)
      self.assertLessEqual(d.dispatches.get("commit", 0), 1, d)
      self.assertEqual(d.dispatches.get("sync", 0), 0, d)
      self.assertLessEqual(d.dispatches.get("step", 0), 1, d)
    self.assertGreater(len(per_step), 20)
    self.assertEqual(sched.stats.compiles_after_warmup, 0)
    self.assertGreater(sched.stats.evictions + sched.stats.compactions, 0,
                       "the workload must exercise eviction or compaction")
    sched.check_invariants()  # the deferred checks all agree (it waits for them)
    return sched, per_step

  def test_one_commit_no_read_no_compile_per_step(self):
    sched, per_step = self._run()
    commits = sum(d.dispatches.get("commit", 0) for d in per_step)
    self.assertGreater(commits, 0.5 * len(per_step))  # most steps change something
    # Reads outside the steps only: the warm-up's (its persistence gather reads K/V,
    # its end compares the mirror) and check_invariants'.
    self.assertLessEqual(set(sched.runtime.host_reads), {"check", "data"})
    # The in-place rows' growth is the step's (`ReservedSlots.grow`): its program is
    # warmed up, and the mirror still agrees with the device.
    self.assertGreater(sum(d.dispatches.get("step", 0) for d in per_step), 20)
    sched.pool.verify()

  def test_swap_preemption_waits_for_nothing(self):
    sched = _scheduler(preemption="swap", output_reserve_ratio=0.0,
                       config=dataclasses.replace(CFG, num_blocks=48))
    sched.warmup(progress=False)
    rng = np.random.default_rng(1)
    for r in _requests(rng, 40):
      sched.submit(r)
    before, compiles = sched.runtime, counters.backend_compiles()
    sched.run(max_steps=400)
    d = sched.runtime.since(before)
    self.assertGreater(sched.stats.preemptions_swap, 0, "the workload must swap")
    self.assertEqual(counters.backend_compiles() - compiles, 0)
    self.assertEqual(d.num_host_reads, 0, d)
    self.assertEqual(d.dispatches.get("sync", 0), 0, d)

  def test_tail_packing_compiles_nothing_after_warmup(self):
    """Packing (`pack_slots`) and the slot reclaim before it pad their segments to
    power-of-two buckets: the warm-up runs every bucket (packing itself is a
    synchronous transition, so reads and sync dispatches are not counted here)."""
    sched = _scheduler(pack_tails=True)
    sched.warmup(progress=False)
    rng = np.random.default_rng(0)
    for r in _requests(rng, 60):
      sched.submit(r)
    compiles = counters.backend_compiles()
    sched.run()
    self.assertGreater(sched.stats.pack_moves, 0, "the workload must pack tails")
    self.assertEqual(counters.backend_compiles() - compiles, 0, "a compile after warm-up")
    self.assertEqual(sched.stats.compiles_after_warmup, 0)
    sched.check_invariants()


class VariedRunTest(absltest.TestCase):

  def test_no_compile_after_warmup_with_swap_persistence_compaction_and_a_shrink(self):
    """The varied run: swap preemption, cache saves and a restore, compaction, and a
    shrink whose cut re-warms the new size (its own count, bounded by the set)."""
    sched = _scheduler(preemption="swap", output_reserve_ratio=0.0,
                       config=dataclasses.replace(CFG, num_blocks=96))
    report = sched.warmup(progress=False)
    rng = np.random.default_rng(2)
    for r in _requests(rng, 40):
      sched.submit(r)
    before = sched.runtime
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "cache.npz")
      for step in range(600):
        if sched.idle:
          break
        sched.step()
        if step % 25 == 0:
          sched.cached_pool.save(path)
        if step == 30:
          sched.shrink_to(80)
      sched.run()
      sched.cached_pool.save(path)
      fresh = _scheduler(config=sched.pool.config)
      fresh.cached_pool.restore(path)
      fresh.check_invariants()
    self.assertGreater(sched.stats.preemptions_swap, 0)
    self.assertEqual(sched.stats.shrinks, 1)
    self.assertEqual(sched.pool.config.num_blocks, 80)
    self.assertEqual(sched.stats.compiles_after_warmup, 0)
    self.assertGreater(sched.stats.rewarm_compiles, 0)
    self.assertLessEqual(sched.stats.rewarm_compiles, 2 * report.programs)
    d = sched.runtime.since(before)
    # Reads: the saves' K/V ("data") and the re-warm's final comparison ("check").
    self.assertEqual(set(d.host_reads) - {"data", "check"}, set(), d)
    self.assertEqual(d.dispatches.get("sync", 0), 1, d)  # the cut's resize
    sched.check_invariants()


class InconsistencyTest(absltest.TestCase):

  def _pool_with_sequence(self, debug):
    pool = paged_kv.BlockPool(CFG, debug=debug)
    seq = pool.open_sequence()
    pool.reserve_tokens([seq], [6])
    pool.flush()
    return pool, seq

  def _corrupt(self, pool, seq):
    """A device change the mirror does not know (what a wrong prediction leaves):
    one more reference on the sequence's tail block."""
    tail = int(pool.host.block[seq, pool.host.num_segments[seq] - 1])
    state = pool._state  # pylint: disable=protected-access
    meta = dataclasses.replace(state.meta, ref_count=state.meta.ref_count.at[tail].add(1))
    pool._state = dataclasses.replace(state, meta=meta)  # pylint: disable=protected-access

  def test_normal_mode_reports_it_at_a_later_call(self):
    pool, seq = self._pool_with_sequence(debug=False)
    self._corrupt(pool, seq)
    pool.reserve_tokens([seq], [1])  # touches the tail block: the commit compares it
    with self.assertRaisesRegex(InternalInconsistency, "commit"):
      pool.verify()

  def test_debug_mode_reports_it_at_once(self):
    pool, seq = self._pool_with_sequence(debug=True)
    self._corrupt(pool, seq)
    with self.assertRaises(InternalInconsistency):
      pool.reserve_tokens([seq], [1])

  def test_a_mispredicted_step_is_caught(self):
    pool, seq = self._pool_with_sequence(debug=False)
    pred = step_reservation.predict_step(pool, np.array([seq, -1]), np.array([3, 0]),
                                         max_new_tokens=4)
    # A step that reserves something else than predicted (here: nothing).
    status = jnp.asarray([paged_kv.Status.NO_FREE_BLOCK, 0], jnp.int32)
    with self.assertRaisesRegex(InternalInconsistency, "reservation"):
      pool.adopt_step(pred.state, pred, device_status=status)  # compared once ready
      pool.verify()
    pool.check_invariants()  # reloaded from the device: consistent again


if __name__ == "__main__":
  absltest.main()
