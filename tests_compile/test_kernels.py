"""Compile tier, kernels: every GPU kernel, called with an explicit impl, compiled
for an H200 (the batch-1 split-K programs for an H100 too) at real-model shapes.

For each: XLA compiles it (Triton and Mosaic GPU through ptxas); no copy and
no scratch grows with the pool (`tier.assert_no_pool_copy`); Mosaic GPU kernels
report 0 spill bytes; the in-place block permutation writes into the donated
pages (aliased in -> out); split-K (`num_splits=None`) fills the SMs at batch 1.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_kernels import decode_attention as pa
from pallas_kernels import permute_blocks as pb
from pallas_kernels import prefill_attention as pf
from tests_compile import tier
from tests_compile.tier import Attn, S

# Decode shapes: GQA groups 1, 4, 5, 7, 8 and one kv head; head_dim 64, 128,
# 256 (96 is in test_model.py: no Pallas or Mosaic kernel builds for it);
# blocks 16, 32, 64; bf16, f16, fp8 pages; batch 1 to 256; context 1k to 128k.
DECODE = [
    Attn("llama3-8b", 32, 8, 128, 16, batch=64, context=8192),  # the goal shape
    Attn("llama3-8b", 32, 8, 128, 16, batch=1, context=131072),
    Attn("llama3-70b", 64, 8, 128, 64, batch=256, context=1024),
    Attn("qwen2-7b", 28, 4, 128, 32, batch=8, context=32768, dtype="float16"),
    Attn("qwen2.5-32b", 40, 8, 128, 16, batch=16, context=4096),
    Attn("llama2-7b", 32, 32, 128, 16, batch=16, context=4096),
    Attn("tinyllama", 32, 4, 64, 16, batch=128, context=2048),
    Attn("gemma-2b", 8, 1, 256, 16, batch=32, context=8192),
    Attn("llama3-8b-fp8", 32, 8, 128, 16, batch=64, context=8192, dtype="float8_e4m3fn"),
]


def _mosaic_builds(a: Attn) -> bool:
  return pa.decode_impl_problem(
      "mosaic", num_q_heads=a.num_q_heads, num_kv_heads=a.num_kv_heads,
      head_dim=a.head_dim, block_size=a.block_size, dtype=a.dtype, platform="cuda") is None


def _decode(a: Attn, impl: str, device=tier.H200, **kw):
  return tier.compile_program(pa.decode_attention, *a.decode_args(), device=device, impl=impl,
                              num_splits=None, **kw)


@pytest.mark.parametrize("shape", DECODE, ids=lambda a: a.id)
def test_decode_pallas(shape):
  prog = _decode(shape, "pallas")
  tier.assert_no_pool_copy(prog, shape.layer_pool_bytes)
  launch = prog.launches("decode_attention")
  assert launch and launch[0].grid[:2] == (shape.batch, shape.num_kv_heads), prog.summary()
  assert launch[0].shared_memory <= 227 * 1024
  assert not prog.mosaic_kernels()


_MOSAIC = [a for a in DECODE if _mosaic_builds(a)]


@pytest.mark.parametrize("shape", _MOSAIC, ids=lambda a: a.id)
def test_decode_mosaic_compiles_without_spills(shape):
  prog = _decode(shape, "mosaic")
  tier.assert_no_pool_copy(prog, shape.layer_pool_bytes)
  assert prog.mosaic_kernels(), prog.summary()
  tier.assert_no_spills(prog)


# head_dim 256 (the head dim split over two warpgroups) where its registers are
# tightest: Gemma-2's logit soft cap (tanh), 8-token pages (8 pages, 8 masks a
# stage), f16, MHA. ptxas: 208-218 registers of 255 at these and gemma-2b, no spill
# (one warpgroup before: 255 registers, 548-660 B of spill stores).
_MOSAIC_D256 = [
    (Attn("gemma2-9b", 16, 8, 256, 16, batch=16, context=8192), 50.0),
    (Attn("gemma-7b", 16, 16, 256, 8, batch=8, context=4096, dtype="float16"), None),
]


@pytest.mark.parametrize("shape,soft_cap", _MOSAIC_D256, ids=lambda x: getattr(x, "id", x))
def test_decode_mosaic_d256_variants_compile_without_spills(shape, soft_cap):
  prog = _decode(shape, "mosaic", soft_cap=soft_cap)
  assert prog.mosaic_kernels(), prog.summary()
  tier.assert_no_spills(prog)


def test_mosaic_refuses_what_it_cannot_build():
  """Every decode shape here builds with Mosaic GPU (fp8 pages staged to f16
  in shared memory); fp8 at head_dim 256 is refused at trace time
  (`mosaic_problem`), not left to fail in the compile."""
  assert all(map(_mosaic_builds, DECODE))
  assert not _mosaic_builds(dataclasses.replace(DECODE[7], dtype="float8_e4m3fn"))


# Both ring-stage widths (64 and 128 keys: `pages_per_step` 4 and 8 at block 16)
# at Llama-3.2-1B's head_dim 64, bf16 and fp8, at the gpu_check row's shape
# (64 x 8k); fp8 at head_dim 128 at batch 1 x 128k (split-K). None = the
# kernel's default (`default_pages_per_stage`).
_STAGES = [
    (Attn("llama3.2-1b", 32, 8, 64, 16, batch=64, context=8192), 4),
    (Attn("llama3.2-1b", 32, 8, 64, 16, batch=64, context=8192), 8),
    (Attn("llama3.2-1b-fp8", 32, 8, 64, 16, batch=64, context=8192,
          dtype="float8_e4m3fn"), 4),
    (Attn("llama3.2-1b-fp8", 32, 8, 64, 16, batch=64, context=8192,
          dtype="float8_e5m2"), None),
    (Attn("llama3-8b-fp8", 32, 8, 128, 16, batch=1, context=131072,
          dtype="float8_e4m3fn"), None),
]


@pytest.mark.parametrize("shape,pages_per_step", _STAGES,
                         ids=lambda x: getattr(x, "id", f"pps{x}"))
def test_decode_mosaic_stage_widths_and_fp8_compile_without_spills(shape, pages_per_step):
  prog = _decode(shape, "mosaic", pages_per_step=pages_per_step)
  tier.assert_no_pool_copy(prog, shape.layer_pool_bytes)
  assert prog.mosaic_kernels(), prog.summary()
  tier.assert_no_spills(prog)


@pytest.mark.parametrize("device", [tier.H100, tier.H200], ids=["h100", "h200"])
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_split_k_fills_the_gpu_at_batch_1(impl, device):
  """Batch 1 x 128k, 8 kv heads: `num_splits=None` launches >= 132 programs."""
  shape = DECODE[1]
  prog = _decode(shape, impl, device=device)
  assert tier.decode_programs(prog) >= tier.NUM_SMS, prog.summary()


def test_decode_xla_path_compiles():
  """The portable path, at head_dim 96 (the one impl that builds there)."""
  a = Attn("phi3-mini", 32, 32, 96, 16, batch=8, context=4096)
  tier.compile_program(pa.decode_attention, *a.decode_args(), impl="xla")


# Prefill (extend) ------------------------------------------------------------------

# Groups 4, 7 (padded to 8), 8; head_dim 64, 128, 256; bf16, f16, fp8 pages.
PREFILL = [
    (DECODE[0], 512),
    (DECODE[3], 256),
    (DECODE[6], 1024),
    (DECODE[8], 512),
    (DECODE[7], 512),  # gemma-2b: group 8 x head_dim 256, the widest query tile
]


@pytest.mark.parametrize("shape,num_tokens", PREFILL, ids=lambda p: getattr(p, "id", p))
def test_prefill_pallas(shape, num_tokens):
  """The default query tile (`default_block_q`: up to 64 tokens, >= 64 dot
  rows) is what the grid launches, within the SM's shared memory."""
  rows = 8
  args = [S((num_tokens, shape.num_q_heads, shape.head_dim), shape.q_dtype), shape.pages(),
          shape.pages(), S((rows + 1,), tier.I32)] + shape.tables(rows)
  prog = tier.compile_program(pf.prefill_attention, *args, impl="pallas")
  tier.assert_no_pool_copy(prog, shape.layer_pool_bytes)
  assert tier.has_kernel(prog, "prefill_attention"), prog.summary()
  block_q = pf.default_block_q(num_q_heads=shape.num_q_heads,
                               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
  assert block_q * pa.padded_group(shape.num_q_heads // shape.num_kv_heads) >= 64
  launch = prog.launches("prefill_attention")
  assert launch and launch[0].grid[:2] == (-(-num_tokens // block_q), shape.num_kv_heads), (
      prog.summary())
  assert launch[0].shared_memory <= 227 * 1024


# The Mosaic GPU prefill kernel (`prefill_attention_mosaic`): groups 4 (8 rows x 2,048
# new tokens, the gpu_check prefill shape), 7 (padded to 8, f16, a 1,024-entry table)
# and 8 at head_dim 64; a soft cap (tanh) at head_dim 128.
PREFILL_MOSAIC = [
    (DECODE[0], 16384, None),
    (DECODE[3], 256, None),
    (DECODE[6], 1024, None),
    (DECODE[4], 512, 30.0),
]


@pytest.mark.parametrize("shape,num_tokens,soft_cap", PREFILL_MOSAIC,
                         ids=lambda p: getattr(p, "id", p))
def test_prefill_mosaic_compiles_without_spills(shape, num_tokens, soft_cap):
  """Compiled through ptxas with 0 spill bytes, no copy of the pool (stacked
  pages, a traced layer), one Mosaic GPU kernel under `prefill_attention`."""
  rows = 8
  args = [S((num_tokens, shape.num_q_heads, shape.head_dim), shape.q_dtype),
          shape.pages(num_layers=2), shape.pages(num_layers=2),
          S((rows + 1,), tier.I32)] + shape.tables(rows)
  prog = tier.compile_program(pf.prefill_attention, *args, impl="mosaic",
                              soft_cap=soft_cap, layer=S((), tier.I32))
  tier.assert_no_pool_copy(prog, shape.layer_pool_bytes)
  assert len(prog.mosaic_kernels()) == 1, prog.summary()
  assert tier.has_kernel(prog, "prefill_attention"), prog.summary()
  tier.assert_no_spills(prog)


# Block permutation (compaction) ------------------------------------------------------

# (num_layers, num_kv_heads, head_dim, block_size, dtype, num_moves, num_blocks)
PERMUTE = [
    (32, 8, 128, 16, "bfloat16", 1024, 16384),
    (80, 8, 128, 64, "float8_e4m3fn", 256, 4096),
]


@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic"])
@pytest.mark.parametrize("shape", PERMUTE, ids=lambda p: "-".join(map(str, p)))
def test_permute_blocks_in_place(shape, impl):
  """The pages are written in place (aliased, donated). "pallas" and "mosaic"
  copy block to block (no scratch); XLA's scatter gathers the moved blocks into
  a bounce buffer first: scratch = the bytes moved, never more."""
  layers, kvh, d, bs, dtype, moves, blocks = shape
  pages = S((layers, kvh, blocks, bs, d), jnp.dtype(dtype))
  block_bytes = layers * kvh * bs * d * jnp.dtype(dtype).itemsize  # all layers
  mv = S((moves,), tier.I32)
  prog = tier.compile_program(pb.permute_blocks, pages, mv, mv, impl=impl)
  assert prog.alias_bytes == blocks * block_bytes, prog.summary()
  assert len(prog.aliases()) == 1 and prog.aliases()[0].parameter == 0, prog.aliases()
  moved = moves * block_bytes
  limit = moved + (1 << 20) if impl == "xla" else 1 << 20
  tier.assert_no_pool_copy(prog, blocks * block_bytes // layers, limit=limit,
                           what="the moved blocks" if impl == "xla" else "1 MiB")
  assert bool(prog.mosaic_kernels()) == (impl == "mosaic"), prog.summary()
  tier.assert_no_spills(prog)
