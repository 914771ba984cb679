"""In-place block permutation and slot copies: xla, generic Pallas (interpret) and
Mosaic GPU (GPU interpreter with race detection) against the references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering
from pallas_kernels import permute_blocks as pb

_SHAPE = (3, 2, 16, 4, 8)  # layers, kv heads, blocks, block_size, head_dim


def _pages(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return rng, jnp.asarray(rng.standard_normal(_SHAPE), dtype)


def _moves(rng, num_moves, num_pad):
  """Disjoint random sources/destinations plus padding (-1 on either side)."""
  perm = rng.permutation(_SHAPE[2])
  src = list(perm[:num_moves])
  dst = list(perm[num_moves:2 * num_moves])
  for p in range(num_pad):
    if p % 2:
      src.append(-1), dst.append(int(perm[-1 - p]))  # would clobber if read
    else:
      src.append(int(perm[-1 - p])), dst.append(-1)
  order = rng.permutation(len(src))
  return (jnp.asarray(np.array(src)[order], jnp.int32),
          jnp.asarray(np.array(dst)[order], jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_permute_matches_reference(impl, dtype):
  rng, pages = _pages(1, dtype)
  src, dst = _moves(rng, 5, 3)
  pb.dynamic_validate_moves(src, dst, num_blocks=_SHAPE[2])
  want = np.asarray(pb.ref_permute_blocks(pages, src, dst).astype(jnp.float32))
  out = pb.permute_blocks(jnp.array(pages), src, dst, impl=impl, interpret=True)
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


def _mosaic_case(seed, *, num_moves, num_pad, shape=(2, 4, 96, 4, 8)):
  """A pool with more moves than one program's chunk (32) and its ring (<= 8
  slots), so chunking and ring-slot reuse are exercised; 4 kv heads."""
  rng = np.random.default_rng(seed)
  pages = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  perm = rng.permutation(shape[2])
  src = list(perm[:num_moves])
  dst = list(perm[num_moves:2 * num_moves])
  for p in range(num_pad):  # padding on either side; would clobber if read
    src.append(-1 if p % 2 else int(perm[-1 - p]))
    dst.append(int(perm[-1 - p]) if p % 2 else -1)
  order = rng.permutation(len(src))
  src = jnp.asarray(np.array(src)[order], jnp.int32)
  dst = jnp.asarray(np.array(dst)[order], jnp.int32)
  pb.dynamic_validate_moves(src, dst, num_blocks=shape[2])
  return pages, src, dst


@pytest.mark.parametrize("num_moves,num_pad", [(4, 2), (40, 5)])
def test_permute_mosaic_gpu_interpret_no_races(num_moves, num_pad):
  mi = lowering.interpreter_state()
  pages, src, dst = _mosaic_case(2, num_moves=num_moves, num_pad=num_pad)
  want = np.asarray(pb.ref_permute_blocks(pages, src, dst).astype(jnp.float32))
  mi.reset_gpu_interpret_mode_state()
  params = lowering.gpu_interpret_params(detect_races=True, on_race="warn")
  out = pb.permute_blocks(jnp.array(pages), src, dst, impl="mosaic",
                          interpret=params)
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
  assert not mi.get_races().races_found


def test_mosaic_race_detector_sees_missing_wait(monkeypatch):
  """Negative control: dropping the ring-slot wait must be reported as a race,
  so the clean result above is not a detector that sees nothing."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  real_wait = plgpu.wait_smem_to_gmem
  monkeypatch.setattr(
      plgpu, "wait_smem_to_gmem",
      lambda n, wait_read_only=False: real_wait(n, wait_read_only) if n == 0
      else None)
  mi = lowering.interpreter_state()
  pages, src, dst = _mosaic_case(3, num_moves=20, num_pad=0,
                                 shape=(1, 1, 48, 4, 8))
  mi.reset_gpu_interpret_mode_state()
  params = lowering.gpu_interpret_params(detect_races=True, on_race="warn")
  jax.block_until_ready(pb.permute_blocks(jnp.array(pages), src, dst,
                                          impl="mosaic", interpret=params))
  assert mi.get_races().races_found
  mi.reset_gpu_interpret_mode_state()


def test_mosaic_permute_config_fits_shared_memory():
  for heads, bs, d, dtype in [(32, 16, 128, jnp.bfloat16),
                              (16, 16, 128, jnp.float32),
                              (8, 64, 256, jnp.float32), (1, 16, 64, jnp.bfloat16)]:
    per, slots = pb.mosaic_permute_config(num_kv_heads=heads, block_size=bs,
                                          head_dim=d, dtype=dtype)
    assert heads % per == 0 and slots >= 2
    assert slots * per * bs * d * jnp.dtype(dtype).itemsize <= 200 << 10


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_permute_aliases_pages(impl):
  _, pages = _pages(4)
  src = jnp.array([3, -1], jnp.int32)
  dst = jnp.array([0, 1], jnp.int32)
  compiled = pb.permute_blocks.lower(pages, src, dst, impl=impl,
                                     interpret=True).compile()
  assert compiled.memory_analysis().alias_size_in_bytes >= pages.nbytes


def test_permute_validation():
  with pytest.raises(ValueError, match="disjoint"):
    pb.dynamic_validate_moves(np.array([1, 2]), np.array([2, 3]), num_blocks=8)
  with pytest.raises(ValueError, match="distinct"):
    pb.dynamic_validate_moves(np.array([1, 2]), np.array([3, 3]), num_blocks=8)
  _, pages = _pages(5)
  with pytest.raises(ValueError, match="impl"):
    pb.permute_blocks(pages, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                      impl="cuda")
  with pytest.raises(ValueError, match="int32"):
    pb.permute_blocks(pages, jnp.zeros(1, jnp.int16), jnp.ones(1, jnp.int32))


def _slot_copies():
  # COW of a 3-token tail, two short segments packed into one block (slotted),
  # a length-1 copy, a full-block copy and two padding entries.
  src_block = [5, 6, 7, 9, 10, 0, 123]
  src_start = [1, 0, 2, 3, 0, 0, -7]
  dst_block = [1, 2, 2, 3, 4, 0, 99]
  dst_start = [0, 0, 2, 1, 0, 0, 5]
  length = [3, 2, 2, 1, 4, 0, 0]
  return [jnp.asarray(a, jnp.int32) for a in (src_block, src_start, dst_block,
                                              dst_start, length)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copy_slots_matches_reference(impl, dtype):
  _, pages = _pages(6, dtype)
  args = _slot_copies()
  pb.dynamic_validate_slot_copies(*args, num_blocks=_SHAPE[2],
                                  block_size=_SHAPE[3])
  want = np.asarray(pb.ref_copy_slots(pages, *args).astype(jnp.float32))
  out = pb.copy_slots(jnp.array(pages), *args, impl=impl, interpret=True)
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


def test_copy_slots_aliases_and_validates():
  _, pages = _pages(7)
  args = _slot_copies()
  compiled = pb.copy_slots.lower(pages, *args, impl="xla").compile()
  assert compiled.memory_analysis().alias_size_in_bytes >= pages.nbytes
  sb, ss, db, ds, ln = (np.asarray(a).copy() for a in args)
  db[1], ds[1] = 1, 1  # overlaps entry 0's destination
  with pytest.raises(ValueError, match="same destination"):
    pb.dynamic_validate_slot_copies(sb, ss, db, ds, ln, num_blocks=16,
                                    block_size=4)
  ds[1], db[1] = 2, 3
  ss[1], sb[1] = 1, 3  # reads a slot that entry 3 writes
  with pytest.raises(ValueError, match="also a source"):
    pb.dynamic_validate_slot_copies(sb, ss, db, ds, ln, num_blocks=16,
                                    block_size=4)
