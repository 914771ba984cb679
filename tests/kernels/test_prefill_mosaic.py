"""Prefill attention, `impl="mosaic"`: the Mosaic GPU kernel run in JAX's GPU
interpreter on CPU with race detection, against the float64 reference.

Rows mix a prefill from nothing, extends after a cached prefix, one-token
(decode) rows, a row with no new token and long rows whose chunks span several
tiles and more stages than the ring holds; every unused slot is NaN (a stray
read poisons the output) and padding tokens' queries are NaN (their output must
be 0). 10-20 s per case on CPU: the variants that repeat the first case with
another dtype or group are in the long tier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering
from pallas_kernels import prefill_attention as pf
from tests.kernels.test_decode_attention import _TOL, ref64, stack_layers
from tests.kernels.test_prefill_attention import _case, _check

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

# (seq_len, q_len): the short rows of the Pallas tests, then a 40-token chunk on
# 110 cached tokens (2 tiles of 32 at group 4, the second half-empty: its second
# consumer computes padding; 10 pages of 16 = 3 stages) and a 150-token prefill
# from nothing (5 tiles; up to 10 stages: the ring wraps).
_ROWS = ((13, 13), (16, 3), (24, 1), (9, 0), (11, 5), (8, 8), (150, 40), (150, 150))
_CASE = dict(head_dim=64, block_size=16, num_blocks=96, max_segments=32, rows=_ROWS)
_TOL[jnp.float16] = _TOL[jnp.bfloat16]


def _race_params():
  return lowering.gpu_interpret_params(detect_races=True, on_race="warn")


def _run(q, k, v, cu, table, **kw):
  mi = lowering.interpreter_state()
  mi.reset_gpu_interpret_mode_state()
  out = jax.block_until_ready(pf.prefill_attention(
      q, k, v, cu, *table, impl="mosaic", interpret=_race_params(), **kw))
  assert not mi.get_races().races_found
  return out


@pytest.mark.parametrize("dtype,group,soft_cap", [
    (jnp.bfloat16, 4, None),
    pytest.param(jnp.float16, 1, 5.0, marks=pytest.mark.long),
    pytest.param(jnp.bfloat16, 5, None, marks=pytest.mark.long),  # padded to 8
])
def test_mosaic_prefill_matches_reference_without_races(dtype, group, soft_cap):
  q, k, v, cu, table = _case(group + 17, dtype=dtype, group=group, **_CASE)
  out = _run(q, k, v, cu, table, soft_cap=soft_cap)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table, soft_cap=soft_cap)
  _check(out, want, q, cu, dtype)


@pytest.mark.long
def test_mosaic_prefill_reads_the_given_layer_of_the_stacked_pool():
  """A traced `layer` != 0 of stacked pages (every other layer poisoned),
  group 8 (4 tokens a tile), custom sm_scale."""
  q, k, v, cu, table = _case(23, dtype=jnp.bfloat16, group=8,
                             **dict(_CASE, rows=_ROWS[:6]))
  rng = np.random.default_rng(4)
  k3 = stack_layers(rng, k, num_layers=3, layer=2)
  v3 = stack_layers(rng, v, num_layers=3, layer=2)
  out = _run(q, k3, v3, cu, table, layer=jnp.int32(2), sm_scale=0.2)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table, sm_scale=0.2)
  _check(out, want, q, cu, jnp.bfloat16)


def test_mosaic_prefill_tile_does_not_stream_future_pages():
  """A 128-token prefill from nothing in 8 whole blocks of 16; the last 4
  blocks hold NaN. At group 4 a tile holds 32 tokens: the first 2 tiles (the
  first 64 tokens) see only the first 4 blocks, one stage, and must not load
  the later ones (0 * NaN through P V), so their outputs are finite and right."""
  rng = np.random.default_rng(7)
  block_size, num_blocks, seq_len = 16, 12, 128
  blocks = rng.permutation(num_blocks)[:8].astype(np.int32)
  table = (jnp.asarray(blocks[None]), jnp.zeros((1, 8), jnp.int32),
           jnp.full((1, 8), block_size, jnp.int32), jnp.array([8], jnp.int32))
  cu = jnp.array([0, seq_len], jnp.int32)
  k = rng.standard_normal((2, num_blocks, block_size, 64)).astype(np.float32)
  v = rng.standard_normal((2, num_blocks, block_size, 64)).astype(np.float32)
  k[:, blocks[4:]] = np.nan
  v[:, blocks[4:]] = np.nan
  q = jnp.asarray(rng.standard_normal((seq_len, 8, 64)), jnp.bfloat16)
  k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
  got = np.asarray(_run(q, k, v, cu, table).astype(jnp.float32))
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table)
  half = seq_len // 2
  assert np.all(np.isfinite(got[:half])), "a tile streamed a future token's page"
  np.testing.assert_allclose(got[:half], want[:half], **_TOL[jnp.bfloat16])


def test_mosaic_prefill_refuses_what_it_cannot_build():
  """f32 pages (no bf16 wgmma), head_dim 16 and 256, a pages_per_step other
  than 64 keys: refused with the reason on every platform; on CPU it needs the
  interpreter. No kernel is traced for these."""
  q, k, v, cu, table = _case(1, dtype=jnp.float32, group=2)
  with pytest.raises(ValueError, match="bf16/f16"):
    pf.prefill_attention(q, k, v, cu, *table, impl="mosaic", interpret=True)
  q, k, v, cu, table = _case(1, dtype=jnp.bfloat16, group=2)
  with pytest.raises(ValueError, match="head_dim in"):
    pf.prefill_attention(q, k, v, cu, *table, impl="mosaic", interpret=True)
  q, k, v, cu, table = _case(1, dtype=jnp.bfloat16, group=2, **dict(_CASE, rows=_ROWS[:6]))
  with pytest.raises(ValueError, match="pages_per_step"):
    pf.prefill_attention(q, k, v, cu, *table, impl="mosaic", interpret=True,
                         pages_per_step=2)
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="interpret=True"):
      pf.prefill_attention(q, k, v, cu, *table, impl="mosaic")
  from pallas_kernels import prefill_attention_mosaic as pm
  assert "head_dim" in pm.mosaic_prefill_problem(
      num_q_heads=8, num_kv_heads=1, head_dim=256, block_size=16, dtype=jnp.bfloat16)
  assert "shared memory" in pm.mosaic_prefill_problem(
      num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16, dtype=jnp.bfloat16,
      num_seg_slots=1 << 16)


def test_tile_plan_places_every_token_once():
  """The static tiling (no kernel): each real token is in exactly one tile
  slot, in its own row's tiles, in order; padding tokens map past the tiles;
  each tile's entry count is what its last token needs."""
  from pallas_kernels import prefill_attention_mosaic as pm

  _, _, _, cu, (seg_block, seg_start, seg_length, num_segments) = _case(
      3, dtype=jnp.bfloat16, group=4, **_CASE)
  num_tokens = int(cu[-1]) + 3
  meta, tok, tok_ok, out_index = (np.asarray(a) for a in pm.tile_plan(
      cu, seg_length, num_segments, num_tokens=num_tokens, group=4))
  tt = pm.tile_tokens(4)
  assert tt == 32 and tok.shape == (-(-num_tokens // tt) + len(_ROWS), tt)
  real = int(cu[-1])
  np.testing.assert_array_equal(tok.reshape(-1)[out_index[:real]], np.arange(real))
  assert np.all(tok_ok.reshape(-1)[out_index[:real]])
  assert tok_ok.sum() == real and np.all(out_index[real:] == tok.size)
  cu_np = np.asarray(cu)
  for n in np.flatnonzero(meta[:, 3]):
    b, count, pos0, ntok = meta[n, :4]
    assert np.all((tok[n, :ntok] >= cu_np[b]) & (tok[n, :ntok] < cu_np[b + 1]))
    lens = np.asarray(seg_length)[b, :int(num_segments[b])]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    assert count == np.sum(starts <= pos0 + ntok - 1)


@pytest.mark.long
def test_mosaic_prefill_one_consumer_matches_reference():
  """`num_consumers=1` (one 64-row consumer warpgroup; tiles of 16 tokens at
  group 4), called directly."""
  from pallas_kernels import prefill_attention_mosaic as pm

  q, k, v, cu, table = _case(31, dtype=jnp.bfloat16, group=4, **_CASE)
  mi = lowering.interpreter_state()
  mi.reset_gpu_interpret_mode_state()
  out = pm.mosaic_prefill_attention(
      q, k[None], v[None], jnp.int32(0), cu, *table, sm_scale=0.125, soft_cap=None,
      interpret=_race_params(), num_consumers=1)
  assert not mi.get_races().races_found
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table)
  _check(out, want, q, cu, jnp.bfloat16)
