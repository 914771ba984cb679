"""Decode attention, `impl="mosaic"`: the Mosaic GPU kernel run in JAX's GPU
interpreter on CPU with race detection, against the float64 reference.

Inputs come from the shared builders of `test_decode_attention.py`: fresh random
tables mixing full, partial, slotted and shared segments, lengths 1, exact
multiples of block_size (16), partial and 0 (an empty row), and NaN in every
unused slot so a stray read poisons the output. Rows are long enough (up to 300
tokens in up to 40 segments) that a row walks more stages than the ring holds,
so ring-slot reuse is exercised, and split-K leaves some splits empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering
from pallas_kernels import decode_attention as pa
from tests.kernels.test_decode_attention import _TOL, _case, ref64

# Mosaic GPU interpret mode with race checks.
pytestmark = pytest.mark.slow

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

# Lengths: 1, multiples of block_size, partial, an empty row, long rows.
_SEQ_LENS = (13, 1, 300, 0, 64, 5, 170, 33)
_CASE = dict(block_size=16, head_dim=64, num_blocks=160, max_segments=40)
_TOL[jnp.float16] = _TOL[jnp.bfloat16]


def _interpreter():
  return lowering.interpreter_state()


def _race_params():
  # `on_race` exists from JAX 0.12 on; 0.11.2 records races without it.
  return lowering.gpu_interpret_params(detect_races=True, on_race="warn")


_CASES = [
    # (dtype, group, soft_cap, num_splits, head_dim). head_dim 64 runs the
    # warp-specialized kernel (producer warpgroup), 256 the one whose two
    # warpgroups split the head dim. 7-15 s each on CPU: the cases that repeat what
    # the first three check with another dtype or group are in the long tier
    # (`make test-long`).
    (jnp.bfloat16, 4, None, 1, 64),
    (jnp.bfloat16, 1, 5.0, 3, 64),
    (jnp.bfloat16, 2, None, 2, 256),
    pytest.param(jnp.float16, 5, None, 2, 64, marks=pytest.mark.long),
    pytest.param(jnp.bfloat16, 8, 3.0, 1, 64, marks=pytest.mark.long),
    pytest.param(jnp.float16, 1, 5.0, 1, 256, marks=pytest.mark.long),
]


@pytest.mark.parametrize("dtype,group,soft_cap,num_splits,head_dim", _CASES)
def test_mosaic_matches_reference_without_races(dtype, group, soft_cap,
                                                num_splits, head_dim):
  from pallas_kernels import decode_attention_mosaic as pm

  assert pm.kernel_config(head_dim, dtype)[0] == (head_dim <= 128)
  q, k, v, table = _case(group * 11 + num_splits, dtype=dtype, group=group,
                         seq_lens=_SEQ_LENS, **dict(_CASE, head_dim=head_dim))
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  out = pa.decode_attention(q, k, v, *table, soft_cap=soft_cap, impl="mosaic",
                           interpret=_race_params(), num_splits=num_splits)
  got = np.asarray(out.astype(jnp.float32))
  assert not mi.get_races().races_found
  want = ref64(pa.ref_decode_attention, q, k, v, *table, soft_cap=soft_cap)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.all(np.isfinite(got)), "a poisoned slot reached the output"
  np.testing.assert_allclose(got, want, **_TOL[dtype])
  np.testing.assert_array_equal(got[3], 0.0)  # the empty row


def test_mosaic_interpret_true_means_race_checked():
  """`interpret=True` maps to `InterpretGPUParams(detect_races=True)`; custom
  sm_scale; a batch whose rows are all empty except a length-1 row."""
  q, k, v, table = _case(5, dtype=jnp.bfloat16, group=2, seq_lens=(0, 1, 0),
                         check_coverage=False, **_CASE)
  _interpreter().reset_gpu_interpret_mode_state()
  out = pa.decode_attention(q, k, v, *table, sm_scale=0.3, impl="mosaic",
                           interpret=True)
  want = ref64(pa.ref_decode_attention, q, k, v, *table, sm_scale=0.3)
  got = np.asarray(out.astype(jnp.float32))
  np.testing.assert_allclose(got, want, **_TOL[jnp.bfloat16])
  np.testing.assert_array_equal(got[[0, 2]], 0.0)
  assert not _interpreter().get_races().races_found


@pytest.mark.parametrize("head_dim", [64, 256])
def test_mosaic_race_detector_sees_missing_proxy_fence(monkeypatch, head_dim):
  """Negative control: without the `commit_smem` fences, the TMA refill of a
  ring slot races with the kernel's generic-proxy accesses of that slot, and
  the detector must say so; the clean runs above are not a detector that sees
  nothing. Both kernels (warp-specialized at 64, head dim split over two
  warpgroups at 256)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  monkeypatch.setattr(plgpu, "commit_smem", lambda: None)
  q, k, v, table = _case(6, dtype=jnp.bfloat16, group=1, seq_lens=(300, 17),
                         check_coverage=False,
                         **dict(_CASE, head_dim=head_dim))
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  # sm_scale used nowhere else: forces a fresh trace with the patched fence.
  jax.block_until_ready(pa.decode_attention(
      q, k, v, *table, sm_scale=0.123, impl="mosaic", interpret=_race_params()))
  assert mi.get_races().races_found
  mi.reset_gpu_interpret_mode_state()


def test_mosaic_refuses_what_cannot_lower():
  """f32 pages (no bf16 wgmma), head_dim 16, block 128: refused with the reason,
  on every platform (interpret mode runs only what lowers)."""
  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False, block_size=16, head_dim=64)
  with pytest.raises(ValueError, match="bf16/f16"):
    pa.decode_attention(q, k, v, *table, impl="mosaic", interpret=True)
  q, k, v, table = _case(1, dtype=jnp.bfloat16, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  with pytest.raises(ValueError, match="multiple of 64"):
    pa.decode_attention(q, k, v, *table, impl="mosaic", interpret=True)
  assert "block_size" in pa.decode_impl_problem(
      "mosaic", num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=128,
      dtype=jnp.bfloat16, platform="cuda")


def test_mosaic_needs_gpu_or_interpreter():
  if jax.default_backend() == "gpu":
    pytest.skip("runs compiled on a GPU")
  q, k, v, table = _case(1, dtype=jnp.bfloat16, group=2, seq_lens=(3, 4),
                         check_coverage=False, **_CASE)
  with pytest.raises(ValueError, match="interpret=True"):
    pa.decode_attention(q, k, v, *table, impl="mosaic")


def test_prefill_mosaic_refuses_f32_with_its_own_reason():
  """Prefill has its own Mosaic kernel (tests/kernels/test_prefill_mosaic.py); at a
  shape it cannot build it raises, never falling through to another kernel."""
  from pallas_kernels import prefill_attention as pf

  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  cu_q_lens = jnp.array([0, 1, 2], jnp.int32)
  with pytest.raises(ValueError, match="prefill impl='mosaic' takes bf16/f16"):
    pf.prefill_attention(q, k, v, cu_q_lens, *table, impl="mosaic",
                         interpret=True)


def test_mosaic_stacked_pages_traced_layer_and_default_splits():
  """The pool's stacked pages with a traced layer != 0 (every other layer
  poisoned), `num_splits=None`: short splits (entries per split not a multiple
  of the table's 128 lanes), race-free, equal to the reference."""
  from tests.kernels.test_decode_attention import stack_layers

  q, k, v, table = _case(29, dtype=jnp.bfloat16, group=4, seq_lens=_SEQ_LENS,
                         **_CASE)
  rng = np.random.default_rng(9)
  k5 = stack_layers(rng, k, num_layers=3, layer=1)
  v5 = stack_layers(rng, v, num_layers=3, layer=1)
  splits = pa.default_num_splits(batch=len(_SEQ_LENS), num_kv_heads=k.shape[0],
                                 num_seg_slots=table[0].shape[1], pages_per_step=4,
                                 block_size=16)
  assert splits > 1 and table[0].shape[1] % splits, splits
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  fn = jax.jit(lambda layer, *a: pa.decode_attention(
      *a, layer=layer, impl="mosaic", interpret=_race_params()))
  got = np.asarray(fn(jnp.int32(1), q, k5, v5, *table).astype(jnp.float32))
  assert not mi.get_races().races_found
  want = ref64(pa.ref_decode_attention, q, k, v, *table)
  assert np.all(np.isfinite(got)), "a poisoned slot or the wrong layer was read"
  np.testing.assert_allclose(got, want, **_TOL[jnp.bfloat16])
  np.testing.assert_array_equal(got[3], 0.0)


# Stage widths and fp8 pages ------------------------------------------------------

# A 600-token row walks more stages than the 4-stage ring holds: 128-key stages
# in one split, 64-key ones in each of two.
_LONG_SEQ_LENS = (600, 1, 0, 150, 37)
_LONG_CASE = dict(block_size=16, num_blocks=160, max_segments=64)

_STAGE_CASES = [
    # (page dtype, head_dim, pages_per_step, num_splits). fp8 at head_dim 128
    # (64-key stages, each upcast in two 64-column halves) in `make test`;
    # 20-35 s each on CPU, the others are in the long tier: 64-key bf16 stages
    # at head_dim 64 (its default, 128 keys, runs in the cases above), fp8
    # with 128-key stages (head_dim 64's default), e5m2.
    (jnp.float8_e4m3fn, 128, None, 2),
    pytest.param(jnp.bfloat16, 64, 4, 2, marks=pytest.mark.long),
    pytest.param(jnp.float8_e4m3fn, 64, None, 1, marks=pytest.mark.long),
    pytest.param(jnp.float8_e5m2, 64, 4, 2, marks=pytest.mark.long),
]


@pytest.mark.parametrize("page_dtype,head_dim,pages_per_step,num_splits", _STAGE_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_mosaic_stage_widths_and_fp8_pages_match_reference(page_dtype, head_dim,
                                                           pages_per_step, num_splits):
  """Both stage widths and fp8 pages (bf16 queries, pages upcast to f16 in
  shared memory), race-free, against the float64 reference over the fp8
  values; NaN in every unused slot (fp8 NaN too)."""
  fp8 = jnp.dtype(page_dtype).itemsize == 1
  q, k, v, table = _case(41 + head_dim, dtype=jnp.float32 if fp8 else page_dtype,
                         group=4, seq_lens=_LONG_SEQ_LENS,
                         **dict(_LONG_CASE, head_dim=head_dim))
  k, v, q = k.astype(page_dtype), v.astype(page_dtype), q.astype(jnp.bfloat16)
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  out = pa.decode_attention(q, k, v, *table, impl="mosaic", num_splits=num_splits,
                           pages_per_step=pages_per_step, interpret=_race_params())
  got = np.asarray(out.astype(jnp.float32))
  assert not mi.get_races().races_found
  want = ref64(pa.ref_decode_attention, q, k.astype(jnp.float32),
               v.astype(jnp.float32), *table)
  assert out.dtype == q.dtype
  assert np.all(np.isfinite(got)), "a poisoned slot reached the output"
  np.testing.assert_allclose(got, want, **_TOL[jnp.bfloat16])
  np.testing.assert_array_equal(got[2], 0.0)  # the empty row


def test_mosaic_stage_width_rule_and_refusals():
  """128-key stages where a 64-key stage carries less than a head_dim 128
  bf16 stage's bytes and S plus the accumulator fit the registers; refused
  with the reason otherwise. fp8: head_dim <= 128, bf16/f16 queries; the
  default path keeps Triton for fp8 (untimed)."""
  from pallas_kernels import decode_attention_mosaic as pm

  stage = lambda d, bs, dt=jnp.bfloat16: pm.default_pages_per_stage(
      head_dim=d, block_size=bs, dtype=dt) * bs
  assert [stage(64, bs) for bs in (16, 32, 64)] == [128] * 3
  assert stage(64, 8) == 64  # 16 pages would exceed MAX_PAGES_PER_STAGE
  assert [stage(d, 16) for d in (128, 192, 256)] == [64] * 3
  assert stage(64, 16, jnp.float8_e4m3fn) == 128
  assert stage(128, 16, jnp.float8_e4m3fn) == 64  # 128 + 128 f32 columns
  problem = lambda d, pps, dt=jnp.bfloat16, q_dtype=None: pa.decode_impl_problem(
      "mosaic", num_q_heads=32, num_kv_heads=8, head_dim=d, block_size=16,
      dtype=dt, pages_per_step=pps, platform="cuda", q_dtype=q_dtype)
  assert problem(64, 4) is None and problem(64, 8) is None
  assert "f32 columns" in problem(128, 8)
  assert "pages_per_step must be None or one of [4, 8]" in problem(64, 2)
  assert problem(128, None, jnp.float8_e4m3fn, jnp.bfloat16) is None
  assert "head_dim <= 128" in problem(256, None, jnp.float8_e4m3fn)
  assert "bf16/f16 q" in problem(128, None, jnp.float8_e4m3fn, jnp.float32)
  caveat = lambda dt: pa.default_path_problem(
      "mosaic", num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
      dtype=dt, platform="cuda")
  assert caveat(jnp.bfloat16) is None
  assert "untimed" in caveat(jnp.float8_e4m3fn)
