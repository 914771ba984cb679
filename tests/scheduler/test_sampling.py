"""Sampling inside the jitted step (`paged_kv.model.sampling`, `SamplingParams`).

Greedy stays the argmax, bit for bit; each filter keeps what it should (checked
against a numpy re-implementation over many draws); a seed reproduces a request's
tokens whatever shares its batches; logprobs are the raw log-softmax; per-request stop
ids end requests; the whole path serves through `ModelExecutor` with nothing compiled
after warm-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
import pytest

import paged_kv
from paged_kv.model import LlamaConfig, TinyLlama, pool_config_for
from paged_kv.model.sampling import SamplingBatch, sample
from paged_kv.scheduler import ModelExecutor, Request, SamplingParams, Scheduler, SchedulerConfig

V = 16


def _batch(b, **kw):
  base = SamplingBatch.greedy(b)
  arrays = {f.name: getattr(base, f.name).copy() for f in base.__dataclass_fields__.values()}
  for k, v in kw.items():
    arrays[k][:] = v
  return SamplingBatch(**arrays)


def _draws(logits, n=400, **kw):
  """`n` draws of row 0 with distinct output indices (fresh keys), jitted once."""
  b = _batch(n, **kw)
  b = SamplingBatch(**{**b.__dict__, "index": np.arange(n, dtype=np.int32)})
  out = jax.jit(sample)(jnp.tile(logits[None], (n, 1)), b)
  return np.asarray(out.tokens)


class SampleTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.logits = jnp.asarray(np.random.default_rng(0).standard_normal((V,)) * 2, jnp.float32)

  def test_greedy_is_the_argmax(self):
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((8, V)), jnp.float32)
    out = jax.jit(sample)(logits, SamplingBatch.greedy(8))
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))

  def test_top_k_keeps_the_k_most_likely(self):
    got = set(_draws(self.logits, temperature=2.0, top_k=3).tolist())
    want = set(np.argsort(-np.asarray(self.logits))[:3].tolist())
    self.assertEqual(got, want)  # 400 draws at temperature 2 reach all three

  def test_top_p_keeps_the_smallest_covering_set(self):
    p = np.exp(np.asarray(self.logits) - np.asarray(self.logits).max())
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    allowed = set(order[before < 0.6].tolist())
    got = set(_draws(self.logits, temperature=1.0, top_p=0.6).tolist())
    self.assertTrue(got <= allowed, (got, allowed))
    self.assertGreater(len(got), 0)

  def test_min_p_drops_the_unlikely(self):
    p = np.exp(np.asarray(self.logits) - np.asarray(self.logits).max())
    allowed = set(np.flatnonzero(p >= 0.3).tolist())  # relative to the most likely (p=1)
    got = set(_draws(self.logits, temperature=1.0, min_p=0.3).tolist())
    self.assertTrue(got <= allowed and got, (got, allowed))

  def test_sampling_follows_the_distribution(self):
    draws = _draws(self.logits, n=4000, temperature=1.0)
    p = np.exp(np.asarray(self.logits) - np.asarray(self.logits).max())
    p /= p.sum()
    freq = np.bincount(draws, minlength=V) / draws.size
    self.assertLess(np.abs(freq - p).max(), 0.04)

  def test_a_seed_and_index_give_the_same_token_in_any_batch(self):
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((4, V)), jnp.float32)
    b = _batch(4, temperature=1.0, seed=[7, 8, 9, 10], index=[3, 3, 3, 3])
    alone = jax.jit(sample)(logits[2:3], _batch(1, temperature=1.0, seed=9, index=3))
    together = jax.jit(sample)(logits, b)
    self.assertEqual(int(alone.tokens[0]), int(together.tokens[2]))

  def test_logprobs_are_the_raw_log_softmax(self):
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, V)), jnp.float32)
    out = sample(logits, _batch(2, temperature=0.5), num_logprobs=4)
    lp = np.asarray(jax.nn.log_softmax(logits))
    order = np.argsort(-lp, axis=-1)[:, :4]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lp, order, -1), rtol=1e-6)
    np.testing.assert_allclose(out.logprob, lp[np.arange(2), np.asarray(out.tokens)], rtol=1e-6)


class SamplingParamsTest(absltest.TestCase):

  def test_fields_are_checked(self):
    for kw in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
               dict(min_p=2), dict(seed=-1), dict(seed=2**33), dict(logprobs=-1),
               dict(stop_token_ids=5), dict(stop_token_ids=[-2]), dict(temperature=True)):
      with self.assertRaises(paged_kv.InvalidArgument, msg=repr(kw)):
        SamplingParams(**kw)
    self.assertEqual(SamplingParams(stop_token_ids=[3, 4]).stop_token_ids, (3, 4))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "sampling must be a SamplingParams"):
      Request(0, [1, 2], 2, sampling=dict(temperature=1.0))


CONFIG = LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=48, max_seqs=4, max_segments=16)


def _serve(reqs, *, max_logprobs=2, warm=False, seed=0):
  model = TinyLlama(CONFIG, rngs=nnx.Rngs(0))
  sched = Scheduler(paged_kv.BlockPool(POOL), ModelExecutor(model, POOL),
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    max_logprobs=max_logprobs, seed=seed))
  if warm:
    sched.warmup(progress=False)
  for r in reqs:
    sched.submit(r)
  sched.run()
  return sched


def _prompt(i):
  return np.random.default_rng(i).integers(0, 32, 5 + i)


@pytest.mark.slow
class ServeTest(absltest.TestCase):

  def test_default_params_are_greedy_and_seeds_reproduce(self):
    plain = [Request(i, _prompt(i), 6) for i in range(3)]
    greedy = [Request(i, _prompt(i), 6, sampling=SamplingParams()) for i in range(3)]
    _serve(plain)
    _serve(greedy)
    self.assertEqual([r.output for r in plain], [r.output for r in greedy])
    hot = lambda: [Request(i, _prompt(i), 6, sampling=SamplingParams(temperature=1.5, seed=i))
                   for i in range(3)]
    a, b = hot(), hot()
    _serve(a)
    _serve(b[1:2] + b[:1] + b[2:])  # other submit order, other batches
    self.assertEqual([r.output for r in a], [r.output for r in b])
    self.assertNotEqual([r.output for r in a], [r.output for r in plain])
    self.assertTrue(all(0 <= t < 32 for r in a for t in r.output))

  def test_logprobs_and_stop_ids(self):
    probe = Request("p", _prompt(1), 6)
    _serve([probe])
    stop = probe.output[2]
    r = Request("s", _prompt(1), 6, sampling=SamplingParams(logprobs=2, stop_token_ids=[stop]))
    q = Request("q", _prompt(2), 4, sampling=SamplingParams(temperature=0.7, seed=1, logprobs=1))
    # Logit adjustments ride in the same programs (static widths): nothing compiles.
    b = Request("b", _prompt(3), 4, sampling=SamplingParams(logit_bias={3: 100.0}, min_tokens=2,
                                                            stop_token_ids=[3]))
    sched = _serve([r, q, b], warm=True)
    self.assertEqual((len(b.output), b.output[2], b.stop_reason), (3, 3, "stop_token"))
    self.assertNotIn(3, b.output[:2])  # held back until min_tokens, then the bias wins
    self.assertEqual(r.stop_reason, "stop_token")
    self.assertEqual(r.output, probe.output[:probe.output.index(stop) + 1])
    for req, n in ((r, 2), (q, 1)):
      self.assertEqual(len(req.logprobs), len(req.output))
      for token, (lp, top) in zip(req.output, req.logprobs):
        self.assertEqual(len(top), n)
        self.assertLessEqual(lp, 0.0)
        self.assertGreaterEqual(top[0][1], lp - 1e-6)  # the best is at least the chosen
    self.assertTrue(all(top[0][0] == tok for tok, (_, top) in zip(r.output, r.logprobs)))
    self.assertEqual(sched.stats.compiles_after_warmup, 0)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "max_logprobs"):
      sched.submit(Request("x", [1, 2], 2, sampling=SamplingParams(logprobs=3)))


if __name__ == "__main__":
  absltest.main()
