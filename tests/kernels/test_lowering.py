"""Lowering tier: every GPU kernel and every impl the library would pick on a GPU,
lowered for `cuda` against an abstract H100 and H200 at real shapes (no GPU).

`jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))` under
`use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice("NVIDIA
H200", num_cores=132, platform="cuda")))` runs the Pallas -> Triton and Pallas ->
Mosaic GPU passes (layout inference, TMA and shared-memory checks) and stops
before LLVM/ptxas: passing is necessary, not sufficient.

For every shape, an impl either lowers or its wrapper refuses the shape at trace
time with a ValueError that names the impls that do build
(`decode_attention.decode_impl_problem` / `lowerable_decode_impls`,
`permute_blocks.permute_impl_problem` / `lowerable_permute_impls`); a shape is
never left to fail at compile time on a user's GPU.

The default grid covers every listed dimension value at least once (bf16; q/kv
heads 32/8, 64/8, 40/8, 8/1, 32/32; head_dim 64, 128, 256; block 16 and 64;
contexts 1k to 128k with a table past 8,192 segments; batch 1 to 256;
permutation with 8 and 32 kv heads and 32 to 4,096 moves). The full cross product
runs with `PAGED_KV_LOWERING_FULL=1` (minutes).
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lowering
from pallas_kernels import decode_attention as pa
from pallas_kernels import permute_blocks as pb
from pallas_kernels import prefill_attention as pf

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

_FULL = os.environ.get("PAGED_KV_LOWERING_FULL", "") not in ("", "0")
_DEVICES = {"h100": lowering.H100, "h200": lowering.H200}
_BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct

# (num_q_heads, num_kv_heads, head_dim, block_size, context, batch, segments)
# segments: table width (None = context / block_size; more = slotted blocks).
_DECODE_GRID = [
    (32, 8, 128, 16, 8192, 64, None),  # the goal shape: batch 64 x 8k
    (32, 8, 128, 16, 131072, 1, 16384),  # batch 1 x 128k, table past 8,192
    (64, 8, 128, 64, 131072, 1, None),
    (40, 8, 128, 16, 1024, 8, None),  # group 5
    (8, 1, 64, 16, 32768, 8, None),
    (32, 32, 256, 64, 8192, 4, None),
    (32, 8, 256, 16, 1024, 256, None),
    (64, 8, 64, 64, 32768, 64, None),
    (32, 8, 64, 16, 1024, 256, 128),
]
if _FULL:
  _DECODE_GRID = [
      (qh, kvh, d, bs, ctx, b, None)
      for (qh, kvh), d, bs, ctx, b in itertools.product(
          [(32, 8), (64, 8), (40, 8), (8, 1), (32, 32)], [64, 128, 256],
          [16, 64], [1024, 8192, 32768, 131072], [1, 8, 64, 256])]

# (num_layers, num_kv_heads, head_dim, block_size, num_moves)
_PERMUTE_GRID = [
    (32, 8, 128, 16, 32),
    (32, 32, 128, 16, 1024),
    (32, 8, 128, 16, 4096),
    (32, 32, 128, 64, 4096),
    (32, 8, 64, 16, 100),
    (80, 8, 256, 16, 256),
]
if _FULL:
  _PERMUTE_GRID = [
      (32, kvh, d, bs, m) for kvh, d, bs, m in itertools.product(
          [8, 32], [64, 128, 256], [16, 64], [32, 256, 1024, 4096])]


def _decode_args(qh, kvh, d, bs, ctx, batch, segments, dtype=_BF16):
  segments = segments or ctx // bs
  num_blocks = max(batch * ctx // bs, 64)
  pages = S((kvh, num_blocks, bs, d), dtype)
  table = [S((batch, segments), jnp.int32)] * 3 + [S((batch,), jnp.int32)]
  return [S((batch, qh, d), dtype), pages, pages] + table


def _id(params):
  return "-".join(str(p) for p in params)


def _shape_kw(qh, kvh, d, bs, dtype=_BF16):
  return dict(num_q_heads=qh, num_kv_heads=kvh, head_dim=d, block_size=bs,
              dtype=dtype)


def _lower_or_refused(fn, args, problem, device):
  """Lowers `fn` if `problem` is None, else checks the wrapper refuses it."""
  if problem is None:
    lowering.lower_for_gpu(fn, *args, device_kind=device[0],
                           num_cores=device[1])
  else:
    with pytest.raises(ValueError, match="cannot build on cuda"):
      lowering.lower_for_gpu(fn, *args, device_kind=device[0],
                             num_cores=device[1])


@pytest.mark.parametrize("device", sorted(_DEVICES))
@pytest.mark.parametrize("shape", _DECODE_GRID, ids=_id)
def test_decode_lowers_or_is_refused(shape, device):
  qh, kvh, d, bs, ctx, batch, segments = shape
  args = _decode_args(*shape)
  lowerable = pa.lowerable_decode_impls(**_shape_kw(qh, kvh, d, bs),
                                        platform="cuda")
  assert "xla" in lowerable and lowerable[0] != "xla", lowerable
  for impl in pa.GPU_DECODE_PREFERENCE:
    problem = pa.decode_impl_problem(impl, **_shape_kw(qh, kvh, d, bs),
                                     platform="cuda")
    assert (problem is None) == (impl in lowerable)
    fn = lambda *a, impl=impl: pa.decode_attention(*a, impl=impl,
                                                  num_splits=None)
    _lower_or_refused(fn, args, problem, _DEVICES[device])


@pytest.mark.parametrize("device", sorted(_DEVICES))
@pytest.mark.parametrize("shape", _DECODE_GRID[:5] if not _FULL else
                         _DECODE_GRID, ids=_id)
def test_prefill_lowers(shape, device):
  qh, kvh, d, bs, ctx, batch, segments = shape
  _, k, v, *table = _decode_args(*shape)
  num_tokens = 256
  args = [S((num_tokens, qh, d), _BF16), k, v, S((batch + 1,), jnp.int32)] + table
  for impl in ("pallas", "xla"):
    fn = lambda *a, impl=impl: pf.prefill_attention(*a, impl=impl)
    lowering.lower_for_gpu(fn, *args, device_kind=_DEVICES[device][0])


@pytest.mark.parametrize("device", sorted(_DEVICES))
@pytest.mark.parametrize("shape", _PERMUTE_GRID, ids=_id)
def test_permute_lowers_or_is_refused(shape, device):
  layers, kvh, d, bs, moves = shape
  num_blocks = max(2 * moves, 256)
  pages = S((layers, kvh, num_blocks, bs, d), _BF16)
  mv = S((moves,), jnp.int32)
  kw = dict(num_layers=layers, num_kv_heads=kvh, head_dim=d, block_size=bs,
            dtype=_BF16, num_moves=moves)
  lowerable = pb.lowerable_permute_impls(**kw, platform="cuda")
  assert "xla" in lowerable, lowerable
  for impl in pb.GPU_PERMUTE_PREFERENCE:
    problem = pb.permute_impl_problem(impl, **kw, platform="cuda")
    assert (problem is None) == (impl in lowerable)
    fn = lambda p, s, t, impl=impl: pb.permute_blocks(p, s, t, impl=impl)
    _lower_or_refused(fn, [pages, mv, mv], problem, _DEVICES[device])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_copy_slots_lowers(impl):
  pages = S((32, 8, 1024, 16, 128), _BF16)
  e = S((64,), jnp.int32)
  fn = lambda p, *a: pb.copy_slots(p, *a, impl=impl)
  lowering.lower_for_gpu(fn, pages, e, e, e, e, e)


def test_refusal_is_a_clear_error_at_trace_time():
  """A shape "pallas" cannot build for (head_dim 80 is no power of two) is
  refused with the reason and the impls that do build; "mosaic" decode names
  why it is refused; "xla" still lowers there."""
  args = _decode_args(32, 8, 80, 16, 1024, 2, None)
  with pytest.raises(ValueError, match=r"power-of-two head_dim.*\('xla',\)"):
    lowering.lower_for_gpu(
        lambda *a: pa.decode_attention(*a, impl="pallas"), *args)
  assert pa.lowerable_decode_impls(**_shape_kw(32, 8, 80, 16),
                                   platform="cuda") == ("xla",)
  lowering.lower_for_gpu(lambda *a: pa.decode_attention(*a, impl="xla"), *args)
  # A K tile too large for Triton: 8 pages x 64 slots x 256.
  big = _decode_args(32, 8, 256, 64, 8192, 1, None)
  with pytest.raises(ValueError, match="exceeds"):
    lowering.lower_for_gpu(
        lambda *a: pa.decode_attention(*a, impl="pallas", pages_per_step=8),
        *big)
  # At the goal shape every impl builds, in the model layer's preference order
  # (Mosaic first, issue 22), or in a given one.
  assert pa.lowerable_decode_impls(**_shape_kw(32, 8, 128, 16),
                                   platform="cuda") == ("mosaic", "pallas", "xla")
  assert pa.lowerable_decode_impls(
      **_shape_kw(32, 8, 128, 16), platform="cuda",
      preference=("pallas", "mosaic", "xla")) == ("pallas", "mosaic", "xla")
  # q in another dtype than the pages: Mosaic is refused with the reason.
  assert pa.lowerable_decode_impls(**_shape_kw(32, 8, 128, 16), platform="cuda",
                                   q_dtype=jnp.float32) == ("pallas", "xla")
  # f32 pages: no bf16 wgmma, "mosaic" refused with the reason.
  assert "bf16/f16" in pa.decode_impl_problem(
      "mosaic", **_shape_kw(32, 8, 128, 16, jnp.float32), platform="cuda")
  # CPU: nothing is refused for shape reasons.
  assert pa.decode_impl_problem("pallas", **_shape_kw(32, 8, 80, 16),
                                platform="cpu") is None


def test_target_platform():
  assert lowering.target_platform() == (
      "cuda" if jax.default_backend() == "gpu" else jax.default_backend())
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh()):
    assert lowering.target_platform() == "cuda"


def test_odd_pool_batch_and_table_sizes_lower():
  """Pools, batches, tables, token counts and move counts that are no powers of
  two (Triton wants power-of-two values, TMA 16-byte rows)."""
  b, qh, kvh, d, bs, nb, segs = 3, 40, 8, 128, 16, 1000, 37
  pages = S((kvh, nb, bs, d), _BF16)
  table = [S((b, segs), jnp.int32)] * 3 + [S((b,), jnp.int32)]
  args = [S((b, qh, d), _BF16), pages, pages] + table
  for impl in pa.GPU_DECODE_PREFERENCE:
    lowering.lower_for_gpu(
        lambda *a, impl=impl: pa.decode_attention(*a, impl=impl, num_splits=None),
        *args)
  pargs = [S((77, qh, d), _BF16), pages, pages, S((b + 1,), jnp.int32)] + table
  for impl in ("pallas", "xla"):
    lowering.lower_for_gpu(
        lambda *a, impl=impl: pf.prefill_attention(*a, impl=impl), *pargs)
  pool, moves = S((3, kvh, nb, bs, d), _BF16), S((37,), jnp.int32)
  for impl in pb.GPU_PERMUTE_PREFERENCE:
    lowering.lower_for_gpu(
        lambda p, s, t, impl=impl: pb.permute_blocks(p, s, t, impl=impl),
        pool, moves, moves)


@pytest.mark.parametrize("impl", ["pallas", "mosaic", "xla"])
def test_stacked_pages_with_a_traced_layer_lower_without_a_layer_slice(impl):
  """The wrappers take the pool's stacked pages and a traced layer: every impl
  lowers, and no value of one layer's size (a slice of the pool, which would
  become a copy) appears; the kernel's operand is the whole pool."""
  num_layers, kvh, nb, bs, d, qh, b, segs = 4, 8, 4096, 16, 128, 32, 2, 256
  pool = S((num_layers, kvh, nb, bs, d), _BF16)
  table = [S((b, segs), jnp.int32)] * 3 + [S((b,), jnp.int32)]
  layer = S((), jnp.int32)
  layer_types = (f"tensor<{kvh}x{nb}x{bs}x{d}xbf16>",
                 f"tensor<1x{kvh}x{nb}x{bs}x{d}xbf16>")
  decode = lowering.lower_for_gpu(
      lambda lyr, *a: pa.decode_attention(*a, impl=impl, layer=lyr),
      layer, S((b, qh, d), _BF16), pool, pool, *table).as_text()
  assert not any(t in decode for t in layer_types)
  if impl != "xla":
    assert "custom_call" in decode
  if impl == "mosaic":
    return
  prefill = lowering.lower_for_gpu(
      lambda lyr, *a: pf.prefill_attention(*a, impl=impl, layer=lyr),
      layer, S((64, qh, d), _BF16), pool, pool, S((b + 1,), jnp.int32),
      *table).as_text()
  assert not any(t in prefill for t in layer_types)


def test_fp8_pages_lower_for_triton():
  """e4m3 pages, bf16 queries: the Triton decode and prefill kernels lower
  (V and K upcast in the kernel; the probabilities stay bf16)."""
  pool = S((2, 8, 1024, 16, 128), jnp.float8_e4m3fn)
  b, segs = 4, 64
  table = [S((b, segs), jnp.int32)] * 3 + [S((b,), jnp.int32)]
  lowering.lower_for_gpu(
      lambda *a: pa.decode_attention(*a, impl="pallas", layer=1),
      S((b, 32, 128), _BF16), pool, pool, *table)
  lowering.lower_for_gpu(
      lambda *a: pf.prefill_attention(*a, impl="pallas", layer=1),
      S((64, 32, 128), _BF16), pool, pool, S((b + 1,), jnp.int32), *table)
