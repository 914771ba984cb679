"""Scanned decoder layers (`LlamaConfig.scan_layers`): one stacked `DecoderBlock` run by
`lax.scan` computes what the unrolled layers compute, bit for bit on CPU (logits,
tokens and every layer's K/V, through the mixed step and the multi-step decode); its
traced program does not grow with depth; the compiled step writes the pool in place
with no copy of it inside the scan; the two layouts convert into each other."""

from __future__ import annotations

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import StepPlan, llama, steps
from paged_kv.model.layers import PagedAttention
from tests_compile import compile_tier

MODEL_CONFIG = llama.LlamaConfig(num_layers=3)
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=64, block_size=8, max_seqs=4,
                             max_segments=16)


@pytest.fixture(scope="module", name="models")
def _models() -> dict[str, llama.TinyLlama]:
  """The same weights in both layouts."""
  scanned = llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(5))
  return {"scanned": scanned, "unrolled": llama.convert_layers(scanned, scan_layers=False)}


def _open(state, ids):
  z = np.zeros((len(ids), 1), np.int32)
  state, status = paged_kv.open_sequence(state, np.asarray(ids, np.int32), z, z, z,
                                         np.zeros((len(ids),), np.int32), config=POOL)
  assert (np.asarray(status) == 0).all()
  return state


def _serve(model: llama.TinyLlama) -> list[np.ndarray]:
  """Prefill, a mixed prefill + decode step, a decode step, then 3 decode steps in one
  `decode_multi`; returns every output and the pages."""
  graphdef, params = nnx.split(model)
  kwargs = dict(graphdef=graphdef, config=POOL)
  rng = np.random.default_rng(0)
  a, b, c = (rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist() for n in (13, 21, 7))
  state = _open(paged_kv.init_pool(POOL), [0, 1, 2])
  outs = []
  plans = [lambda nxt: StepPlan.build([(0, a), (1, b[:12])], num_rows=4, max_query_len=16),
           lambda nxt: StepPlan.build([(0, [int(nxt[0])]), (1, b[12:]), (2, c)], num_rows=4,
                                      max_query_len=16),
           lambda nxt: StepPlan.build([(i, [int(nxt[i])]) for i in range(3)], num_rows=4,
                                      max_query_len=1)]
  nxt = None
  for plan in plans:
    state, (nxt, logits, status) = steps.forward(params, state, plan(nxt), **kwargs)
    np.testing.assert_array_equal(np.asarray(status)[:3], 0)
    outs += [np.asarray(nxt), np.asarray(logits)]
  ids = np.array([0, 1, 2, -1], np.int32)
  state, (tokens, status, _, _) = steps.decode_multi(
      params, state, ids, np.asarray(nxt), np.full((4,), 3, np.int32), num_steps=3, **kwargs)
  np.testing.assert_array_equal(np.asarray(status)[:, :3], 0)
  paged_kv.check_invariants(state)
  return outs + [np.asarray(tokens), np.asarray(state.pages.k), np.asarray(state.pages.v)]


def test_scanned_equals_unrolled(models):
  """Logits, tokens and every layer's K/V agree exactly (CPU; same ops per layer)."""
  assert isinstance(models["scanned"].layers, llama.DecoderBlock)
  assert isinstance(models["unrolled"].layers, nnx.List)
  scanned, unrolled = _serve(models["scanned"]), _serve(models["unrolled"])
  k = scanned[-2]
  assert k.shape[0] == MODEL_CONFIG.num_layers
  assert all(np.abs(k[layer]).max() > 0 for layer in range(k.shape[0]))  # every layer wrote
  assert not np.array_equal(k[0], k[1])  # ... its own K
  exact = jax.default_backend() == "cpu"
  for got, want in zip(scanned, unrolled):
    if exact:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _count_eqns(jaxpr) -> int:
  """Equations of a jaxpr, those of its sub-jaxprs (scan, cond, pjit bodies) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          n += _count_eqns(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          n += _count_eqns(sub)
  return n


def _step_eqns(num_layers: int, scan_layers: bool) -> int:
  config = llama.LlamaConfig(num_layers=num_layers, scan_layers=scan_layers)
  pool = llama.pool_config_for(config, num_blocks=16, block_size=4, max_seqs=2,
                               max_segments=4)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.TinyLlama(config,
                                                                      rngs=nnx.Rngs(0))))
  state = jax.eval_shape(lambda: paged_kv.init_pool(pool))
  plan = StepPlan.build([(0, [1, 2, 3]), (1, [4])], num_rows=2, max_query_len=4)
  jaxpr = jax.make_jaxpr(lambda p, s, q: steps._forward_body(  # pylint: disable=protected-access
      nnx.merge(graphdef, p), s, q, config=pool, impl=None, interpret=None))(params, state, plan)
  return _count_eqns(jaxpr.jaxpr)


def test_traced_step_is_flat_in_depth():
  """The mixed step's program holds one layer body whatever the depth (scanned),
  where the unrolled model's grows with every layer."""
  assert _step_eqns(2, True) == _step_eqns(8, True)
  assert _step_eqns(8, False) > 2 * _step_eqns(2, False)  # the count sees layers


def test_compiled_step_writes_the_pool_in_place():
  """CPU: the scanned mixed step aliases the donated pages and copies no layer of the
  pool inside the scan (the compile tier checks the same for an H200)."""
  config = llama.LlamaConfig(num_layers=4)
  pool = llama.pool_config_for(config, num_blocks=1024, block_size=16, max_seqs=4,
                               max_segments=8)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.TinyLlama(config,
                                                                      rngs=nnx.Rngs(0))))
  state = jax.eval_shape(lambda: paged_kv.init_pool(pool))
  plan = StepPlan.build([(0, list(range(1, 17))), (1, [4]), (2, [5])], num_rows=4,
                        max_query_len=16)
  compiled = steps.forward.lower(params, state, plan, graphdef=graphdef,
                                 config=pool).compile()
  layer_bytes = pool.num_kv_heads * pool.num_blocks * pool.block_size * pool.head_dim * 4
  assert compiled.memory_analysis().alias_size_in_bytes >= 2 * config.num_layers * layer_bytes
  text = compiled.as_text()
  assert "while" in text  # the layers' scan survived compilation
  big = compile_tier.parse_copies(text, min_bytes=layer_bytes // 8)
  assert not big, big


def test_convert_layers_round_trip(models):
  scanned, unrolled = models["scanned"], models["unrolled"]
  assert llama.convert_layers(scanned, scan_layers=True) is scanned
  assert not unrolled.config.scan_layers and scanned.config.scan_layers
  back = llama.convert_layers(unrolled, scan_layers=True)
  flat = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}
  want, got = flat(scanned), flat(back)
  assert want.keys() == got.keys()
  for path, value in want.items():
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))
  assert want[("layers", "attn", "wq", "kernel")].shape[0] == MODEL_CONFIG.num_layers
  for layer in range(MODEL_CONFIG.num_layers):
    block = scanned.block(layer)
    assert block.attn.layer == layer == unrolled.block(layer).attn.layer
    np.testing.assert_array_equal(np.asarray(block.mlp.up.kernel.get_value()),
                                  np.asarray(unrolled.layers[layer].mlp.up.kernel.get_value()))
  with pytest.raises(IndexError):
    scanned.block(MODEL_CONFIG.num_layers)


def test_dense_reference_agrees_across_layouts(models):
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, MODEL_CONFIG.vocab_size, (2, 12)), jnp.int32)
  lengths = jnp.asarray([12, 7], jnp.int32)
  np.testing.assert_array_equal(
      np.asarray(llama.dense_forward(models["scanned"], tokens, lengths)),
      np.asarray(llama.dense_forward(models["unrolled"], tokens, lengths)))


def test_layer_comes_from_the_call_when_the_module_has_none():
  attn = PagedAttention(16, 2, 1, 8, layer=None, rngs=nnx.Rngs(0))
  config = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=1,
                               head_dim=8, max_seqs=2, max_segments=2)
  state = _open_one(config)
  plan = StepPlan.build([(0, [1, 2])], num_rows=2, max_query_len=2)
  state, (slot_idx, _) = paged_kv.reserve_tokens(state, plan.seq_ids, plan.num_new,
                                                 config=config, max_new_tokens=2)
  meta = paged_kv.model.StepMetadata.from_reservation(plan, state.table, slot_idx,
                                                      np.zeros((2,), np.int32))
  x = jnp.ones((plan.num_tokens, 16), jnp.float32)
  with pytest.raises(paged_kv.InvalidArgument, match="needs layer="):
    attn(x, state.pages, meta)
  pages, _ = attn(x, state.pages, meta, layer=jnp.int32(1))
  k = np.asarray(pages.k)
  assert np.abs(k[1]).max() > 0 and not k[0].any()  # layer 1 written, layer 0 not
  with pytest.raises(ValueError, match="int >= 0 or None"):
    PagedAttention(16, 2, 1, 8, layer=-1, rngs=nnx.Rngs(0))


def _open_one(config):
  z = np.zeros((1, 1), np.int32)
  state, status = paged_kv.open_sequence(paged_kv.init_pool(config), np.array([0], np.int32),
                                         z, z, z, np.zeros((1,), np.int32), config=config)
  assert (np.asarray(status) == 0).all()
  return state


def test_config_validates_scan_layers():
  with pytest.raises(ValueError, match="scan_layers must be a bool"):
    llama.LlamaConfig(scan_layers=1)
