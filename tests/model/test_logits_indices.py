"""`logits_indices` (issue O item 2): a model that takes the keyword computes its output
head for the rows' last tokens only; the step's tokens and logits are the same as when
the step gathers them from every token's logits, and the compiled step proves it: for a
prefill of T=64 tokens in B=4 rows the output-head dot is `[4, vocab]`, and `[64,
vocab]` only for a model without the keyword."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import StepPlan, contract, llama, steps

# A vocabulary no other dimension of the model has, so `[n, VOCAB]` dots are the head's.
MODEL_CONFIG = llama.LlamaConfig(vocab_size=384, num_layers=2)
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=64, block_size=8, max_seqs=4,
                             max_segments=16)


class WithoutIndices(nnx.Module):
  """The same weights behind the plain contract (no `logits_indices`): the step gathers."""

  def __init__(self, inner: llama.TinyLlama):
    self.inner = inner
    self.config = inner.config

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None):
    return self.inner(tokens, pages, meta, impl=impl, interpret=interpret)


@pytest.fixture(scope="module", name="model")
def _model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(3))


def _open(state, ids):
  z = np.zeros((len(ids), 1), np.int32)
  state, status = paged_kv.open_sequence(state, np.asarray(ids, np.int32), z, z, z,
                                         np.zeros((len(ids),), np.int32), config=POOL)
  assert (np.asarray(status) == 0).all()
  return state


def test_signature_decides_the_form(model):
  assert contract.accepts_logits_indices(model)
  assert not contract.accepts_logits_indices(WithoutIndices(model))

  def catch_all(tokens, pages, meta, *, impl=None, interpret=None, **kwargs):
    del kwargs
  assert not contract.accepts_logits_indices(catch_all)  # **kwargs may drop it

  def positional(tokens, pages, meta, logits_indices=None, *, impl=None, interpret=None):
    del logits_indices
  assert contract.accepts_logits_indices(positional)
  assert not contract.accepts_logits_indices(42)
  from paged_kv.scheduler import ModelExecutor  # pylint: disable=import-outside-toplevel
  assert ModelExecutor(model, POOL).uses_logits_indices
  assert not ModelExecutor(WithoutIndices(model), POOL).uses_logits_indices


@pytest.mark.slow
def test_same_tokens_and_logits_with_and_without_indices(model):
  """Prefill, mixed prefill + decode, then decode-only plans: both forms agree."""
  forms = {}
  for name, m in (("indices", model), ("gather", WithoutIndices(model))):
    graphdef, params = nnx.split(m)
    kwargs = dict(graphdef=graphdef, config=POOL)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist() for n in (13, 21, 7))
    state = _open(paged_kv.init_pool(POOL), [0, 1, 2])
    outs = []
    plan = StepPlan.build([(0, a), (1, b[:12])], num_rows=4, max_query_len=16)
    state, (nxt, logits, status) = steps.forward(params, state, plan, **kwargs)
    outs.append((nxt, logits, status))
    plan = StepPlan.build([(0, [int(nxt[0])]), (1, b[12:]), (2, c)], num_rows=4,
                          max_query_len=16)
    state, (nxt, logits, status) = steps.forward(params, state, plan, **kwargs)
    outs.append((nxt, logits, status))
    for _ in range(3):
      plan = StepPlan.build([(i, [int(nxt[i])]) for i in range(3)], num_rows=4,
                            max_query_len=1)
      state, (nxt, logits, status) = steps.forward(params, state, plan, **kwargs)
      outs.append((nxt, logits, status))
    paged_kv.check_invariants(state)
    forms[name] = [tuple(np.asarray(x) for x in o) for o in outs]
  for (nxt_i, logits_i, status_i), (nxt_g, logits_g, status_g) in zip(forms["indices"],
                                                                       forms["gather"]):
    np.testing.assert_array_equal(status_i, 0 * status_i)
    np.testing.assert_array_equal(status_i, status_g)
    np.testing.assert_array_equal(nxt_i, nxt_g)
    assert logits_i.shape == logits_g.shape == (4, MODEL_CONFIG.vocab_size)
    np.testing.assert_allclose(logits_i, logits_g, rtol=1e-5, atol=1e-5)


def _head_dot_rows(m, num_rows: int, num_tokens: int) -> tuple[list[int], list[int] | None]:
  """Row counts of the prefill step's matmuls whose output is `[n, vocab]`: in the
  lowered StableHLO (any backend), and in the compiled HLO on CPU (None elsewhere,
  where XLA may turn dots into library calls)."""
  graphdef, params = nnx.split(m)
  state = _open(paged_kv.init_pool(POOL), list(range(num_rows)))
  per_row = num_tokens // num_rows
  rows = [(i, list(range(1, per_row + 1))) for i in range(num_rows)]
  plan = StepPlan.build(rows, num_rows=num_rows, max_query_len=per_row, num_tokens=num_tokens)
  assert plan.num_tokens == num_tokens
  lowered = steps.forward.lower(params, state, plan, graphdef=graphdef, config=POOL)
  vocab = MODEL_CONFIG.vocab_size
  stablehlo = re.compile(rf"stablehlo\.dot_general .*-> tensor<(\d+)x{vocab}xf32>")
  lowered_rows = sorted(int(m[1]) for m in stablehlo.finditer(lowered.as_text()))
  if jax.default_backend() != "cpu":
    return lowered_rows, None
  hlo = re.compile(rf"=\s*f32\[(\d+),{vocab}\]\S*\s+dot\(")
  return lowered_rows, sorted(int(m[1]) for m in hlo.finditer(lowered.compile().as_text()))


@pytest.mark.slow
def test_compiled_prefill_runs_the_head_on_the_rows_only(model):
  """T=64 tokens in B=4 rows: the head's dot is [4, vocab]; without the keyword it is
  [64, vocab] (the same probe finds it, so the guard cannot pass by accident)."""
  lowered, compiled = _head_dot_rows(model, 4, 64)
  assert lowered == [4]
  assert compiled in ([4], None)
  lowered, compiled = _head_dot_rows(WithoutIndices(model), 4, 64)
  assert lowered == [64]
  assert compiled in ([64], None)


class IgnoresIndices(nnx.Module):
  """Names `logits_indices` but returns every token's logits: a contract breach."""

  def __init__(self, inner: llama.TinyLlama):
    self.inner = inner

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None, logits_indices=None):
    del logits_indices
    return self.inner(tokens, pages, meta, impl=impl, interpret=interpret)


def test_a_model_that_ignores_the_indices_is_refused(model):
  from paged_kv.scheduler import ModelExecutor  # pylint: disable=import-outside-toplevel
  bad = IgnoresIndices(model)
  with pytest.raises(contract.ModelContractError,
                     match=r"takes logits_indices, so its logits must be floating "
                           r"\[R=1, vocab\].*prefill step \(1 row, T=16 tokens\).*\[16, 384\]"):
    ModelExecutor(bad, POOL)
  # The jitted step checks it too, while tracing (for callers that skip the executor).
  graphdef, params = nnx.split(bad)
  state = jax.eval_shape(lambda: paged_kv.init_pool(POOL))
  plan = StepPlan.build([(0, [1, 2, 3, 4, 5])], num_rows=4, max_query_len=8)
  assert plan.num_tokens == 8
  with pytest.raises(contract.ModelContractError,
                     match=r"takes logits_indices i32\[4\] but returned logits \[8, 384\]"):
    steps.forward.trace(params, state, plan, graphdef=graphdef, config=POOL)
