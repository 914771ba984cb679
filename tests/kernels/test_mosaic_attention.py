"""Decode attention, `impl="mosaic"`: the Mosaic GPU kernel run in JAX's GPU
interpreter on CPU with race detection, against the float64 reference.

Inputs come from the shared builders of `test_kernels_paged_attention.py`: fresh
random tables mixing full, partial, slotted and shared segments, lengths 1, exact
multiples of block_size (8), partial and 0 (an empty row), and NaN in every unused
slot so a stray read poisons the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from tests.kernels.test_paged_attention import _SEQ_LENS, _TOL, _case, ref64

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _interpreter():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi
  return mi


def _race_params():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams(detect_races=True, on_race="warn")


_CASES = [
    # (dtype, group, soft_cap, pages_per_step); pages_per_step 1 makes rows walk
    # more stages than the ring holds, so slot reuse is exercised.
    (jnp.float32, 1, None, 2),
    (jnp.float32, 4, 5.0, 1),
    (jnp.bfloat16, 4, None, 3),
    (jnp.bfloat16, 1, 3.0, 2),
]


@pytest.mark.parametrize("dtype,group,soft_cap,pages_per_step", _CASES)
def test_mosaic_matches_reference_without_races(dtype, group, soft_cap,
                                                pages_per_step):
  q, k, v, table = _case(group * 11 + pages_per_step, dtype=dtype, group=group,
                         seq_lens=_SEQ_LENS)
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  out = pa.paged_attention(q, k, v, *table, soft_cap=soft_cap, impl="mosaic",
                           interpret=_race_params(),
                           pages_per_step=pages_per_step)
  got = np.asarray(out.astype(jnp.float32))
  assert not mi.get_races().races_found
  want = ref64(pa.ref_paged_attention, q, k, v, *table, soft_cap=soft_cap)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.all(np.isfinite(got)), "a poisoned slot reached the output"
  np.testing.assert_allclose(got, want, **_TOL[dtype])
  np.testing.assert_array_equal(got[3], 0.0)  # the empty row


def test_mosaic_interpret_true_means_race_checked():
  """`interpret=True` maps to `InterpretGPUParams(detect_races=True)` (raising on a
  race); custom sm_scale; a batch whose rows are all empty except a length-1 row."""
  q, k, v, table = _case(5, dtype=jnp.float32, group=2, seq_lens=(0, 1, 0),
                         check_coverage=False)
  _interpreter().reset_gpu_interpret_mode_state()
  out = pa.paged_attention(q, k, v, *table, sm_scale=0.3, impl="mosaic",
                           interpret=True)
  want = ref64(pa.ref_paged_attention, q, k, v, *table, sm_scale=0.3)
  got = np.asarray(out)
  np.testing.assert_allclose(got, want, **_TOL[jnp.float32])
  np.testing.assert_array_equal(got[[0, 2]], 0.0)
  assert not _interpreter().get_races().races_found


def test_mosaic_race_detector_sees_missing_proxy_fence(monkeypatch):
  """Negative control: without the `commit_smem` fence before a ring slot is
  refilled, the TMA write races with the kernel's earlier reads of that slot, and
  the detector must say so; the clean runs above are not a detector that sees
  nothing."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  monkeypatch.setattr(plgpu, "commit_smem", lambda: None)
  q, k, v, table = _case(6, dtype=jnp.float32, group=1, seq_lens=(9, 17),
                         check_coverage=False)
  mi = _interpreter()
  mi.reset_gpu_interpret_mode_state()
  # sm_scale used nowhere else: forces a fresh trace with the patched fence.
  jax.block_until_ready(pa.paged_attention(
      q, k, v, *table, sm_scale=0.123, impl="mosaic", interpret=_race_params(),
      pages_per_step=1))
  assert mi.get_races().races_found
  mi.reset_gpu_interpret_mode_state()


def test_mosaic_needs_gpu_or_interpreter():
  if jax.default_backend() == "gpu":
    pytest.skip("runs compiled on a GPU")
  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  with pytest.raises(ValueError, match="interpret=True"):
    pa.paged_attention(q, k, v, *table, impl="mosaic")


def test_prefill_still_rejects_mosaic():
  """Prefill validates through the shared `static_validate_inputs`; accepting
  "mosaic" for decode must not let prefill fall through to another kernel."""
  from pallas_kernels import prefill_attention as pf

  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  cu_q_lens = jnp.array([0, 1, 2], jnp.int32)
  with pytest.raises(ValueError, match="not implemented"):
    pf.prefill_attention(q, k, v, cu_q_lens, *table, impl="mosaic",
                         interpret=True)
