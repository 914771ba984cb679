"""The scheduler's parts on their own: batching, stats pacing, eviction, admission,
preemption, maintenance, shrink control, recovery (`paged_kv.scheduler.*`)."""

import inspect

import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core.errors import InvalidArgument, PoolExhausted
from paged_kv.scheduler import batching, maintenance, recovery
from paged_kv.scheduler.admission import Admission
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.finishing import Finishing
from paged_kv.scheduler.preemption import Preemption
from paged_kv.scheduler.request import Phase, Request, RequestQueues, is_finished
from paged_kv.scheduler.scheduler import Scheduler
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.stats_pacing import MAX_STATS_INTERVAL, StatsPacer
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord
from paged_kv.telemetry import metrics

CFG = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=8, max_segments=16)


def _running(rid, prompt_len, *, cached, target=None, output=(), max_new=8, seq_id=0):
  r = Request(rid, np.arange(prompt_len, dtype=np.int32), max_new)
  r.phase, r.seq_id, r.num_cached = Phase.RUNNING, seq_id, cached
  r.prefill_target = prompt_len if target is None else target
  r.output.extend(output)
  return r


class Parts:
  """A pool, its cache and the parts, wired as a `Scheduler` wires them."""

  def __init__(self, config=SchedulerConfig(max_batch=4, prefill_chunk=8,
                                            prefill_token_budget=12, compaction=None)):
    self.pool = paged_kv.BlockPool(CFG)
    self.cp = CachedPool(self.pool, None, policy=config.evict_policy)
    self.config, self.stats = config, SchedulerStats()
    self.queues, self.record = RequestQueues(), StepRecord()
    self.finished = []
    self.evictor = Evictor(self.cp, self.stats, config.governance)
    self.admission = Admission(self.cp, config, self.stats, self.evictor,
                               self.queues, self.record, caching=True)
    self.finishing = Finishing(self.cp, self.stats, self.queues, self.record, caching=True,
                               on_finished=self.finished.append)
    self.preemption = Preemption(self.cp, config, self.stats, self.evictor, self.finishing,
                                 self.queues)

  def queue(self, *requests):
    for r in requests:
      r._freeze()  # pylint: disable=protected-access
      self.queues.waiting.append(r)


class BatchingTest(absltest.TestCase):

  def test_chunks_are_fcfs_under_the_token_budget(self):
    cfg = SchedulerConfig(prefill_chunk=8, prefill_token_budget=12)
    a, b, c = (_running(i, 20, cached=0) for i in range(3))
    chunks = batching.prefill_chunks([a, b, c], cfg)
    self.assertEqual([(r.request_id, n) for r, n in chunks], [(0, 8), (1, 4)])

  def test_decode_batch_names_stop_reasons_and_skips_prefilling_rows(self):
    done = _running(0, 4, cached=4, output=[5] * 8, max_new=8)
    stop = _running(1, 4, cached=4, output=[7])
    stop.stop_ids = frozenset({7})
    live = _running(2, 4, cached=4, output=[3])
    prefilling = _running(3, 8, cached=4)
    self.assertEqual(batching.decode_batch([done, stop, live, prefilling]), [live])
    self.assertEqual((done.stop_reason, stop.stop_reason), ("length", "stop_token"))
    self.assertTrue(is_finished(done) and is_finished(stop) and not is_finished(live))

  def test_plan_puts_decodes_first_and_pads(self):
    cfg = SchedulerConfig(max_batch=4, prefill_chunk=8)
    dec = _running(0, 4, cached=4, output=[42], seq_id=3)
    pre = _running(1, 10, cached=2, seq_id=1)
    plan = batching.build_plan([dec], [(pre, 5)], cfg, sampling=False)
    np.testing.assert_array_equal(plan.seq_ids, [3, 1, -1, -1])
    np.testing.assert_array_equal(plan.num_new, [1, 5, 0, 0])
    np.testing.assert_array_equal(plan.tokens[:6], [42, 2, 3, 4, 5, 6])
    self.assertEqual((plan.max_query_len, plan.sampling), (8, None))
    self.assertEqual(len(plan.tokens), batching.width_for(6, batching.token_widths(cfg)[1]))

  def test_blocks_needed_counts_full_tails_and_spills(self):
    full = _running(0, 4, cached=8, output=[1])  # 8 cached tokens: the next needs a block
    part = _running(1, 4, cached=6, output=[1])
    chunk = _running(2, 20, cached=3)  # 3 + 6 tokens: blocks 1 -> 3
    self.assertEqual(batching.blocks_needed([full, part], [(chunk, 6)], 4), 1 + 2)


class StatsPacerTest(absltest.TestCase):

  def test_every_k_steps_without_a_budget(self):
    pacer = StatsPacer(3, None)
    self.assertEqual([s for s in range(10) if pacer.takes(s)], [0, 3, 6, 9])
    self.assertFalse(any(StatsPacer(0, None).takes(s) for s in range(5)))

  def test_a_budget_stretches_the_interval_to_its_share_and_caps_it(self):
    pacer = StatsPacer(1, 0.1)
    self.assertTrue(pacer.takes(0))
    pacer.pace(0, stats_seconds=1.0, rest_seconds=20.0)  # costs 5%: every step is fine
    self.assertEqual(pacer.interval, 1)
    pacer = StatsPacer(1, 0.1)
    pacer.pace(0, stats_seconds=1.0, rest_seconds=2.0)  # 50%: every 5 steps
    self.assertEqual(pacer.interval, 5)
    self.assertFalse(pacer.takes(4))
    self.assertTrue(pacer.takes(5))
    pacer = StatsPacer(1, 0.01)
    pacer.pace(0, stats_seconds=10.0, rest_seconds=1.0)
    self.assertEqual(pacer.interval, MAX_STATS_INTERVAL)


class AdmissionTest(absltest.TestCase):

  def test_fcfs_until_one_does_not_fit_and_the_reserve_counts(self):
    p = Parts(SchedulerConfig(max_batch=4, output_reserve_ratio=1.0, compaction=None))
    # 31 dynamic blocks of 4 tokens. Each asks cdiv(40, 4) + 1 = 11 blocks for its
    # context, plus the reserve: cdiv(16, 4) + 1 = 5 for its output and, for each one
    # admitted before it, cdiv(40 + 16, 4) + 1 = 15 (its prompt and its output).
    # 11 + 5 = 16 <= 31; 11 + 15 + 5 = 31 <= 31; 11 + 30 + 5 > 31: the third waits.
    reqs = [Request(i, np.arange(100 * i, 100 * i + 40, dtype=np.int32), 16) for i in range(3)]
    p.queue(*reqs)
    p.admission.admit()
    self.assertEqual([r.request_id for r in p.queues.running], [0, 1])
    self.assertEqual(list(p.queues.waiting), [reqs[2]])
    self.assertEqual((reqs[0].phase, reqs[0].num_cached, reqs[0].prefill_target),
                     (Phase.RUNNING, 0, 40))
    self.assertEqual(p.stats.admitted, 2)

  def test_alone_need_bounds_submit(self):
    p = Parts()
    big = Request(0, np.arange(90, dtype=np.int32), 40)
    self.assertEqual(p.admission.alone_need(big), 23 + 10 + 2)
    with self.assertRaisesRegex(PoolExhausted, "dynamic blocks"):
      p.admission.check_fits(big)
    with self.assertRaisesRegex(InvalidArgument, "logprobs"):
      p.admission.check_fits(Request(1, np.arange(4, dtype=np.int32), 2,
                                     sampling=paged_kv.scheduler.SamplingParams(logprobs=2)))

  def test_max_seq_len_bounds_prompt_plus_output(self):
    p = Parts(SchedulerConfig(max_batch=4, compaction=None, max_seq_len=12))
    p.admission.check_fits(Request(0, np.arange(8, dtype=np.int32), 4))  # 12: fits
    with self.assertRaisesRegex(InvalidArgument, r"8 prompt \+ 5 new tokens = 13; .*max_seq_len is 12"):
      p.admission.check_fits(Request(1, np.arange(8, dtype=np.int32), 5))
    for bad in (0, -1, 2.5, True):
      with self.assertRaisesRegex(InvalidArgument, "max_seq_len"):
        SchedulerConfig(max_seq_len=bad)

  def test_a_too_long_request_is_refused_and_nothing_changes(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), None,
                      SchedulerConfig(max_batch=4, compaction=None, max_seq_len=12))
    long = Request("long", np.arange(10, dtype=np.int32), 3)
    with self.assertRaisesRegex(InvalidArgument, "max_seq_len"):
      sched.submit(long)
    self.assertEqual((list(sched.waiting), sched.idle), ([], True))
    long.max_new_tokens = 2  # not sealed: the caller may fix it and submit again
    sched.submit(long)
    self.assertEqual(list(sched.waiting), [long])

  def test_a_request_alone_is_admitted_without_its_reserve(self):
    p = Parts(SchedulerConfig(max_batch=4, output_reserve_ratio=1.0, compaction=None))
    # Context 22 blocks + output reserve 11 > 31 dynamic blocks, but it is alone.
    req = Request(0, np.arange(88, dtype=np.int32), 40)
    p.queue(req)
    p.admission.admit()
    self.assertEqual(p.queues.running, [req])


class PreemptionTest(absltest.TestCase):

  def _two_running(self, mode):
    p = Parts(SchedulerConfig(max_batch=4, preemption=mode, compaction=None))
    a, b = (Request(i, np.arange(10 * i, 10 * i + 9, dtype=np.int32), 8) for i in range(2))
    p.queue(a, b)
    p.admission.admit()
    self.assertEqual(p.queues.running, [a, b])
    for r in (a, b):  # the prompt computed and a first token out
      p.pool.reserve_tokens([r.seq_id], [9])
      r.num_cached = 9
      r.output.append(1)
    return p, a, b

  def test_recompute_preempts_the_newest_into_the_cache_and_the_queue_head(self):
    p, a, b = self._two_running("recompute")
    p.preemption.relieve(CFG.num_blocks)  # more than exists: all but one preempted
    self.assertEqual(p.queues.running, [a])
    self.assertEqual(list(p.queues.waiting), [b])
    self.assertEqual((b.phase, b.num_cached, b.seq_id, b.num_preemptions),
                     (Phase.WAITING, 0, None, 1))
    self.assertEqual(p.stats.preemptions_recompute, 1)
    p.cp.check_invariants()

  def test_swap_moves_the_newest_to_host(self):
    p, a, b = self._two_running("swap")
    p.preemption.relieve(CFG.num_blocks)
    self.assertEqual(list(p.queues.swapped), [b])
    self.assertEqual(b.phase, Phase.SWAPPED)
    self.assertGreater(p.stats.swap_to_host_bytes, 0)
    p.cp.check_invariants()


class MaintenanceTest(absltest.TestCase):

  def test_no_compaction_while_shrinking_or_without_a_policy(self):
    p = Parts(SchedulerConfig(compaction=paged_kv.core.compact.CompactionPolicy(
        threshold=0.0)))
    stats = metrics.step_stats_host(p.pool.host, p.pool.config)
    self.assertEqual(maintenance.maybe_compact(p.cp, p.config, p.stats, stats,
                                               shrinking=True), 0)
    self.assertEqual(maintenance.maybe_compact(p.cp, SchedulerConfig(compaction=None),
                                               p.stats, stats, shrinking=False), 0)

  def test_promotion_only_on_its_steps(self):
    p = Parts()
    self.assertEqual(maintenance.maybe_promote(p.cp, p.config, p.stats, 16), 0)  # off


class RecoveryTest(absltest.TestCase):

  def test_a_request_whose_row_is_gone_is_requeued_and_a_stray_row_released(self):
    p = Parts()
    a, b = (Request(i, np.arange(10 * i, 10 * i + 9, dtype=np.int32), 8) for i in range(2))
    p.queue(a, b)
    p.admission.admit()
    p.pool.release([a.seq_id])  # as an interrupted call might have left it
    stray = p.pool.allocate(1)
    recovery.reconcile_rows(p.pool, p.queues, p.finished.append)
    self.assertEqual(p.queues.running, [b])
    self.assertEqual(list(p.queues.waiting), [a])
    self.assertEqual((a.phase, a.seq_id, a.num_cached), (Phase.WAITING, None, 0))
    self.assertNotIn(int(np.asarray(stray).reshape(-1)[0]), p.pool.active_sequences())


class SchedulerShapeTest(absltest.TestCase):

  def test_the_scheduler_class_stays_a_step_loop(self):
    # The KV decisions live in the parts above; the class keeps the loop and the
    # request lifecycle (under 400 lines).
    lines, _ = inspect.getsourcelines(Scheduler)
    self.assertLess(len(lines), 400)


if __name__ == "__main__":
  absltest.main()
