"""vLLM's sampling surface: penalties, logit bias, min_tokens, ignore_eos, stop strings.

The device math is checked against a plain numpy implementation of the formulas vLLM
documents (repetition: divide a seen token's positive logit by the penalty, multiply a
negative one; frequency: subtract penalty x count in the output; presence: subtract
the penalty once per token in the output; logit bias: add it), jitted and not. Then
the serving loop: a bias forces a token, `min_tokens` holds a stop token back,
`ignore_eos` runs past the end-of-sequence token, a stop string ends a request with
its text stopping before the string; rows with default parameters keep today's
tokens, and a seeded row draws the same token whatever its neighbours ask.
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import paged_kv
from paged_kv.model import LlamaConfig, TinyLlama, pool_config_for
from paged_kv.model.sampling import (ADJUST_WIDTH, SamplingBatch, apply_adjustments,
                                     apply_penalties, sample)
from paged_kv.model.tokenizer import Tokenizer
from paged_kv.scheduler import ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig
from paged_kv.scheduler.sampling_params import MAX_LOGIT_ADJUSTMENTS
from paged_kv.scheduler.stop_strings import StopStringMatcher, text_until_stop

V = 24


def np_penalties(logits, counts, prompt_mask, presence, frequency, repetition):
  """vLLM's documented penalties, one row at a time, in float64."""
  out = np.array(logits, np.float64)
  for b in range(out.shape[0]):
    for t in range(out.shape[1]):
      if prompt_mask[b, t] or counts[b, t] > 0:
        x = out[b, t]
        out[b, t] = x / repetition[b] if x > 0 else x * repetition[b]
      out[b, t] -= frequency[b] * counts[b, t]
      out[b, t] -= presence[b] * (1.0 if counts[b, t] > 0 else 0.0)
  return out


def np_adjusted(logits, rows):
  """Each row's logits plus its bias; its held-back stop ids at -inf (`rows`: per row
  `(bias dict, stop ids, index, min_tokens)` or None)."""
  out = np.array(logits, np.float64)
  for b, row in enumerate(rows):
    if row is None:
      continue
    bias, stops, index, min_tokens = row
    for t, v in bias.items():
      out[b, t] += v
    if index < min_tokens:
      out[b, list(stops)] = -np.inf
  return out


def batch_for(rows, num_rows=None, hot=None):
  """A host `SamplingBatch` of `rows` (as `np_adjusted` takes them), filled the way the
  scheduler fills it (`SamplingBatch.set_row`)."""
  batch = SamplingBatch.greedy(num_rows or len(rows))
  for i, row in enumerate(rows):
    if row is None:
      continue
    bias, stops, index, min_tokens = row
    params = SamplingParams(logit_bias=bias or None, min_tokens=min_tokens,
                            **(hot[i] if hot and hot[i] else {}))
    batch.set_row(i, params, seed=hot[i]["seed"] if hot and hot[i] else 0, index=index,
                  stop_ids=stops)
  return batch


class DeviceMathTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_penalties_match_the_numpy_formulas(self):
    rng = np.random.default_rng(0)
    b = 5
    logits = rng.standard_normal((b, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (b, V)).astype(np.int32) * (rng.random((b, V)) < 0.3)
    prompt = rng.random((b, V)) < 0.25
    presence = np.array([0.0, 0.5, -1.0, 2.0, 0.3], np.float32)
    frequency = np.array([0.0, 0.2, 1.0, -0.5, 0.0], np.float32)
    repetition = np.array([1.0, 1.3, 0.7, 2.0, 1.1], np.float32)
    fn = self.variant(lambda *a: apply_penalties(*a[:3], presence=a[3], frequency=a[4],
                                                 repetition=a[5]))
    got = fn(logits, counts.astype(np.int32), prompt, presence, frequency, repetition)
    want = np_penalties(logits, counts, prompt, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])  # all off: unchanged

  @chex.variants(with_jit=True, without_jit=True)
  def test_logit_bias_and_min_tokens_match_the_numpy_formulas(self):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, V)).astype(np.float32)
    rows = [({3: 5.0, 7: -100.0}, (), 0, 0),
            ({1: 2.5}, (4, 9), 2, 5),       # index 2 < min_tokens 5: 4 and 9 held back
            ({}, (4, 9), 5, 5),             # min_tokens reached: nothing
            None]                           # default parameters
    batch = batch_for(rows)
    got = self.variant(apply_adjustments)(logits, batch)
    np.testing.assert_allclose(np.asarray(got), np_adjusted(logits, rows), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[3], logits[3])

  @chex.variants(with_jit=True, without_jit=True)
  def test_sample_applies_them_to_greedy_rows_and_leaves_default_rows_alone(self):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, V)).astype(np.float32)
    order = np.argsort(-logits, axis=-1)
    rows = [({int(order[0, 5]): 100.0}, (), 0, 0),                 # a bias decides
            ({}, (int(order[1, 0]),), 0, 3),                      # the argmax is held back
            None, None]
    out = self.variant(lambda l, b: sample(l, b, num_logprobs=2))(logits, batch_for(rows))
    want = np.argmax(np_adjusted(logits, rows), axis=-1)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    self.assertEqual(int(out.tokens[1]), int(order[1, 1]))
    np.testing.assert_array_equal(np.asarray(out.tokens)[2:], np.argmax(logits[2:], -1))
    # Logprobs stay those of the raw logits (vLLM's raw_logprobs).
    lp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(out.logprob), lp[np.arange(4), want], rtol=1e-5)

  def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours_ask(self):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, V)), jnp.float32)
    hot = dict(temperature=1.0, seed=11)
    alone = sample(logits[2:3], batch_for([({2: 1.5}, (), 4, 0)], hot=[hot]))
    rows = [({5: 100.0}, (), 0, 0), ({}, (6,), 0, 9), ({2: 1.5}, (), 4, 0), None]
    together = sample(logits, batch_for(rows, hot=[None, None, hot, None]))
    self.assertEqual(int(alone.tokens[0]), int(together.tokens[2]))
    self.assertEqual(int(together.tokens[0]), 5)

  def test_set_row_leaves_default_and_plain_greedy_rows_as_they_were(self):
    batch = SamplingBatch.greedy(3)
    batch.set_row(0, SamplingParams(), seed=5, index=7, stop_ids=frozenset({1}))
    batch.set_row(1, SamplingParams(min_tokens=2), seed=5, index=7, stop_ids=frozenset({1}))
    want = SamplingBatch.greedy(3)
    for f in dataclasses.fields(SamplingBatch):
      np.testing.assert_array_equal(getattr(batch, f.name)[0], getattr(want, f.name)[0])
    self.assertEqual(batch.adjust_ids.shape, (3, ADJUST_WIDTH))
    self.assertEqual(batch.adjust_ids[1, 0], 1)
    self.assertEqual((batch.index[1], batch.min_tokens[1]), (7, 2))


class ParamsTest(absltest.TestCase):

  def test_new_fields_are_checked_by_name(self):
    for kw, name in ((dict(presence_penalty=2.5), "presence_penalty"),
                     (dict(frequency_penalty=-3), "frequency_penalty"),
                     (dict(repetition_penalty=0.0), "repetition_penalty"),
                     (dict(min_tokens=-1), "min_tokens"),
                     (dict(logit_bias={1: 101.0}), r"logit_bias\[1\]"),
                     (dict(logit_bias={-1: 1.0}), "logit_bias key"),
                     (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
                     (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_ADJUSTMENTS + 1)}),
                      "at most"),
                     (dict(ignore_eos=1), "ignore_eos"),
                     (dict(prompt_logprobs=-1), "prompt_logprobs"),
                     (dict(stop=[""]), "non-empty"), (dict(stop=5), "stop must be"),
                     (dict(n=0), r"\.n must")):
      with self.assertRaisesRegex(paged_kv.InvalidArgument, name, msg=repr(kw)):
        SamplingParams(**kw)

  def test_defaults_are_the_old_ones_and_json_round_trips(self):
    sp = SamplingParams()
    self.assertTrue(sp.greedy and not sp.penalized)
    self.assertEqual((sp.logit_bias, sp.stop, sp.n, sp.min_tokens), (None, (), 1, 0))
    full = SamplingParams(logit_bias={"5": -2, 3: 1.0}, stop="##", min_tokens=2,
                          ignore_eos=True, presence_penalty=0.5)
    self.assertEqual(full.logit_bias, {5: -2.0, 3: 1.0})
    self.assertEqual(full.stop, ("##",))
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(full))))
    self.assertEqual(again, full)


class FakeTokens:
  """A tokenizers-like object: id i is the letter 'a' + i % 26."""

  def decode(self, ids, skip_special_tokens=True):
    del skip_special_tokens
    return "".join(chr(97 + i % 26) for i in ids)


TOKENIZER = Tokenizer(FakeTokens())


class StopStringTest(absltest.TestCase):

  def test_text_stops_before_the_first_stop_string_to_complete(self):
    m = StopStringMatcher(TOKENIZER, ["cde", "dx", "bc"])
    shown = [m.add(t) for t in (0, 1)]  # "a", "b": "b" may start "bc": held
    self.assertEqual(shown, ["a", ""])
    self.assertFalse(m.stopped)
    self.assertEqual(m.add(2), "")       # "abc": "bc" completes first
    self.assertEqual((m.stopped, m.stop, m.text), (True, "bc", "a"))
    self.assertEqual(m.add(3), "")       # ignored after the stop

  def test_held_text_comes_out_when_it_cannot_start_a_stop(self):
    m = StopStringMatcher(TOKENIZER, ["cd"])
    self.assertEqual([m.add(t) for t in (2, 4, 2)], ["", "ce", ""])
    self.assertEqual(m.flush(), "c")
    self.assertEqual(m.text, "cec")
    self.assertEqual(text_until_stop(TOKENIZER, [0, 2, 3, 4], ["cd"]), "a")
    self.assertEqual(text_until_stop(TOKENIZER, [0, 2], ["cd"]), "ac")


CONFIG = LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=48, max_seqs=4, max_segments=16)


def _prompt(i):
  return np.random.default_rng(i).integers(0, 32, 5 + i)


class ServeTest(absltest.TestCase):
  """One executor for every scheduler here: its programs compile once."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.executor = ModelExecutor(TinyLlama(CONFIG, rngs=nnx.Rngs(0)), POOL,
                                 tokenizer=TOKENIZER)

  def _serve(self, reqs, **config):
    sched = Scheduler(paged_kv.BlockPool(POOL), self.executor,
                      SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                      **config))
    for r in reqs:
      sched.submit(r)
    sched.run()
    return sched

  def test_bias_min_tokens_ignore_eos_and_stop_strings_in_the_loop(self):
    plain = [Request(i, _prompt(i), 8) for i in (1, 2)]
    self._serve(plain)
    ref1, ref2 = plain[0].output, plain[1].output
    eos = ref1[1]
    text = TOKENIZER.decode(ref2)
    stop = text[3:5]
    reqs = dict(
        default=Request("default", _prompt(1), 8, sampling=SamplingParams()),
        bias=Request("bias", _prompt(1), 8, sampling=SamplingParams(logit_bias={7: 100.0})),
        min_tokens=Request("min_tokens", _prompt(1), 8, sampling=SamplingParams(min_tokens=4)),
        ignore_eos=Request("ignore_eos", _prompt(1), 8,
                           sampling=SamplingParams(ignore_eos=True)),
        stop=Request("stop", _prompt(2), 8, sampling=SamplingParams(stop=["zzz", stop])))
    self._serve(list(reqs.values()), stop_token=eos)
    out = {k: r.output for k, r in reqs.items()}
    self.assertEqual(out["default"], ref1[:2])                  # ends on the EOS token
    self.assertEqual(reqs["default"].stop_reason, "stop_token")
    self.assertEqual(out["bias"], [7] * 8)
    self.assertGreaterEqual(len(out["min_tokens"]), 4)
    self.assertNotIn(eos, out["min_tokens"][:4])
    self.assertEqual(out["ignore_eos"], ref1)                   # past the EOS, same tokens
    self.assertEqual(reqs["ignore_eos"].stop_reason, "length")
    end = text.index(stop) + len(stop)
    self.assertEqual(reqs["stop"].stop_reason, "stop_string")
    self.assertEqual(out["stop"], ref2[:end])                   # the completing token kept
    self.assertEqual(text_until_stop(TOKENIZER, out["stop"], ["zzz", stop]),
                     text[:text.index(stop)])


if __name__ == "__main__":
  absltest.main()
