"""Shrinking the pool while serving (`Scheduler.shrink_to`): moves, one cut, no data lost.

A burst fills a small pool with the prefix cache on, most requests finish (their
tokens stay cached), then the scheduler shrinks toward live + cached demand while
serving goes on and new requests arrive. After every step: the invariant checker
(cache references included), every running sequence and cache node reads back its
tagged K/V bit for bit (`kv_tags`), the gathered K/V of every running sequence is
identical before and after the step's shrink moves, and no block above the cut
becomes referenced (lowest-address-first allocation keeps new blocks below it).
The run with the shrink finishes every request at the same step as the same run
without it (no request delayed). Refusals change nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core import compact, regions
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from tests.scheduler import kv_tags

CFG = paged_kv.PoolConfig(num_blocks=192, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=kv_tags.TAG_DIM, max_seqs=8, max_segments=40,
                          base_pool_fraction=0.1)
NB = CFG.num_base_blocks
# One scheduler config for every test here, so they share compiled steps.
SCHED = SchedulerConfig(max_batch=8, prefill_chunk=16, prefill_token_budget=32,
                        output_reserve_ratio=0.0, snapshot_every=0)
SHRINK_AT = 14  # step of the shrink request (after the burst's short requests finished)
TARGET = 80  # blocks after the cut: 12 below what live + cached data hold at SHRINK_AT


def tenant_of(namespace) -> int:
  return int(namespace[1:])


class ResizingTaggingExecutor(kv_tags.TaggingExecutor):
  """The tagging executor, following pool resizes like the library's executors."""

  def resize(self, config):
    self.config = config


def _burst(seed: int, n: int = 14) -> list[Request]:
  """Short requests and a few long ones sharing per-tenant prefixes."""
  rng = np.random.default_rng(seed)
  prefixes = {t: t * kv_tags.TOKENS_PER_TENANT + rng.integers(0, 100, 12) for t in (0, 1)}
  out = []
  for i in range(n):
    t = i % 2
    tail = t * kv_tags.TOKENS_PER_TENANT + rng.integers(100, 1000, int(rng.integers(3, 20)))
    long = i % 5 == 0
    out.append(Request(f"b{i}", np.concatenate([prefixes[t], tail]),
                       max_new_tokens=int(rng.integers(24, 32)) if long
                       else int(rng.integers(2, 8)), namespace=f"t{t}"))
  return out, prefixes


def _second_wave(seed: int, prefixes, n: int = 6) -> list[Request]:
  rng = np.random.default_rng(seed + 1)
  out = []
  for i in range(n):
    t = i % 2
    tail = t * kv_tags.TOKENS_PER_TENANT + rng.integers(100, 1000, int(rng.integers(2, 10)))
    out.append(Request(f"w{i}", np.concatenate([prefixes[t], tail]),
                       max_new_tokens=int(rng.integers(3, 12)), namespace=f"t{t}"))
  return out


def _referenced(sched) -> np.ndarray:
  return np.asarray(sched.pool.state.meta.ref_count) > 0


def _serve(seed: int, *, target: int | None, margin: int = 0,
           policy=compact.CompactionPolicy(budget=3), check=True, config=SCHED,
           shrink_at=SHRINK_AT, burst=None, wave=(), allow_spill=False, staging="auto"):
  """Runs the burst, a second wave at `shrink_at + 2`, and (optionally) the shrink."""
  pool = paged_kv.BlockPool(CFG)
  executor = ResizingTaggingExecutor(CFG, tenant_of)
  sched = Scheduler(pool, executor, config)
  executor.sched = sched
  if burst is None:
    burst, prefixes = _burst(seed)
    wave = _second_wave(seed, prefixes)
  wave = list(wave)
  for r in burst:
    sched.submit(r)
  shrink = None
  moves_checked = [0]
  prev_above = [None]  # referenced blocks above the target after the latest shrink step
  usage = [0, 0]  # live and cached blocks when the shrink was requested

  def checked_shrink(inner=sched._maybe_shrink):
    """The step's shrink, with every running sequence's K/V gathered around it."""
    if shrink is None or shrink.done:
      return inner()
    before = {r.request_id: jax.device_get(sched.pool.gather_kv(r.seq_id))
              for r in sched.running}
    held_before = _referenced(sched)
    above = held_before & (np.arange(held_before.size) >= shrink.target)
    # After the forward pass: no block above the target became referenced.
    assert allow_spill or not (above & ~prev_above[0]).any(), np.flatnonzero(above & ~prev_above[0])
    evicted = shrink.evicted_blocks
    inner()
    prev_above[0] = _referenced(sched) & (np.arange(sched.pool.config.num_blocks)
                                          >= shrink.target)
    for r in sched.running:
      k, v = jax.device_get(sched.pool.gather_kv(r.seq_id))
      np.testing.assert_array_equal(k, before[r.request_id][0])
      np.testing.assert_array_equal(v, before[r.request_id][1])
    if shrink.last_moves:
      moves_checked[0] += 1
      # Moves vacate blocks above the target only; below it only evictions free blocks.
      held_after = _referenced(sched)  # after a cut: shorter (the cut blocks were free)
      held_after = np.pad(held_after, (0, held_before.size - held_after.size))
      vacated = np.flatnonzero(held_before & ~held_after)
      assert (vacated >= shrink.target).sum() >= shrink.last_moves
      assert (vacated < shrink.target).sum() <= shrink.evicted_blocks - evicted

  if check:
    sched._maybe_shrink = checked_shrink
  held_above_prev = None
  step = 0
  while not sched.idle:
    if step == shrink_at and target is not None:
      live, cached = regions.block_usage(pool.state)
      usage[:] = [live, cached]
      shrink = sched.shrink_to(target, policy, margin=margin, staging=staging)
      held_above_prev = _referenced(sched) & (np.arange(CFG.num_blocks) >= shrink.target)
      prev_above[0] = held_above_prev
    if step == shrink_at + 2:
      for r in wave:
        sched.submit(r)
    sched.step()
    step += 1
    assert step < 400
    if not check:
      continue
    sched.check_invariants()
    kv_tags.check_tags(sched, tenant_of)
    if shrink is not None and not shrink.done and not allow_spill:
      # No block above the target becomes referenced: the set only shrinks.
      above = _referenced(sched) & (np.arange(sched.pool.config.num_blocks) >= shrink.target)
      assert not (above & ~held_above_prev).any(), np.flatnonzero(above & ~held_above_prev)
      held_above_prev = above
  return sched, burst + wave, shrink, moves_checked[0], usage


@functools.lru_cache(maxsize=None)
def _runs():
  """The same seed without and with the shrink (shared by the tests: compiles are the cost).

  The target is below what live and cached data hold at `SHRINK_AT`, so the
  shrink both evicts cached-only blocks and moves live ones (3 per step). The cut
  goes through host memory (at most one pool plus one layer on the device).
  """
  shrunk = _serve(0, target=TARGET, margin=4, staging="host")
  return _serve(0, target=None, check=False), shrunk  # the second run is warm


@pytest.mark.slow
class ShrinkWhileServingTest(absltest.TestCase):

  def test_shrink_with_prefix_cache_moves_evicts_and_cuts_once(self):
    _, (sched, reqs, shrink, moves_checked, (live, cached)) = _runs()
    self.assertGreater(NB + live + cached, TARGET)  # the cache must give way
    self.assertTrue(shrink.done, shrink)
    self.assertGreater(shrink.held_at_start, 0)  # there was something to move
    self.assertGreater(shrink.moves, shrink.max_moves)  # several budgeted steps (3 moves each)
    self.assertGreater(moves_checked, 1)  # K/V gathered around every move step
    self.assertGreater(shrink.evicted_blocks, 0)  # the room below was short: cache gave way
    self.assertEqual(shrink.spilled_blocks, 0)
    self.assertLessEqual(shrink.max_step_share, 1.0)
    self.assertEqual(sched.pool.config.num_blocks, shrink.target)
    self.assertEqual(sched.pool.config.num_base_blocks, NB)
    self.assertEqual(sched.executor.config, sched.pool.config)
    self.assertIsNotNone(sched.config.compaction)  # the config is never changed
    st = sched.stats
    self.assertEqual((st.shrinks, st.shrink_moves, st.shrink_blocks_returned,
                      st.shrink_evicted_blocks),
                     (1, shrink.moves, CFG.num_blocks - shrink.target, shrink.evicted_blocks))
    self.assertEqual(st.shrink_bytes_moved, shrink.moves * CFG.block_bytes)
    self.assertEqual(shrink.blocks_returned, CFG.num_blocks - shrink.target)
    cut = shrink.cut  # staged: beside the old state, one layer of K and the new metadata
    self.assertTrue(cut.staged)
    self.assertEqual((cut.old_blocks, cut.new_blocks), (CFG.num_blocks, TARGET))
    self.assertLessEqual(cut.peak_extra_bytes, cut.chunk_bytes + 64 * TARGET)
    self.assertGreater(st.hit_tokens, 0)
    self.assertTrue(all(r.done and r.stop_reason == "length" for r in reqs))

  def test_no_request_delayed(self):
    (_, base_reqs, *_), (_, reqs, *_) = _runs()
    # Same tokens, same first-token and finish steps as the run without the shrink.
    key = lambda rs: [(r.request_id, r.output, r.first_token_step, r.finish_step) for r in rs]
    self.assertEqual(key(reqs), key(base_reqs))


class ShrinkWaitsForLiveDataTest(absltest.TestCase):

  @pytest.mark.slow
  def test_live_growth_past_the_target_waits_and_loses_nothing(self):
    """No cache to evict: sequences outgrow the room below, the shrink waits for them."""
    rng = np.random.default_rng(5)
    # Three long requests and short ones beside them: when the short ones are gone the
    # long ones hold 56 blocks (the target's 61 fit them), some above the target. Then
    # four 60-token prompts arrive (admission sees the whole pool): they take the room
    # below and spill above the target; the shrink waits for them to finish.
    burst = ([Request(f"g{i}", rng.integers(0, 900, 30), max_new_tokens=60, namespace="t0")
              for i in range(3)]
             + [Request(f"s{i}", rng.integers(0, 900, 60), max_new_tokens=2, namespace="t0")
                for i in range(8)])
    wave = [Request(f"w{i}", rng.integers(0, 900, 60), max_new_tokens=4, namespace="t0")
            for i in range(4)]
    sched, reqs, shrink, _, (live, _) = _serve(
        0, target=TARGET, burst=burst, wave=wave, shrink_at=15, allow_spill=True,
        policy=compact.CompactionPolicy(budget=1),
        # Timed in steps of the synchronous loop (the overlapped one frees the short
        # requests a step later).
        config=dataclasses.replace(SCHED, enable_prefix_cache=False, overlap=False))
    self.assertLessEqual(NB + live, TARGET)  # accepted: the live data fitted then
    self.assertGreater(shrink.held_at_start, 0)
    self.assertGreater(shrink.spilled_blocks, 0)  # then grew past the room below
    self.assertGreater(shrink.wait_steps, 0)
    self.assertTrue(shrink.done, shrink)
    self.assertEqual(sched.pool.config.num_blocks, TARGET)
    self.assertTrue(all(r.done and r.stop_reason == "length" for r in reqs))


class ShrinkRefusalTest(absltest.TestCase):

  def _sched(self, executor=None, **cfg):
    pool = paged_kv.BlockPool(CFG)
    sched = Scheduler(pool, executor or DryExecutor(CFG),
                      dataclasses.replace(SCHED, **cfg))
    rng = np.random.default_rng(0)
    for i in range(4):
      sched.submit(Request(i, rng.integers(0, 50, 30), max_new_tokens=40))
    for _ in range(6):
      sched.step()
    return sched

  def _state(self, sched):
    return (sched.pool.config, jax.tree.map(np.asarray, sched.pool.state.meta),
            sched.config, sched.shrink_status, sched.stats.shrink_steps)

  def assert_same(self, a, b):
    self.assertEqual(a[0], b[0])
    jax.tree.map(np.testing.assert_array_equal, a[1], b[1])
    self.assertEqual(a[2:], b[2:])

  def test_bad_targets_change_nothing(self):
    sched = self._sched()
    before = self._state(sched)
    live, _ = regions.block_usage(sched.pool.state)
    for bad in (2.5, True, "100", None, np.float32(100)):
      with self.assertRaises(paged_kv.InvalidArgument):
        sched.shrink_to(bad)
    for bad in (NB, NB - 1, 0, CFG.num_blocks, CFG.num_blocks + 8):
      with self.assertRaises(paged_kv.InvalidArgument):
        sched.shrink_to(bad)
    with self.assertRaises(paged_kv.PoolExhausted):  # below the live blocks
      sched.shrink_to(NB + live - 1)
    idle = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    idle.submit(Request("big", np.arange(100), max_new_tokens=56))  # up to 41 blocks
    with self.assertRaises(paged_kv.PoolExhausted):  # a queued request would never fit
      idle.shrink_to(NB + 40)
    self.assertIsNone(idle.shrink_status)
    for kwargs in (dict(policy="fast"), dict(block_bytes=0), dict(margin=-1),
                   dict(evict_cached="yes"), dict(staging="disk"), dict(staging=None)):
      with self.assertRaises(paged_kv.InvalidArgument):
        sched.shrink_to(CFG.num_blocks - 8, **kwargs)
    sched.step()
    sched.check_invariants()
    self.assertIsNone(sched.shrink_status)
    before2 = self._state(sched)
    with self.assertRaises(paged_kv.InvalidArgument):  # a config-holding executor without resize
      Scheduler(sched.cached_pool, kv_tags.TaggingExecutor(CFG, tenant_of),
                sched.config).shrink_to(CFG.num_blocks - 8)
    self.assert_same(self._state(sched), before2)
    del before

  def test_pending_shrink_refuses_a_second_and_cancels(self):
    sched = self._sched()
    s = sched.shrink_to(CFG.num_blocks - 16, compact.CompactionPolicy(budget=1))
    with self.assertRaises(paged_kv.InvalidArgument):
      sched.shrink_to(CFG.num_blocks - 8)
    self.assertIs(sched.shrink_status, s)
    self.assertIs(sched.cancel_shrink(), s)
    self.assertTrue(s.cancelled and not s.done)
    self.assertEqual(sched.pool.config.num_blocks, CFG.num_blocks)
    sched.run()
    sched.check_invariants()

  def test_executor_resize_refuses_another_model(self):
    ex = DryExecutor(CFG)
    with self.assertRaises(paged_kv.InvalidArgument):
      ex.resize(paged_kv.PoolConfig(num_blocks=100, block_size=8, num_layers=1, num_kv_heads=1,
                                    head_dim=4))
    with self.assertRaises(paged_kv.InvalidArgument):
      ex.resize("config")
    self.assertIs(ex.config, CFG)
    ex.resize(regions.resized_config(CFG, 100))
    self.assertEqual(ex.config.num_blocks, 100)

  def test_model_executor_follows_a_resize(self):
    from flax import nnx  # pylint: disable=import-outside-toplevel
    from paged_kv.model import llama  # pylint: disable=import-outside-toplevel
    from paged_kv.scheduler.executor import ModelExecutor  # pylint: disable=import-outside-toplevel
    model_config = llama.LlamaConfig(num_layers=1)
    pool_config = llama.pool_config_for(model_config, num_blocks=64, block_size=4, max_seqs=4,
                                        max_segments=24, base_pool_fraction=0.1)
    ex = ModelExecutor(llama.TinyLlama(model_config, rngs=nnx.Rngs(0)), pool_config)
    with self.assertRaises(paged_kv.InvalidArgument):
      ex.resize(dataclasses.replace(pool_config, num_blocks=40, max_seqs=8))
    self.assertIs(ex.config, pool_config)
    ex.resize(regions.resized_config(pool_config, 40))
    self.assertEqual((ex.config.num_blocks, ex.config.num_base_blocks),
                     (40, pool_config.num_base_blocks))

  def test_idle_scheduler_shrinks_by_step(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    s = sched.shrink_to(TARGET)
    sched.step()  # nothing referenced above the target: cut at the first step
    self.assertTrue(s.done)
    self.assertEqual(sched.pool.config.num_blocks, TARGET)
    sched.check_invariants()


if __name__ == "__main__":
  absltest.main()
