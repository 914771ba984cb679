"""Presence, frequency and repetition penalties in the serving loop (vLLM's formulas).

The token history's counts and prompt masks against numpy; then penalized requests
through the scheduler (one step per dispatch, overlapped or not, and k-step decodes,
beside unpenalized and prefix-sharing neighbours), each emitted token checked
against the argmax of numpy's penalties (`np_penalties`, vLLM's documented formulas)
over the dense model's logits teacher-forced on the request's prompt and output.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
import jax
import jax.numpy as jnp

import paged_kv
from paged_kv.core.errors import InvalidArgument
from paged_kv.model import LlamaConfig, TinyLlama, llama, penalties, pool_config_for
from paged_kv.model.metadata import StepMetadata
from paged_kv.scheduler import ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig

V = 32
CONFIG = LlamaConfig(vocab_size=V, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=64, max_seqs=6, max_segments=16)


def np_penalties(logits, counts, prompt_mask, presence, frequency, repetition):
  """vLLM's documented penalties for one row, in float64: a token seen in the prompt
  or the output has its logit divided by `repetition` when positive, multiplied when
  not; then `frequency * count` and `presence * (count > 0)` are subtracted."""
  out = np.array(logits, np.float64)
  for t in range(out.shape[0]):
    if prompt_mask[t] or counts[t] > 0:
      out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    out[t] -= frequency * counts[t] + presence * (counts[t] > 0)
  return out


def _prompt(i, n=6):
  # Few distinct ids: prompts repeat tokens, so the penalties have something to see.
  return np.random.default_rng(i).integers(0, 8, n + i)


class HistoryTest(parameterized.TestCase):

  def test_counts_and_prompt_mask_match_numpy(self):
    rng = np.random.default_rng(0)
    hist = rng.integers(0, V, (5, 20)).astype(np.int32)
    seq_ids = np.array([3, -1, 0, 4], np.int32)
    seq_lens = np.array([12, 7, 20, 0], np.int32)
    prompt_len = np.array([5, 3, 20, 0], np.int32)
    counts, prompt = jax.jit(penalties.counts_and_prompt, static_argnums=4)(
        hist, seq_ids, seq_lens, prompt_len, V)
    for b, s in enumerate(seq_ids):
      want_c, want_p = np.zeros(V, int), np.zeros(V, bool)
      if s >= 0:
        toks = hist[s, :seq_lens[b]]
        want_p[toks[:prompt_len[b]]] = True
        np.add.at(want_c, toks[prompt_len[b]:], 1)
      np.testing.assert_array_equal(np.asarray(counts[b]), want_c)
      np.testing.assert_array_equal(np.asarray(prompt[b]), want_p)

  def test_record_writes_cached_tokens_at_their_positions(self):
    hist = np.full((4, 8), -7, np.int32)
    # Rows: seq 2 caches positions 3..5, seq 0 caches position 1, a padding row, and
    # seq 1 failed (slot -1): nothing of it is written; token 6 is padding.
    meta = StepMetadata(
        seq_ids=jnp.array([2, 0, -1, 1]), positions=jnp.array([3, 4, 5, 1, -1, 0, -1]),
        slot_mapping=jnp.array([9, 10, 11, 4, -1, -1, -1]),
        cu_q_lens=jnp.array([0, 3, 4, 5, 6]), seg_block=jnp.zeros((4, 1), jnp.int32),
        seg_start=jnp.zeros((4, 1), jnp.int32), seg_length=jnp.zeros((4, 1), jnp.int32),
        num_segments=jnp.zeros((4,), jnp.int32), seq_lens=jnp.zeros((4,), jnp.int32),
        num_decodes=jnp.int32(1), num_prefills=jnp.int32(1))
    out = np.asarray(penalties.record(jnp.asarray(hist), meta,
                                      jnp.array([11, 12, 13, 14, 15, 16, 17])))
    want = hist.copy()
    want[2, 3:6] = [11, 12, 13]
    want[0, 1] = 14
    np.testing.assert_array_equal(out, want)


class ServeTest(parameterized.TestCase):
  """One executor for every scheduler here: its programs compile once per loop shape."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = TinyLlama(CONFIG, rngs=nnx.Rngs(0))
    cls.executor = ModelExecutor(cls.model, POOL)

  def _serve(self, reqs, **config):
    sched = Scheduler(paged_kv.BlockPool(POOL), self.executor,
                      SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                      **config))
    for r in reqs:
      sched.submit(r)
    sched.run()
    return sched

  def _check_against_numpy(self, req):
    """Each emitted token is the argmax of numpy's penalties over the dense logits."""
    sp, prompt, out = req.sampling, [int(t) for t in req.prompt], list(req.output)
    seq = prompt + out
    logits = np.asarray(llama.dense_forward(self.model, np.asarray([seq], np.int32),
                                            np.asarray([len(seq)], np.int32)))[0]
    prompt_mask = np.zeros(V, bool)
    prompt_mask[prompt] = True
    for i, tok in enumerate(out):
      counts = np.bincount(np.asarray(out[:i], int), minlength=V)
      pen = np_penalties(logits[len(prompt) + i - 1], counts, prompt_mask,
                         sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
      # The dense logits differ from the paged ones in the last bits: a near tie may go
      # either way.
      self.assertGreaterEqual(pen[tok], pen.max() - 1e-4, f"{req.request_id} token {i}")

  @parameterized.named_parameters(
      ("overlapped", dict()), ("serial", dict(overlap=False)),
      ("k_steps", dict(decode_steps=4)))
  def test_penalized_tokens_follow_vllm_formulas(self, config):
    params = dict(
        presence=SamplingParams(presence_penalty=1.5),
        frequency=SamplingParams(frequency_penalty=0.9),
        repetition=SamplingParams(repetition_penalty=1.8),
        negative=SamplingParams(presence_penalty=-0.5, frequency_penalty=0.3,
                                repetition_penalty=0.7))
    plain = [Request(f"plain{i}", _prompt(i), 12) for i in range(len(params))]
    self._serve(plain, **config)
    reqs = {name: Request(name, _prompt(i), 12, sampling=sp)
            for i, (name, sp) in enumerate(params.items())}
    # Unpenalized neighbours, one sharing a prompt (and so a cached prefix).
    others = [Request("default", _prompt(0), 12, sampling=SamplingParams()),
              Request("greedy", _prompt(1), 12)]
    self._serve([*reqs.values(), *others], **config)
    for r in reqs.values():
      self._check_against_numpy(r)
    changed = sum(r.output != p.output for r, p in zip(reqs.values(), plain))
    self.assertGreaterEqual(changed, 3)  # the penalties act
    self.assertEqual(others[0].output, plain[0].output)  # neighbours untouched
    self.assertEqual(others[1].output, plain[1].output)

  def test_defaults_keep_greedy_and_seeded_tokens(self):
    seeded = SamplingParams(temperature=1.0, seed=7)
    a = [Request("g", _prompt(2), 10, sampling=SamplingParams()),
         Request("s", _prompt(3), 10, sampling=seeded)]
    b = [Request("g", _prompt(2), 10, sampling=SamplingParams()),
         Request("s", _prompt(3), 10, sampling=seeded),
         Request("p", _prompt(4), 10, sampling=SamplingParams(frequency_penalty=2.0,
                                                              temperature=1.0, seed=3))]
    self._serve(a)
    self._serve(b)
    self.assertEqual(a[0].output, b[0].output)
    self.assertEqual(a[1].output, b[1].output)  # seeded: independent of its neighbours

  def test_frequency_penalty_breaks_greedy_repetition(self):
    plain = Request("plain", np.zeros(4, np.int64), 24)
    pen = Request("pen", np.zeros(4, np.int64), 24,
                  sampling=SamplingParams(frequency_penalty=2.0, presence_penalty=2.0))
    self._serve([plain, pen])
    self._check_against_numpy(pen)
    self.assertGreater(len(set(pen.output)), len(set(plain.output)))

  def test_a_penalized_request_computes_its_cached_prefix(self):
    sched = Scheduler(paged_kv.BlockPool(POOL), self.executor,
                      SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16))
    prompt = _prompt(5, 20)
    sched.submit(Request("first", prompt, 2))
    sched.run()
    # Whatever the rows' histories hold now (another request's tokens): the penalized
    # request reads only what its own steps wrote.
    self.executor.history = jnp.full_like(self.executor.history, 3)
    pen = Request("pen", prompt, 12, sampling=SamplingParams(repetition_penalty=3.0))
    sched.submit(pen)
    sched.run()
    self._check_against_numpy(pen)
    self.assertEqual(pen.hit_tokens, 0)

  def test_refusals_name_the_field(self):
    sched = Scheduler(paged_kv.BlockPool(POOL), ModelExecutor(self.model, POOL, history_len=0),
                      SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16))
    with self.assertRaisesRegex(InvalidArgument, "presence_penalty.*token histories"):
      sched.submit(Request("x", _prompt(0), 4, sampling=SamplingParams(presence_penalty=1.0)))
    short = ModelExecutor(self.model, POOL, history_len=10)
    sched = Scheduler(paged_kv.BlockPool(POOL), short,
                      SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16))
    with self.assertRaisesRegex(InvalidArgument, "longer than the executor's token history"):
      sched.submit(Request("x", _prompt(0), 8, sampling=SamplingParams(
          repetition_penalty=1.2)))
    sched.submit(Request("ok", _prompt(0), 8))  # unpenalized: no bound
    with self.assertRaisesRegex(InvalidArgument, "history_len"):
      ModelExecutor(self.model, POOL, history_len=-1)
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                dict(repetition_penalty=0.0)):
      with self.assertRaisesRegex(InvalidArgument, next(iter(bad))):
        SamplingParams(**bad)


if __name__ == "__main__":
  absltest.main()
