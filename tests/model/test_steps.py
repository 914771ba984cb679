"""The mixed `forward` step: one jit for prefill chunks and decodes, logits equal the
dense reference, the pool is donated (updated in place), a second call compiles nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.core.errors import Status
from paged_kv.model import StepPlan, llama, steps

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=32, block_size=4, max_seqs=4,
                             max_segments=12)


@pytest.fixture(scope="module")
def model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0))


def _open(state, ids):
  z = jnp.zeros((len(ids), 1), jnp.int32)
  state, status = paged_kv.open_sequence(state, jnp.asarray(ids, jnp.int32), z, z, z,
                                         jnp.zeros((len(ids),), jnp.int32), config=POOL)
  assert (np.asarray(status) == 0).all()
  return state


@pytest.mark.slow
def test_mixed_step_matches_dense_and_compiles_once(model):
  graphdef, params = nnx.split(model)
  kwargs = dict(graphdef=graphdef, config=POOL)
  rng = np.random.default_rng(0)
  a, b, c = (rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist() for n in (9, 11, 6))
  state = _open(paged_kv.init_pool(POOL), [0, 1, 2])
  # Step 1: prefill rows 0 and 1 (9 and 8 of 11 tokens).
  plan = StepPlan.build([(0, a), (1, b[:8])], num_rows=4, max_query_len=12)
  state, (nxt1, _, status) = steps.forward(params, state, plan, **kwargs)
  np.testing.assert_array_equal(status, 0)
  # Step 2, mixed: row 0 decodes its pending token, row 1 finishes its prompt, row 2
  # prefills all of its own: three kinds of rows in one forward pass.
  pending = int(nxt1[0])
  plan = StepPlan.build([(0, [pending]), (1, b[8:]), (2, c)], num_rows=4, max_query_len=12)
  compiled = steps.forward.lower(params, state, plan, **kwargs).compile()
  pages_bytes = 2 * state.pages.k.size * state.pages.k.dtype.itemsize
  assert compiled.memory_analysis().alias_size_in_bytes >= pages_bytes
  old_k = state.pages.k
  state, (nxt2, logits, status) = steps.forward(params, state, plan, **kwargs)
  assert old_k.is_deleted()  # donated
  np.testing.assert_array_equal(status, 0)
  np.testing.assert_array_equal(np.asarray(state.table.seq_len)[:3], [10, 11, 6])
  assert int(nxt2[3]) == -1  # padding row
  # Logits after each row's last token equal the dense reference's.
  seqs = [a + [pending], b, c]
  toks = np.zeros((3, 16), np.int32)
  for i, s in enumerate(seqs):
    toks[i, :len(s)] = s
  lens = np.array([len(s) for s in seqs], np.int32)
  dense = np.asarray(llama.dense_forward(model, jnp.asarray(toks), jnp.asarray(lens)))
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(logits[i], dense[i, len(s) - 1], rtol=1e-5, atol=1e-5)
    assert int(nxt2[i]) == int(np.argmax(dense[i, len(s) - 1]))
  paged_kv.check_invariants(state)
  # Recompile guard: a plan of the same shapes (other rows, other tokens) compiles nothing.
  cache_size = steps.forward._cache_size()
  plan = StepPlan.build([(1, [int(nxt2[1])]), (0, [int(nxt2[0])]), (2, [1, 2, 3])],
                        num_rows=4, max_query_len=12, num_tokens=plan.num_tokens)
  state, (_, _, status) = steps.forward(params, state, plan, **kwargs)
  np.testing.assert_array_equal(status, 0)
  assert steps.forward._cache_size() == cache_size


def test_failed_row_is_reported_and_left_untouched(model):
  graphdef, params = nnx.split(model)
  state = _open(paged_kv.init_pool(POOL), [0, 1])
  free = int(state.meta.num_free)
  state, (_, ok) = paged_kv.allocate(state, free - 1, config=POOL, max_blocks=POOL.num_blocks,
                                     contiguous="never")
  assert int(ok) == 0
  plan = StepPlan.build([(0, [1, 2, 3]), (1, [4, 5, 6, 7, 8])], num_rows=4, max_query_len=8)
  state, (nxt, _, status) = steps.forward(params, state, plan, graphdef=graphdef, config=POOL)
  assert np.asarray(status).tolist()[:2] == [Status.OK, Status.NO_FREE_BLOCK]
  assert int(nxt[0]) >= 0 and int(nxt[1]) == -1
  assert np.asarray(state.table.seq_len)[:2].tolist() == [3, 0]
  assert int(state.table.num_segments[1]) == 0
