"""The Flax NNX `PagedAttention` layer: the paged path equals its own dense reference."""

from __future__ import annotations

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx
import pytest

import paged_kv
from paged_kv.core import sequences
from paged_kv.model import PagedAttention, StepMetadata, StepPlan, apply_rope

D_MODEL, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 2, 8
CFG = paged_kv.PoolConfig(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=NUM_KV_HEADS,
                          head_dim=HEAD_DIM, max_seqs=4, max_segments=8)


def _meta(state, plan):
  state, (slot_idx, status) = sequences.reserve_tokens(
      state, plan.seq_ids, plan.num_new, config=CFG, max_new_tokens=plan.max_query_len)
  np.testing.assert_array_equal(status, 0)
  return state, StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx))


def _ragged(x_rows, plan):
  """Rows' `[n_b, D_MODEL]` inputs in the plan's ragged layout `[T, D_MODEL]`."""
  flat = np.zeros((plan.num_tokens, D_MODEL), np.float32)
  flat[:sum(len(r) for r in x_rows)] = np.concatenate(x_rows)
  return jnp.asarray(flat)


class PagedAttentionLayerTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.slow
  def test_paged_steps_equal_dense_attention(self):
    """Prefill two rows, then a mixed step (a decode and a chunk): each token's output
    equals the dense layer's output at its position over the whole sequence."""
    attn = PagedAttention(D_MODEL, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, layer=1,
                          rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(attn)

    def run(params, x, pages, meta):
      return nnx.merge(graphdef, params)(x, pages, meta)

    run = self.variant(run)
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((7, D_MODEL)).astype(np.float32),
            rng.standard_normal((9, D_MODEL)).astype(np.float32)]
    state = paged_kv.init_pool(CFG)
    z = jnp.zeros((2, 1), jnp.int32)
    state, _ = sequences.open_sequence(state, jnp.array([0, 1], jnp.int32), z, z, z,
                                      jnp.zeros((2,), jnp.int32), config=CFG)
    # Step 1: prefill 6 and 5 tokens. Step 2: row 0 decodes token 6, row 1 adds 4 tokens.
    steps = [[(0, 0, 6), (1, 0, 5)], [(0, 6, 7), (1, 5, 9)]]
    outs = {0: [], 1: []}
    for step in steps:
      plan = StepPlan.build([(s, [0] * (hi - lo)) for s, lo, hi in step], num_rows=4,
                            max_query_len=8)
      state, meta = _meta(state, plan)
      x = _ragged([seqs[s][lo:hi] for s, lo, hi in step], plan)
      pages, y = run(params, x, state.pages, meta)
      state = dataclasses.replace(state, pages=pages)
      cu = np.asarray(meta.cu_q_lens)
      for b, (s, _, _) in enumerate(step):
        outs[s].append(np.asarray(y)[cu[b]:cu[b + 1]])
    width = 9
    x = np.zeros((2, width, D_MODEL), np.float32)
    for s, seq in enumerate(seqs):
      x[s, :len(seq)] = seq
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (2, width))
    valid = positions < jnp.array([[7], [9]])
    want = np.asarray(attn.dense(jnp.asarray(x), positions, valid))
    for s, seq in enumerate(seqs):
      np.testing.assert_allclose(np.concatenate(outs[s]), want[s, :len(seq)], rtol=2e-5,
                                 atol=2e-5)

  def test_rope_rotates_by_position_for_any_leading_shape(self):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 2, HEAD_DIM)), jnp.float32)
    pos = jnp.arange(5, dtype=jnp.int32)
    flat = apply_rope(x, pos, theta=10000.0)
    batched = apply_rope(x[None], pos[None], theta=10000.0)[0]
    np.testing.assert_allclose(flat, batched, rtol=1e-6)
    np.testing.assert_allclose(flat[0], x[0], rtol=1e-6)  # position 0: identity
    np.testing.assert_allclose(jnp.linalg.norm(flat, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)

  def test_layer_validates_its_sizes(self):
    with self.assertRaisesRegex(ValueError, "multiple"):
      PagedAttention(D_MODEL, 3, 2, HEAD_DIM, layer=0, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "even"):
      PagedAttention(D_MODEL, 4, 2, 7, layer=0, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "layer"):
      PagedAttention(D_MODEL, 4, 2, HEAD_DIM, layer=-1, rngs=nnx.Rngs(0))


if __name__ == "__main__":
  absltest.main()
