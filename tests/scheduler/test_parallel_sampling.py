"""Parallel sampling (`SamplingParams.n > 1`) in the scheduler: one prompt computed once.

The samples of an `n > 1` request open on its row's prompt blocks (shared, the partial
tail copied), compute the prompt's last token themselves and draw with seeds
`seed + i`: greedy samples equal an `n = 1` request's tokens, seeded ones equal `n = 1`
requests with seeds `s, s + 1, ...`; the pool's free blocks show the sharing; aborts
and preemptions leave every block accounted for (`check_invariants` after each step).
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest
from flax import nnx

import paged_kv
from paged_kv.model import LlamaConfig, TinyLlama, pool_config_for
from paged_kv.scheduler import ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from paged_kv.scheduler.parallel_sampling import SampleId

CONFIG = LlamaConfig(vocab_size=64, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
BS = 8
POOL = pool_config_for(CONFIG, num_blocks=48, block_size=BS, max_seqs=8, max_segments=16)
PROMPT = np.random.default_rng(0).integers(0, 64, 21)  # 2 full blocks + 5 tokens


class ParallelSamplingTest(absltest.TestCase):
  """One executor for every scheduler here: its programs compile once."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.executor = ModelExecutor(TinyLlama(CONFIG, rngs=nnx.Rngs(0)), POOL)

  def _sched(self, pool=POOL, **config):
    config = dict(dict(max_batch=8, prefill_chunk=16, prefill_token_budget=32), **config)
    return Scheduler(paged_kv.BlockPool(pool), self.executor, SchedulerConfig(**config))

  def _run(self, sched, reqs, *, on_step=None):
    for r in reqs:
      sched.submit(r)
    while not sched.idle:
      sched.step()
      sched.check_invariants()
      if on_step is not None:
        on_step(sched)
    return sched

  def _reference(self, sampling=None, max_new=10):
    ref = Request("ref", PROMPT, max_new, sampling=sampling)
    self._run(self._sched(), [ref])
    return ref.output

  def test_greedy_samples_equal_one_request_in_both_loops(self):
    want = self._reference()
    for overlap in (True, False):
      req = Request("r", PROMPT, 10, sampling=SamplingParams(n=3))
      self._run(self._sched(overlap=overlap), [req])
      self.assertEqual([s.request_id for s in req.samples], [SampleId("r", 1), SampleId("r", 2)])
      for r in (req, *req.samples):
        self.assertEqual((r.output, r.stop_reason), (want, "length"))
      self.assertEqual([s.hit_tokens for s in req.samples], [20, 20])  # forked, not computed

  def test_seeded_samples_equal_requests_with_seeds_s_plus_i(self):
    hot = dict(temperature=1.0, top_p=0.95)
    want = [self._reference(SamplingParams(seed=7 + i, **hot)) for i in range(3)]
    req = Request("r", PROMPT, 10, sampling=SamplingParams(n=3, seed=7, **hot))
    self._run(self._sched(), [req])
    self.assertEqual([r.output for r in (req, *req.samples)], want)
    self.assertEqual([s.sampling.seed for s in req.samples], [8, 9])
    self.assertGreater(len({tuple(w) for w in want}), 1)  # the seeds draw differently
    # Without a seed: the scheduler's, in submit order (sample i: seed + i).
    sched = self._sched(seed=100)
    a = Request("a", PROMPT, 4, sampling=SamplingParams(n=2, **hot))
    b = Request("b", PROMPT, 4, sampling=SamplingParams(**hot))
    self._run(sched, [a, b])
    self.assertEqual([a.sample_seed, a.samples[0].sample_seed, b.sample_seed], [100, 101, 102])

  def test_the_samples_share_the_prompt_blocks_and_copy_the_partial_tail(self):
    sched = self._sched(enable_prefix_cache=False)
    req = Request("r", PROMPT, 6, sampling=SamplingParams(n=3))
    for r in (req,):
      sched.submit(r)
    total = POOL.num_blocks
    sched.step()  # 16 prompt tokens: 2 blocks
    sched.step()  # 5 more: a third block; the prompt's first token is sampled
    self.assertEqual(sched.pool.num_free_blocks, total - 3)
    self.assertEqual(len(sched.running), 1)
    sched.step()  # the samples fork its row: each copies only the 4-token tail
    self.assertEqual(len(sched.running), 3)
    self.assertEqual(sched.pool.num_free_blocks, total - 3 - 2)
    h = sched.pool.host
    rows = [r.seq_id for r in (req, *req.samples)]
    shared = h.block[rows[0], :2]
    for row in rows[1:]:
      np.testing.assert_array_equal(h.block[row, :2], shared)
    np.testing.assert_array_equal(h.ref_count[shared], [3, 3])
    tails = [int(h.block[row, 2]) for row in rows]
    self.assertEqual(len(set(tails)), 3)  # the partial tail: each its own copy
    self.assertEqual(sched.stats.cow_splits, 2)  # the two samples' copies
    np.testing.assert_array_equal(h.ref_count[tails], [1, 1, 1])
    self._run(sched, [])
    self.assertEqual(sched.pool.num_free_blocks, total)
    self.assertEqual({r.stop_reason for r in (req, *req.samples)}, {"length"})

  def test_abort_of_one_sample_leaves_the_others(self):
    want = self._reference(max_new=12)
    sched = self._sched(enable_prefix_cache=False)
    req = Request("r", PROMPT, 12, sampling=SamplingParams(n=3))

    def abort_once(s):
      if len(req.samples[0].output) == 3 and not req.samples[0].done:
        s.abort(SampleId("r", 1))

    self._run(sched, [req], on_step=abort_once)
    first, aborted, other = req, *req.samples
    self.assertEqual((aborted.stop_reason, aborted.output), ("abort", want[:3]))
    self.assertEqual((first.output, other.output), (want, want))
    self.assertEqual(sched.pool.num_free_blocks, POOL.num_blocks)
    with self.assertRaises(paged_kv.scheduler.UnknownRequest):
      sched.abort(SampleId("r", 1))

  def test_abort_of_the_first_request_after_the_fork_leaves_its_samples(self):
    want = self._reference(max_new=12)
    sched = self._sched(enable_prefix_cache=False)
    req = Request("r", PROMPT, 12, sampling=SamplingParams(n=3))

    def abort_once(s):
      if len(req.samples[0].output) == 3 and not req.done:
        s.abort("r")

    self._run(sched, [req], on_step=abort_once)
    self.assertEqual(req.stop_reason, "abort")
    self.assertLess(len(req.output), 12)
    self.assertEqual([s.output for s in req.samples], [want, want])
    self.assertEqual(sched.pool.num_free_blocks, POOL.num_blocks)

  def test_samples_of_an_aborted_or_finished_request_run_alone(self):
    want = self._reference()
    sched = self._sched()
    req = Request("r", PROMPT, 10, sampling=SamplingParams(n=2))
    sched.submit(req)
    sched.abort("r")  # before its prompt ran: its sample is admitted as any request
    self._run(sched, [])
    self.assertEqual(req.stop_reason, "abort")
    self.assertEqual(req.samples[0].output, want)
    self.assertEqual(req.samples[0].hit_tokens, 0)
    one = Request("one", PROMPT, 1, sampling=SamplingParams(n=2))  # done at its first token
    self._run(self._sched(overlap=False), [one])
    self.assertEqual(one.samples[0].output, want[:1])

  def test_preemption_of_first_requests_and_samples_keeps_every_block(self):
    want = self._reference(max_new=40)
    sched = self._sched(output_reserve_ratio=0.0)
    reqs = [Request(i, PROMPT, 40, sampling=SamplingParams(n=2)) for i in range(4)]
    self._run(sched, reqs)
    self.assertGreater(sched.stats.preemptions, 0)
    for r in reqs:
      for s in (r, *r.samples):
        self.assertEqual(s.output, want)

  def test_a_penalized_sample_computes_its_own_prompt(self):
    sp = SamplingParams(repetition_penalty=1.5)
    want = self._reference(sp)
    req = Request("r", PROMPT, 10, sampling=SamplingParams(n=2, repetition_penalty=1.5))
    self._run(self._sched(), [req])
    self.assertEqual([r.output for r in (req, *req.samples)], [want, want])
    self.assertEqual(req.samples[0].hit_tokens, 0)

  def test_a_sample_id_in_use_is_refused_with_nothing_queued(self):
    sched = self._sched()
    sched.submit(Request(SampleId("r", 1), PROMPT, 2))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, r"its sample r#1 is in use"):
      sched.submit(Request("r", PROMPT, 2, sampling=SamplingParams(n=2)))
    self.assertEqual(len(sched.waiting), 1)


if __name__ == "__main__":
  absltest.main()
