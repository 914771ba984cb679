"""`Scheduler.submit` refuses, by name, what the model or the loop would get wrong.

Token ids outside the executor's vocabulary (prompt, forced output, stop ids, logit
bias keys, the scheduler's stop token) would be clamped or wrapped inside the step;
sampling the loop does not apply would be ignored. Each is an `InvalidArgument` at
`submit`, and nothing is queued.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import paged_kv
from paged_kv.model import LlamaConfig, TinyLlama, pool_config_for
from paged_kv.scheduler import DryExecutor, ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig

CONFIG = LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=32, max_seqs=4, max_segments=16)


class SubmitChecksTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.executor = ModelExecutor(TinyLlama(CONFIG, rngs=nnx.Rngs(0)), POOL)

  def _sched(self, executor=None, **config):
    return Scheduler(paged_kv.BlockPool(POOL), executor or self.executor,
                     SchedulerConfig(max_batch=2, prefill_chunk=8, **config))

  def test_the_executor_knows_the_vocabulary(self):
    self.assertEqual(self.executor.vocab_size, 32)

  @parameterized.named_parameters(
      ("prompt_too_large", dict(prompt=[1, 32, 5]), r"prompt has 1 id\(s\) outside the "
       r"vocabulary \[0, 32\) \(e.g. \[32\] at \[1\]\)"),
      ("prompt_negative", dict(prompt=[-1, 2]), r"prompt has 1 id.*\[-1\] at \[0\]"),
      ("forced_output", dict(forced_output=[1, 99, 2, 3]), r"forced_output has 1 id.*\[99\]"),
      ("stop_id", dict(sampling=SamplingParams(stop_token_ids=[40])),
       r"sampling.stop_token_ids has 1 id.*\[40\]"),
      ("logit_bias", dict(sampling=SamplingParams(logit_bias={3: 1.0, 32: -1.0})),
       r"sampling.logit_bias has 1 id.*\[32\]"),
      ("prompt_logprobs", dict(sampling=SamplingParams(prompt_logprobs=1)),
       r"prompt_logprobs needs an executor built to compute them"),
      ("stop_strings", dict(sampling=SamplingParams(stop=["."])),
       r"sampling.stop needs the executor's tokenizer to decode text"),
      ("min_tokens", dict(sampling=SamplingParams(min_tokens=9)),
       r"min_tokens=9 > max_new_tokens=4"),
      ("adjustments", dict(sampling=SamplingParams(
          logit_bias={i: 1.0 for i in range(16)}, min_tokens=1, stop_token_ids=[20])),
       r"16 logit_bias entries and 1 stop ids.*17 logit adjustments; at most 16"))
  def test_refused_at_submit_with_nothing_queued(self, fields, pattern):
    sched = self._sched()
    args = {"prompt": [1, 2, 3], **fields}
    req = Request("r", np.asarray(args.pop("prompt")), 4, **args)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, pattern):
      sched.submit(req)
    self.assertEqual(len(sched.waiting), 0)
    sched.submit(Request("ok", np.asarray([1, 2, 3]), 2))  # the scheduler still serves
    self.assertEqual(len(sched.waiting), 1)

  def test_a_stop_token_outside_the_vocabulary_is_named(self):
    sched = self._sched(stop_token=32)
    with self.assertRaisesRegex(paged_kv.InvalidArgument,
                                r"SchedulerConfig.stop_token 32 is outside the model's "
                                r"vocabulary \[0, 32\)"):
      sched.submit(Request("r", np.asarray([1, 2]), 2))

  def test_an_executor_without_a_vocabulary_is_not_checked(self):
    sched = self._sched(DryExecutor(POOL))
    sched.submit(Request("r", np.asarray([1, 2, 1000]), 2))
    self.assertEqual(len(sched.waiting), 1)


if __name__ == "__main__":
  absltest.main()
