"""Lowering tier for the model layer: the mixed step, with the impl the library picks
on a GPU (`impl=None`), lowers for `cuda` against an abstract H200 (no GPU needed).

Issue 22, read off the lowered StableHLO: the kernels get the stacked pool and the
layer index, with no value of one layer's size anywhere (the slice that becomes a
copy of the layer in the compiled step); the default decode splits K at batch 1
and long contexts; head_dim 96 falls back to a path that builds, with a warning.

Passing is necessary, not sufficient: it stops before LLVM/ptxas and times nothing.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.core.state import KVPages
from paged_kv.model import (StepMetadata, StepPlan, attention, default_impl, llama,
                            resolve_impl, steps)
from pallas_kernels import lowering

# bf16, GQA group 4, head_dim 64, 16-token blocks.
MODEL_CONFIG = llama.LlamaConfig(num_layers=2, d_model=256, num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, ffn_dim=512, dtype="bfloat16")
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=512, block_size=16, max_seqs=16,
                             max_segments=64)


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_default_impl_under_an_abstract_gpu_is_mosaic_compiled(monkeypatch):
  """Without a shape: the first of the GPU preference (Mosaic, issue 22), compiled;
  the order is configurable by argument or environment."""
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh()):
    assert default_impl() == "mosaic"
    assert resolve_impl(None) == ("mosaic", False)  # compiled, not interpreted
    assert default_impl(preference=("pallas", "mosaic")) == "pallas"
    monkeypatch.setenv("PAGED_KV_GPU_IMPLS", "pallas,mosaic,xla")
    assert default_impl() == "pallas"


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
  # Decode: the Mosaic GPU kernel (bf16, head_dim 64 builds); prefill: the generic
  # Pallas kernel lowered through Triton (there is no Mosaic prefill kernel).
  assert "mosaic_gpu" in text
  assert ("prefill_attention" in text) == (max_query_len > 1)
  assert ("triton" in text.lower()) == (max_query_len > 1)
  pool = (POOL.num_layers, POOL.num_kv_heads, POOL.num_blocks, POOL.block_size,
          POOL.head_dim)
  _assert_no_layer_copy(text, pool_shape=pool, dtype=jnp.bfloat16)


# The model-facing decode/prefill against the whole stacked pool ------------------

S = jax.ShapeDtypeStruct
_I32 = jnp.int32
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")
_DTYPE_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16",
                jnp.dtype(jnp.float32): "f32"}


def _meta_shapes(batch, num_tokens, segments, max_query_len):
  """Abstract `StepMetadata` of `batch` rows, `segments` table entries each."""
  row, tok, tab = S((batch,), _I32), S((num_tokens,), _I32), S((batch, segments), _I32)
  return StepMetadata(seq_ids=row, positions=tok, slot_mapping=tok,
                      cu_q_lens=S((batch + 1,), _I32), seg_block=tab, seg_start=tab,
                      seg_length=tab, num_segments=row, seq_lens=row,
                      num_decodes=S((), _I32), num_prefills=S((), _I32),
                      max_query_len=max_query_len)


def _lower_layer_call(*, impl, layer, num_layers=4, num_kv_heads=8, num_blocks=4096,
                      block_size=16, head_dim=128, num_q_heads=32, batch=1,
                      segments=512, max_query_len=1, dtype=jnp.bfloat16, q_dtype=None):
  """StableHLO text of one model-facing `paged_attention` call for cuda (abstract
  H200); `layer`: "traced" (an i32 argument), an int (static), or "scan" (a
  `lax.scan` over every layer)."""
  shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
  pages = KVPages(k=S(shape, dtype), v=S(shape, dtype))
  num_tokens = batch * max_query_len
  meta = _meta_shapes(batch, num_tokens, segments, max_query_len)
  q = S((num_tokens, num_q_heads, head_dim), q_dtype or dtype)
  kv = S((num_tokens, num_kv_heads, head_dim), dtype)

  def call(q, k, v, pages, meta, lyr):
    return attention.paged_attention(q, k, v, pages, lyr, meta, impl=impl)

  if layer == "scan":
    def fn(q, k, v, pages, meta):
      def body(pages, lyr):
        pages, out = call(q, k, v, pages, meta, lyr)
        return pages, out
      return jax.lax.scan(body, pages, jnp.arange(num_layers, dtype=_I32))
    args = (q, kv, kv, pages, meta)
  elif layer == "traced":
    fn, args = call, (q, kv, kv, pages, meta, S((), _I32))
  else:
    fn, args = (lambda *a: call(*a, layer)), (q, kv, kv, pages, meta)
  return lowering.lower_for_gpu(fn, *args).as_text()


def _tensor_types(text):
  """`(dims tuple, element type)` of every tensor type in `text`."""
  return [(tuple(int(d) for d in dims.split("x") if d), el)
          for dims, el in _TENSOR.findall(text)]


def _custom_call_signatures(text):
  """`(target, operand types, result types)` of every custom call (kernel)."""
  calls = []
  for line in text.splitlines():
    m = re.search(r"stablehlo\.custom_call @([\w$.]+)", line)
    if not m:
      continue
    sig = line.rsplit(" : (", 1)[-1]
    operands, _, results = sig.partition(") -> ")
    calls.append((m.group(1), _tensor_types(operands), _tensor_types(results)))
  return calls


def _assert_no_layer_copy(text, *, pool_shape, dtype, kernel=True):
  """No value in the program has one layer's worth of pages (what a
  `pages.k[layer]` slice, dynamic slice or gather would produce, and what
  becomes a copy of the layer in the compiled step); the kernel custom call
  (if `kernel`) reads the whole stacked pool (or a reshape of it)."""
  layer_size = int(np.prod(pool_shape[1:]))
  pool_size = int(np.prod(pool_shape))
  el = _DTYPE_NAMES[jnp.dtype(dtype)]
  bad = sorted({dims for dims, e in _tensor_types(text)
                if e == el and int(np.prod(dims)) == layer_size})
  assert not bad, f"a whole layer of the pool is materialised: {bad}"
  if kernel:
    calls = _custom_call_signatures(text)
    assert calls, "no kernel custom call"
    reads_pool = [t for t, ops, _ in calls
                  if any(e == el and int(np.prod(d)) == pool_size for d, e in ops)]
    assert reads_pool, f"no kernel reads the stacked pool: {calls}"


@pytest.mark.parametrize("layer", ["traced", 2, "scan"])
@pytest.mark.parametrize("impl", ["pallas", "mosaic", "xla"])
def test_decode_reads_the_stacked_pool_without_a_layer_copy(impl, layer):
  """Issue 22 (1): the decode kernel takes the stacked pages and the layer
  index; no `[num_kv_heads, num_blocks, block_size, head_dim]` slice of the pool
  exists in the lowered program, for a traced layer, a static one, or a scan."""
  text = _lower_layer_call(impl=impl, layer=layer)
  _assert_no_layer_copy(text, pool_shape=(4, 8, 4096, 16, 128), dtype=jnp.bfloat16,
                        kernel=impl != "xla")


@pytest.mark.parametrize("layer", ["traced", 1])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_mixed_step_reads_the_stacked_pool_without_a_layer_copy(impl, layer):
  """Same for a mixed step: the prefill kernel reads the stacked pool too."""
  text = _lower_layer_call(impl=impl, layer=layer, batch=4, max_query_len=16,
                           segments=128)
  _assert_no_layer_copy(text, pool_shape=(4, 8, 4096, 16, 128), dtype=jnp.bfloat16,
                        kernel=impl != "xla")
  if impl == "pallas":
    assert "prefill_attention" in text


def _split_dims(text, *, batch, num_kv_heads):
  """The split axis of every decode kernel's partial outputs
  (`[B, KVH, num_splits, rows, ...]`)."""
  return {dims[2] for _, _, results in _custom_call_signatures(text)
          for dims, _ in results if len(dims) >= 4 and dims[:2] == (batch, num_kv_heads)}


@pytest.mark.parametrize("impl", [None, "pallas", "mosaic"])
def test_default_decode_splits_a_long_context_at_batch_1(impl):
  """Issue 22 (2): at batch 1 and a 128k-token context bound (8,192 entries of
  16 tokens) the default path splits K so batch x kv heads x splits covers the
  132 SMs; a full batch of short rows is not split."""
  text = _lower_layer_call(impl=impl, layer="traced", segments=8192)
  splits = _split_dims(text, batch=1, num_kv_heads=8)
  assert splits and min(splits) > 1, splits
  assert 8 * min(splits) >= 132, splits
  text = _lower_layer_call(impl=impl, layer="traced", batch=256, segments=64)
  assert _split_dims(text, batch=256, num_kv_heads=8) == {1}


def test_head_dim_96_default_path_falls_back_with_a_warning():
  """Issue 22 (3): Phi-3-mini (32 q / 32 kv heads, head_dim 96): neither Mosaic
  (head_dim a multiple of 64) nor Triton (power of two) builds, so `impl=None`
  falls back to "xla" with a warning naming the reason, decode and prefill,
  instead of raising."""
  attention._warned.clear()
  for max_query_len in (1, 16):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      text = _lower_layer_call(impl=None, layer="traced", num_kv_heads=32,
                               num_q_heads=32, head_dim=96, batch=2, segments=64,
                               max_query_len=max_query_len)
    assert "custom_call" not in text  # the xla path: no kernel
    _assert_no_layer_copy(text, pool_shape=(4, 32, 4096, 16, 96), dtype=jnp.bfloat16,
                          kernel=False)
    if max_query_len == 1:
      msgs = [str(w.message) for w in caught]
      assert any("head_dim" in m and "'xla'" in m for m in msgs), msgs
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh()):
    shape = dict(num_q_heads=32, num_kv_heads=32, head_dim=96, block_size=16,
                 dtype=jnp.bfloat16)
    assert attention.default_impl(**shape) == "xla"
    assert attention.default_impl(**dict(shape, head_dim=128)) == "mosaic"
    # f32 pages: no bf16 wgmma; Triton builds.
    assert attention.default_impl(**dict(shape, head_dim=128, dtype=jnp.float32)) == "pallas"
