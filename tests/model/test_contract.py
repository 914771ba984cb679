"""The model contract (`paged_kv.model.contract`): a model that meets it serves; each way
of breaking it is refused when `ModelExecutor` is built, with a message naming it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from absl.testing import absltest, parameterized
from flax import nnx

import paged_kv
from paged_kv.model import (LlamaConfig, ModelContractError, PagedModel, TinyLlama,
                            check_model, last_token_index, pool_config_for)
from paged_kv.scheduler import ModelExecutor

CONFIG = LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=8, ffn_dim=32)
POOL = pool_config_for(CONFIG, num_blocks=16, max_seqs=4, max_segments=8)


class Wrapped(nnx.Module):
  """Delegates to a TinyLlama, then breaks the contract as `how` says."""

  def __init__(self, how: str):
    self.inner = TinyLlama(CONFIG, rngs=nnx.Rngs(0))
    self.how = how

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None):
    given = pages
    pages, logits = self.inner(tokens, pages, meta, impl=impl, interpret=interpret)
    if self.how == "swapped":  # paged_kv 0.1's order
      return logits, pages
    if self.how == "last_only":
      return pages, logits[:2]
    if self.how == "rows_last_tokens":  # a vLLM-style compute_logits, no logits_indices
      return pages, logits[last_token_index(meta.cu_q_lens, tokens.shape[0])]
    if self.how == "given_pages":
      return given, logits
    if self.how == "int_logits":
      return pages, logits.astype(jnp.int32)
    if self.how == "pages_dtype":
      return paged_kv.KVPages(k=pages.k.astype(jnp.bfloat16), v=pages.v), logits
    if self.how == "one_output":
      return logits
    if self.how == "raises":
      raise RuntimeError("inside the model")
    return pages, logits


class NoAttention(nnx.Module):
  """Right shapes, but no K/V is ever written: every later step attends to nothing."""

  def __init__(self):
    self.embed = nnx.Embed(CONFIG.vocab_size, CONFIG.vocab_size, rngs=nnx.Rngs(0))

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None):
    return pages, self.embed(tokens)


class ConfigLess(nnx.Module):
  """A TinyLlama of `num_layers` behind a model without a `config`."""

  def __init__(self, num_layers: int, scan_layers: bool):
    config = dataclasses.replace(CONFIG, num_layers=num_layers, scan_layers=scan_layers)
    self.inner = TinyLlama(config, rngs=nnx.Rngs(0))

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None):
    return self.inner(tokens, pages, meta, impl=impl, interpret=interpret)


class NoKeywords(nnx.Module):

  def __call__(self, tokens, pages, meta):
    return pages, tokens


class ContractTest(parameterized.TestCase):

  def test_the_reference_model_meets_it(self):
    model = TinyLlama(CONFIG, rngs=nnx.Rngs(0))
    self.assertIsInstance(model, PagedModel)
    self.assertEqual(check_model(model, POOL), CONFIG.vocab_size)
    self.assertEqual(ModelExecutor(model, POOL).vocab_size, CONFIG.vocab_size)
    self.assertEqual(check_model(Wrapped("ok"), POOL), CONFIG.vocab_size)

  @parameterized.named_parameters(
      ("swapped", "swapped", r"returned \(logits, pages\).*order is \(pages, logits\)"),
      ("last_only", "last_only", r"logits must be floating \[T=4, vocab\].*decode step.*"
       r"\[2, 32\]"),
      ("rows_last_tokens", "rows_last_tokens", r"logits must be floating \[T=16, vocab\].*"
       r"prefill step \(1 row, T=16 tokens\); got float32\[1, 32\]: logits for each "
       r"row's last token only"),
      ("given_pages", "given_pages", r"returned the pages it was given"),
      ("int_logits", "int_logits", r"logits must be floating"),
      ("pages_dtype", "pages_dtype", r"pages.k bfloat16.*the pool's are float32"),
      ("one_output", "one_output", r"must return \(pages, logits\)"),
      ("raises", "raises", r"failed on an abstract decode step.*RuntimeError: inside the model"))
  def test_each_breach_is_named(self, how, pattern):
    with self.assertRaisesRegex(ModelContractError, pattern):
      ModelExecutor(Wrapped(how), POOL)

  def test_a_model_that_never_calls_paged_attention_is_refused(self):
    with self.assertRaisesRegex(ModelContractError, "NoAttention never calls paged_attention"):
      ModelExecutor(NoAttention(), POOL)

  @parameterized.named_parameters(("scanned", True), ("unrolled", False))
  def test_the_pools_layer_count_must_be_the_models(self, scan_layers):
    model = ConfigLess(2, scan_layers)
    self.assertEqual(check_model(model, dataclasses.replace(POOL, num_layers=2)),
                     CONFIG.vocab_size)
    more = dataclasses.replace(POOL, num_layers=3)
    pattern = (r"calls paged_attention 2 times per step.*the pool has 3 layers" if scan_layers
               else r"writes pool layers \[0, 1\].*the pool has 3 \(layers never written: "
                    r"\[2\]")
    with self.assertRaisesRegex(ModelContractError, pattern):
      ModelExecutor(model, more)
    fewer = dataclasses.replace(POOL, num_layers=1)
    pattern = (r"calls paged_attention 2 times per step.*the pool has 1 layers" if scan_layers
               else r"failed on an abstract decode step.*layer 1 outside \[0, 1\)")
    with self.assertRaisesRegex(ModelContractError, pattern):
      ModelExecutor(model, fewer)

  def test_missing_keywords_and_non_callables(self):
    with self.assertRaisesRegex(ModelContractError, "keywords impl= and interpret="):
      ModelExecutor(NoKeywords(), POOL)
    with self.assertRaisesRegex(ModelContractError, "must be callable"):
      check_model(42, POOL)
    self.assertTrue(issubclass(ModelContractError, paged_kv.InvalidArgument))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "pool_config must be a PoolConfig"):
      ModelExecutor(TinyLlama(CONFIG, rngs=nnx.Rngs(0)), "pool")


if __name__ == "__main__":
  absltest.main()
