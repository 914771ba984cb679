"""`SamplingParams.prompt_logprobs`: each prompt token's logprob given its prefix, computed
in the jitted step, against a dense numpy reference of the tiny model's logits.

Chunked prompts (several chunks, several requests per step), a prompt whose prefix is
in the cache (computed anyway), `n > 1` (the first request carries them), and the
compile counts: with the executor built for them the warm-up compiles their programs
and a workload compiles nothing after it; without, the programs are the usual ones and
such a request is refused at submit.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest
from flax import nnx

import paged_kv
from paged_kv.model import LlamaConfig, TinyLlama, llama, pool_config_for
from paged_kv.scheduler import ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig, warmup

CONFIG = LlamaConfig(vocab_size=64, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=48, block_size=8, max_seqs=4, max_segments=16)
SCHED = dict(max_batch=4, prefill_chunk=8, prefill_token_budget=16, max_logprobs=4,
             compaction=None)


def _prompt(i, n):
  return np.random.default_rng(i).integers(0, 64, n)


def dense_prompt_logprobs(model, prompt, k):
  """Per position t >= 1: (logprob of prompt[t], its rank, the top k) from the dense model."""
  logits = np.asarray(llama.dense_forward(model, np.asarray(prompt, np.int32)[None],
                                          np.array([len(prompt)], np.int32)))[0]
  logits = logits.astype(np.float64)
  lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  lp -= logits.max(-1, keepdims=True)
  out = [None]
  for t in range(1, len(prompt)):
    row = lp[t - 1]
    target = row[prompt[t]]
    top = np.argsort(-row)[:k]
    out.append((target, 1 + int(np.sum(row > target + 1e-6)), top, row[top]))
  return out


class PromptLogprobsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = TinyLlama(CONFIG, rngs=nnx.Rngs(0))
    cls.executor = ModelExecutor(cls.model, POOL, prompt_logprobs=True)

  def _sched(self, executor=None, **config):
    return Scheduler(paged_kv.BlockPool(POOL), executor or self.executor,
                     SchedulerConfig(**dict(SCHED, **config)))

  def _check(self, req, k):
    want = dense_prompt_logprobs(self.model, req.prompt, k)
    got = req.prompt_logprobs
    self.assertLen(got, len(want))
    self.assertIsNone(got[0])
    for t in range(1, len(want)):
      lp, rank, top = got[t]
      w_lp, w_rank, w_top, w_top_lp = want[t]
      np.testing.assert_allclose(lp, w_lp, atol=2e-5, err_msg=f"position {t}")
      self.assertEqual(rank, w_rank, f"position {t}")
      self.assertEqual([i for i, _ in top], w_top.tolist(), f"position {t}")
      np.testing.assert_allclose([v for _, v in top], w_top_lp, atol=2e-5)

  def test_chunked_prompts_match_the_dense_reference(self):
    sched = self._sched()
    reqs = [Request("a", _prompt(0, 21), 3, sampling=SamplingParams(prompt_logprobs=3)),
            Request("b", _prompt(1, 5), 3, sampling=SamplingParams(prompt_logprobs=0)),
            Request("c", _prompt(2, 12), 3),  # asks nothing: none kept
            Request("d", _prompt(3, 1), 2, sampling=SamplingParams(prompt_logprobs=2))]
    for r in reqs:
      sched.submit(r)
    sched.run()
    self._check(reqs[0], 3)
    self._check(reqs[1], 0)
    self.assertIsNone(reqs[2].prompt_logprobs)
    self.assertIn(reqs[3].prompt_logprobs, (None, [None]))  # one token: nothing to score

  def test_a_cached_prefix_is_computed_again_and_samples_fork_after_it(self):
    sched = self._sched()
    prompt = _prompt(4, 19)
    sched.submit(Request("warm", prompt, 2))
    sched.run()
    req = Request("r", prompt, 4, sampling=SamplingParams(prompt_logprobs=4, n=2))
    sched.submit(req)
    sched.run()
    self.assertEqual(req.hit_tokens, 0)  # not from the cache
    self._check(req, 4)
    self.assertIsNone(req.samples[0].prompt_logprobs)
    self.assertEqual(req.samples[0].output, req.output)  # greedy
    self.assertEqual(req.samples[0].hit_tokens, 18)  # forked its row

  def test_preempted_requests_keep_theirs(self):
    sched = self._sched(output_reserve_ratio=0.0)
    reqs = [Request(i, _prompt(10 + i, 17), 100, sampling=SamplingParams(prompt_logprobs=2))
            for i in range(4)]
    for r in reqs:
      sched.submit(r)
    sched.run()
    self.assertGreater(sched.stats.preemptions, 0)
    for r in reqs:
      self._check(r, 2)

  def test_refused_without_the_executor_flag_or_beyond_max_logprobs(self):
    plain = ModelExecutor(self.model, POOL)
    sched = self._sched(plain)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, r"prompt_logprobs=True"):
      sched.submit(Request("r", _prompt(0, 4), 2, sampling=SamplingParams(prompt_logprobs=1)))
    sched = self._sched()
    with self.assertRaisesRegex(paged_kv.InvalidArgument, r"asks 5 prompt logprobs; "
                                r"SchedulerConfig.max_logprobs is 4"):
      sched.submit(Request("r", _prompt(0, 4), 2, sampling=SamplingParams(prompt_logprobs=5)))
    self.assertEqual(len(sched.waiting), 0)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, r"prompt_logprobs must be a bool"):
      ModelExecutor(self.model, POOL, prompt_logprobs=1)

  def test_warm_up_compiles_them_only_when_built_for_them(self):
    mixed = len(paged_kv.scheduler.batching.token_widths(SchedulerConfig(**SCHED))[1])
    with_flag = [r.name for r in warmup.program_runs(self._sched(), persistence=False)]
    plain = [r.name for r in warmup.program_runs(
        self._sched(ModelExecutor(self.model, POOL)), persistence=False)]
    self.assertLen(with_flag, len(plain) + mixed)
    self.assertFalse([n for n in plain if "prompt_logprobs" in n])
    sched = self._sched(decode_steps=1)
    sched.warmup(progress=False, persistence=False)
    for i in range(6):  # prompt logprobs, n > 1 (a fork's tail copy), both, neither
      sp = SamplingParams(prompt_logprobs=2 if i % 2 else None, n=1 + (i % 3 == 0))
      sched.submit(Request(i, _prompt(i, 3 + 5 * i), 4, sampling=sp))
    sched.run()
    self.assertEqual(sched.stats.admitted, 8)
    self.assertEqual(sched.stats.compiles_after_warmup, 0)


if __name__ == "__main__":
  absltest.main()
