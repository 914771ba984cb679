"""Lowering tier for the model layer: the mixed step, with the impl the library picks
on a GPU (`impl=None`), lowers for `cuda` against an abstract H200 (no GPU needed).

Passing is necessary, not sufficient: it stops before LLVM/ptxas and times nothing.
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import StepPlan, default_impl, llama, resolve_impl, steps
from pallas_kernels import lowering

# bf16, GQA group 4, head_dim 64, 16-token blocks.
MODEL_CONFIG = llama.LlamaConfig(num_layers=2, d_model=256, num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, ffn_dim=512, dtype="bfloat16")
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=512, block_size=16, max_seqs=16,
                             max_segments=64)


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_default_impl_under_an_abstract_gpu_is_pallas_compiled():
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh()):
    assert default_impl() == "pallas"
    assert resolve_impl(None) == ("pallas", False)  # compiled, not interpreted


@pytest.mark.parametrize("max_query_len", [1, 64])
def test_mixed_step_lowers_for_cuda_with_the_default_impl(max_query_len):
  graphdef, params = nnx.split(llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0)))
  state = jax.eval_shape(lambda: paged_kv.init_pool(POOL))
  rows = [(i, [1]) for i in range(8)]
  if max_query_len > 1:
    rows += [(8, [1] * 64), (9, [1] * 40)]
  plan = StepPlan.build(rows, num_rows=16, max_query_len=max_query_len)

  def step(params, state, plan):
    return steps.forward(params, state, plan, graphdef=graphdef, config=POOL)

  lowered = lowering.lower_for_gpu(step, _shapes(params), state, _shapes(plan))
  text = lowered.as_text()
  assert "triton" in text.lower()  # the generic Pallas kernels, lowered through Triton
  assert ("prefill_attention" in text) == (max_query_len > 1)
  assert "paged_attention" in text
