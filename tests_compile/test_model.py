"""Compile tier, model: what the model runs on a GPU (`impl=None`), compiled for
an H200 with the pool donated.

  * `paged_kv.model.attention.paged_attention` (one layer's write + attend) at
    real-model shapes, decode-only and mixed prefill/decode;
  * one decoder layer of the reference model (`llama.DecoderBlock`);
  * the reference model's jitted steps: `decode_step`, `prefill`, `forward`
    (mixed), `forward` with host-reserved slots (`plan.reserved`: the serving
    loop's step, no allocator) and `decode_multi` (a `lax.scan` of decode steps),
    with the layers scanned (the default: the pages ride in the scan's carry), and
    `forward` with the layers unrolled (`scan_layers=False`).

Each: it compiles; the donated pages are written in place (aliased in -> out);
no copy and no scratch grows with the pool (`tier.assert_no_pool_copy`); the
scanned steps keep the layers' loop after XLA's passes (one loop of
`num_layers` trips); and at batch 1 the decode kernel's grid covers the SMs
(split-K). Each of these
failed on the main of 2026-12-02 (a per-layer pool copy, no split-K, head_dim 96
refused) and passes since the fixes of issue M.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import paged_kv
from paged_kv.core.state import KVPages
from paged_kv.model import StepMetadata, StepPlan, attention, llama, steps
from paged_kv.model.plan import ReservedSlots, TailGrowth
from tests_compile import tier
from tests_compile.tier import Attn, I32, S

NUM_LAYERS = 4
LAYER = 2


def _meta(rows: int, tokens: int, segments: int, max_query_len: int) -> StepMetadata:
  return StepMetadata(
      seq_ids=S((rows,), I32), positions=S((tokens,), I32), slot_mapping=S((tokens,), I32),
      cu_q_lens=S((rows + 1,), I32), seg_block=S((rows, segments), I32),
      seg_start=S((rows, segments), I32), seg_length=S((rows, segments), I32),
      num_segments=S((rows,), I32), seq_lens=S((rows,), I32), num_decodes=S((), I32),
      num_prefills=S((), I32), max_query_len=max_query_len)


def _attend(q, k, v, pages, meta, *, layer):
  return attention.paged_attention(q, k, v, pages, layer, meta)


def compile_attention(a: Attn, *, max_query_len: int = 1, tokens: int | None = None):
  """`attention.paged_attention(impl=None)` on layer `LAYER` of a
  `NUM_LAYERS`-layer pool, pages donated."""
  tokens = a.batch if max_query_len == 1 else tokens
  qkv = lambda heads: S((tokens, heads, a.head_dim), a.q_dtype)
  pages = KVPages(k=a.pages(NUM_LAYERS), v=a.pages(NUM_LAYERS))
  meta = _meta(a.batch, tokens, a.segments, max_query_len)
  return tier.compile_program(_attend, qkv(a.num_q_heads), qkv(a.num_kv_heads),
                              qkv(a.num_kv_heads), pages, meta, donate_argnums=(3,),
                              layer=LAYER)


# Decode-only steps of real models (bf16, f16, fp8 pages; groups 1 to 8).
ATTENTION = [
    Attn("llama3-8b", 32, 8, 128, 16, batch=64, context=8192),
    Attn("llama3-70b", 64, 8, 128, 64, batch=256, context=1024),
    Attn("qwen2-7b", 28, 4, 128, 32, batch=8, context=32768, dtype="float16"),
    Attn("tinyllama", 32, 4, 64, 16, batch=128, context=2048),
    Attn("gemma-2b", 8, 1, 256, 16, batch=32, context=8192),
    Attn("llama3-8b-fp8", 32, 8, 128, 16, batch=64, context=8192, dtype="float8_e4m3fn"),
]
LONG = Attn("llama3-8b", 32, 8, 128, 16, batch=1, context=131072)
MIXED = Attn("llama3-8b", 32, 8, 128, 16, batch=16, context=8192)
PHI3 = Attn("phi3-mini", 32, 32, 96, 16, batch=16, context=4096)


@functools.lru_cache(maxsize=None)
def _attention_program(a: Attn, max_query_len: int = 1):
  return compile_attention(a, max_query_len=max_query_len,
                           tokens=None if max_query_len == 1 else 512)


@pytest.mark.parametrize("shape", ATTENTION, ids=lambda a: a.id)
def test_attention_compiles_in_place(shape):
  """Whichever impl `impl=None` picks: it compiles, writes the pages in place,
  and its Mosaic GPU kernels (if it picks them) do not spill."""
  prog = _attention_program(shape)
  tier.assert_aliased(prog, ("pages.k", "pages.v"), 2 * NUM_LAYERS * shape.layer_pool_bytes)
  assert tier.has_kernel(prog, "decode_attention"), prog.summary()
  tier.assert_no_spills(prog)


@pytest.mark.parametrize("shape", ATTENTION, ids=lambda a: a.id)
def test_attention_copies_no_pool(shape):
  tier.assert_no_pool_copy(_attention_program(shape), shape.layer_pool_bytes)


def test_mixed_attention_compiles_in_place():
  """Prefill chunks and decodes in one call: both kernels, pages in place."""
  prog = _attention_program(MIXED, 64)
  assert tier.has_kernel(prog, "prefill_attention"), prog.summary()
  assert tier.has_kernel(prog, "decode_attention"), prog.summary()
  tier.assert_aliased(prog, ("pages.k", "pages.v"), 2 * NUM_LAYERS * MIXED.layer_pool_bytes)
  tier.assert_no_spills(prog)


def test_mixed_attention_copies_no_pool():
  tier.assert_no_pool_copy(_attention_program(MIXED, 64), MIXED.layer_pool_bytes)


@pytest.mark.parametrize("mixed_launches", [2, 1])
def test_mixed_attention_mosaic_compiles_in_place(mixed_launches):
  """`impl="mosaic"`: the Mosaic prefill kernel serves the prefill rows after the
  decode kernel (2 launches) or every row alone (1); pages in place, no pool
  copy, no spill."""
  a = MIXED
  qkv = lambda heads: S((512, heads, a.head_dim), a.q_dtype)
  attend = lambda q, k, v, pages, meta: attention.paged_attention(
      q, k, v, pages, LAYER, meta, impl="mosaic", mixed_launches=mixed_launches)
  prog = tier.compile_program(
      attend, qkv(a.num_q_heads), qkv(a.num_kv_heads), qkv(a.num_kv_heads),
      KVPages(k=a.pages(NUM_LAYERS), v=a.pages(NUM_LAYERS)),
      _meta(a.batch, 512, a.segments, 64), donate_argnums=(3,))
  assert len(prog.mosaic_kernels()) == mixed_launches, prog.summary()
  assert tier.has_kernel(prog, "prefill_attention"), prog.summary()
  tier.assert_aliased(prog, ("pages.k", "pages.v"), 2 * NUM_LAYERS * a.layer_pool_bytes)
  tier.assert_no_pool_copy(prog, a.layer_pool_bytes)
  tier.assert_no_spills(prog)


def test_decode_split_k_at_batch_1():
  """Batch 1 x 128k context, 8 kv heads: the default path's decode kernel must
  launch at least one program per SM (132)."""
  prog = _attention_program(LONG)
  programs = tier.decode_programs(prog)
  assert programs >= tier.NUM_SMS, (
      f"decode kernel launches {programs} programs at batch 1 (< {tier.NUM_SMS} SMs): "
      f"no split-K\n{prog.summary()}")


def test_head_dim_96_builds_on_the_default_path():
  """Phi-3 (32 heads of 96): `impl=None` must pick an impl that builds."""
  try:
    prog = _attention_program(PHI3)
  except ValueError as e:
    if "power-of-two head_dim" not in str(e):
      raise
    raise AssertionError(f"impl=None refuses head_dim 96: {e}") from e
  tier.assert_aliased(prog, ("pages.k", "pages.v"), 2 * NUM_LAYERS * PHI3.layer_pool_bytes)


# The reference model -----------------------------------------------------------------

# Llama-3-8B attention (32/8 heads of 128, bf16, 16-token blocks) in a narrow,
# shallow model: the compile covers every op of a layer without 32 layers of
# 4096-wide matmuls. The pool holds 16,384 blocks (536 MB of K per layer). Three
# layers: a trip count no other loop of the steps has.
MODEL = llama.LlamaConfig(vocab_size=256, d_model=512, num_layers=3, num_q_heads=32,
                          num_kv_heads=8, head_dim=128, ffn_dim=1024, dtype="bfloat16",
                          scan_layers=True)
UNROLLED = dataclasses.replace(MODEL, scan_layers=False)
POOL = llama.pool_config_for(MODEL, num_blocks=16384, block_size=16, max_seqs=64,
                             max_segments=512)
LAYER_POOL_BYTES = 8 * 16384 * 16 * 128 * 2
ROWS, CHUNK = 16, 64


def _shapes(tree):
  return jax.tree.map(lambda a: S(a.shape, a.dtype), tree)


@functools.lru_cache(maxsize=None)
def _model(config: llama.LlamaConfig = MODEL):
  graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.TinyLlama(config,
                                                                      rngs=nnx.Rngs(0))))
  return graphdef, _shapes(params), _shapes(jax.eval_shape(lambda: paged_kv.init_pool(POOL)))


def _layer_call(params, x, pages, meta, *, graphdef):
  block = nnx.merge(graphdef, params)
  return block(x, pages, meta)


@functools.lru_cache(maxsize=None)
def _step_program(step: str):
  graphdef, params, state = _model(UNROLLED if step == "forward_unrolled" else MODEL)
  ids = S((ROWS,), I32)
  kw = dict(graphdef=graphdef, config=POOL)
  if step == "layer":
    block_def, block_params = nnx.split(nnx.eval_shape(
        lambda: llama.DecoderBlock(MODEL, layer=1, rngs=nnx.Rngs(0))))
    meta = _meta(ROWS, ROWS, POOL.max_segments, 1)
    return tier.compile_program(_layer_call, _shapes(block_params),
                                S((ROWS, MODEL.d_model), jnp.bfloat16), state.pages, meta,
                                donate_argnums=(2,), graphdef=block_def)
  if step == "decode_step":
    return tier.compile_program(steps.decode_step, params, state, ids, ids, **kw)
  if step == "prefill":
    return tier.compile_program(steps.prefill, params, state, ids, S((ROWS, CHUNK), I32),
                                ids, **kw)
  if step in ("forward", "forward_unrolled"):  # 12 decodes, 4 prefill chunks of <= 64 tokens
    plan = StepPlan(seq_ids=ids, num_new=ids, tokens=S((512,), I32), max_query_len=CHUNK)
    return tier.compile_program(steps.forward, params, state, plan, **kw)
  if step == "forward_reserved":  # the serving loop's: slots reserved by the host
    plan = StepPlan(seq_ids=ids, num_new=ids, tokens=S((512,), I32), max_query_len=CHUNK,
                    reserved=ReservedSlots(slot_mapping=S((512,), I32), status=ids,
                                           grow=TailGrowth(tokens=ids, clock=S((), I32))))
    return tier.compile_program(steps.forward, params, state, plan, **kw)
  if step == "decode_multi":
    return tier.compile_program(steps.decode_multi, params, state, ids, ids, ids,
                                num_steps=4, **kw)
  raise ValueError(step)


STEPS = ["layer", "decode_step", "prefill", "forward", "forward_reserved", "decode_multi",
         "forward_unrolled"]
SCANNED = ["decode_step", "prefill", "forward", "forward_reserved", "decode_multi"]


@pytest.mark.parametrize("step", STEPS)
def test_model_step_compiles_in_place(step):
  prog = _step_program(step)
  prefix = "pages" if step == "layer" else "state.pages"
  tier.assert_aliased(prog, (f"{prefix}.k", f"{prefix}.v"),
                      2 * MODEL.num_layers * LAYER_POOL_BYTES)
  assert tier.has_kernel(prog, "decode_attention"), prog.summary()
  assert tier.has_kernel(prog, "prefill_attention") == (
      step in ("prefill", "forward", "forward_reserved", "forward_unrolled"))
  tier.assert_no_spills(prog)


@pytest.mark.parametrize("step", SCANNED + ["forward_unrolled"])
def test_model_step_keeps_the_layer_scan(step):
  """The scanned steps run their layers as one loop of `num_layers` trips in the
  compiled program (not unrolled by XLA); the unrolled model has no such loop."""
  trips = tier.loop_trip_counts(_step_program(step))
  assert trips.count(MODEL.num_layers) == (1 if step in SCANNED else 0), trips


@pytest.mark.parametrize("step", STEPS)
def test_model_step_copies_no_pool(step):
  tier.assert_no_pool_copy(_step_program(step), LAYER_POOL_BYTES)
