"""Decode attention over segment tables: xla and Pallas (interpret) vs the reference.

Also holds `make_segment_tables` / `poisoned_pages`, shared with the prefill tests.
Every test builds fresh random inputs; unused blocks, unused slots of used blocks and
padding table entries are poisoned (NaN pages, garbage indices) so a stray read shows.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering
from pallas_kernels import decode_attention as pa

_TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5),
        jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_segment_tables(rng, seq_lens, *, num_blocks, block_size, max_segments,
                        share_prefix=True):
  """Random segment tables covering `seq_lens` tokens per row.

  Mixes full blocks, partial segments at random offsets, slotted segments of
  different rows inside one block, and (if `share_prefix`) rows that reuse the
  first segments of row 0. Padding entries get garbage. Returns numpy
  `(seg_block, seg_start, seg_length, num_segments, used_slots bool[nb, bs])`.
  """
  batch = len(seq_lens)
  free = list(rng.permutation(num_blocks))
  used = np.zeros((num_blocks, block_size), bool)
  slot_block = None  # a block handed out a few slots at a time
  slot_cursor = block_size
  shape = (batch, max_segments)
  seg_block = rng.integers(-(10**6), 10**6, shape).astype(np.int32)
  seg_start = rng.integers(-(10**6), 10**6, shape).astype(np.int32)
  seg_length = rng.integers(-(10**6), 10**6, shape).astype(np.int32)
  num_segments = np.zeros(batch, np.int32)
  for b, n in enumerate(seq_lens):
    segs = []
    remaining = n
    if share_prefix and b % 2 and remaining > 0:
      # Share a token prefix of row 0 (possibly ending inside a segment).
      for s in range(min(int(num_segments[0]), max_segments - 1)):
        ln = min(int(seg_length[0, s]), remaining)
        segs.append((int(seg_block[0, s]), int(seg_start[0, s]), ln))
        remaining -= ln
        if remaining == 0 or rng.random() < 0.3:
          break
    while remaining > 0:
      if len(segs) == max_segments - 1:
        kind = "last"
      else:
        kind = rng.choice(["full", "partial", "slotted"])
      if kind == "slotted":
        want = int(rng.integers(1, min(remaining, block_size // 2) + 1))
        if slot_cursor + want > block_size:
          slot_block, slot_cursor = int(free.pop()), 0
        seg = (slot_block, slot_cursor, want)
        slot_cursor += want
      elif kind == "partial":
        ln = int(rng.integers(1, min(remaining, block_size) + 1))
        st = int(rng.integers(0, block_size - ln + 1))
        seg = (int(free.pop()), st, ln)
      elif kind == "last":
        if remaining > block_size:
          raise ValueError("max_segments too small for the requested seq_lens")
        seg = (int(free.pop()), 0, remaining)
      else:
        seg = (int(free.pop()), 0, min(block_size, remaining))
      segs.append(seg)
      remaining -= seg[2]
    for s, (blk, st, ln) in enumerate(segs):
      seg_block[b, s], seg_start[b, s], seg_length[b, s] = blk, st, ln
      used[blk, st:st + ln] = True
    num_segments[b] = len(segs)
  return seg_block, seg_start, seg_length, num_segments, used


def assert_table_coverage(seg_block, seg_start, seg_length, num_segments):
  """The generated table has partial, slotted and shared segments."""
  segs = [(b, int(seg_block[b, s]), int(seg_start[b, s]), int(seg_length[b, s]))
          for b in range(len(num_segments)) for s in range(num_segments[b])]
  readers = {}  # (block, slot) -> rows reading it
  for b, blk, st, ln in segs:
    for j in range(st, st + ln):
      readers.setdefault((blk, j), set()).add(b)
  shared = any(len(r) > 1 for r in readers.values())
  by_block = {}
  for _, blk, st, ln in segs:
    by_block.setdefault(blk, set()).add(st)
  slotted = any(len(v) > 1 for v in by_block.values())
  partial = any(st > 0 for _, _, st, _ in segs)
  assert shared and slotted and partial, (shared, slotted, partial)


def poisoned_pages(rng, used, *, num_kv_heads, head_dim, dtype):
  """Random k, v `[KVH, nb, bs, D]` with every unused slot set to NaN."""
  nb, bs = used.shape
  k = rng.standard_normal((num_kv_heads, nb, bs, head_dim)).astype(np.float32)
  v = rng.standard_normal((num_kv_heads, nb, bs, head_dim)).astype(np.float32)
  k[:, ~used] = np.nan
  v[:, ~used] = np.nan
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def ref64(fn, *arrays, **kw):
  """Runs a `ref_*` on float64-upcast inputs (x64 enabled only inside)."""
  with jax.enable_x64(True):
    up = [jnp.asarray(np.asarray(a, np.float64)) if np.asarray(a).dtype.kind == "f"
          or a.dtype == jnp.bfloat16 else jnp.asarray(a) for a in arrays]
    return np.asarray(fn(*up, **kw))


def _case(seed, *, dtype, group, seq_lens, block_size=8, num_kv_heads=2,
          head_dim=16, num_blocks=48, max_segments=8, check_coverage=True):
  rng = np.random.default_rng(seed)
  tables = make_segment_tables(rng, seq_lens, num_blocks=num_blocks,
                               block_size=block_size, max_segments=max_segments)
  *table, used = tables
  pa.dynamic_validate_inputs(*table, num_blocks=num_blocks, block_size=block_size)
  if check_coverage:
    assert_table_coverage(*table)
  k, v = poisoned_pages(rng, used, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype)
  q = jnp.asarray(rng.standard_normal(
      (len(seq_lens), num_kv_heads * group, head_dim)), dtype)
  return q, k, v, [jnp.asarray(t) for t in table]


# Lengths: 1, exact multiples of block_size (8), partial, and an empty row.
_SEQ_LENS = (13, 1, 16, 0, 24, 5, 11, 7)

_PALLAS_CASES = [
    # (dtype, group, soft_cap, num_splits, pages_per_step)
    (jnp.float32, 1, None, 1, 2),
    (jnp.float32, 4, 5.0, 3, 1),
    (jnp.bfloat16, 8, None, 2, 4),
    (jnp.bfloat16, 4, 3.0, 1, 3),
    (jnp.float32, 5, None, 2, 2),  # not a power of two: padded to 8 rows
    (jnp.bfloat16, 16, 2.0, 1, 2),  # a 16-row group
]


@pytest.mark.parametrize("dtype,group,soft_cap,num_splits,pages_per_step",
                         _PALLAS_CASES)
def test_pallas_matches_reference(dtype, group, soft_cap, num_splits,
                                  pages_per_step):
  q, k, v, table = _case(group * 7 + num_splits, dtype=dtype, group=group,
                         seq_lens=_SEQ_LENS)
  out = pa.decode_attention(q, k, v, *table, soft_cap=soft_cap, impl="pallas",
                           interpret=True, num_splits=num_splits,
                           pages_per_step=pages_per_step)
  want = ref64(pa.ref_decode_attention, q, k, v, *table, soft_cap=soft_cap)
  assert out.shape == q.shape and out.dtype == q.dtype
  got = np.asarray(out.astype(jnp.float32))
  assert np.all(np.isfinite(got)), "a poisoned slot reached the output"
  np.testing.assert_allclose(got, want, **_TOL[dtype])
  np.testing.assert_array_equal(got[3], 0.0)  # the empty row


@pytest.mark.parametrize("dtype,group,soft_cap",
                         list(itertools.product([jnp.float32, jnp.bfloat16],
                                                [1, 4, 8], [None, 2.0])))
def test_xla_matches_reference(dtype, group, soft_cap):
  q, k, v, table = _case(group + (soft_cap is None), dtype=dtype, group=group,
                         seq_lens=_SEQ_LENS)
  out = pa.decode_attention(q, k, v, *table, soft_cap=soft_cap, impl="xla")
  want = ref64(pa.ref_decode_attention, q, k, v, *table, soft_cap=soft_cap)
  got = np.asarray(out.astype(jnp.float32))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, **_TOL[dtype])
  np.testing.assert_array_equal(got[3], 0.0)


def test_reference_matches_dense_attention():
  """The reference itself, on a contiguous one-block-per-segment table."""
  rng = np.random.default_rng(0)
  batch, heads, dim, bs, nblk = 2, 4, 8, 4, 3
  k = rng.standard_normal((batch, nblk * bs, heads, dim)).astype(np.float32)
  v = rng.standard_normal((batch, nblk * bs, heads, dim)).astype(np.float32)
  q = rng.standard_normal((batch, heads, dim)).astype(np.float32)
  # pages: row b uses blocks b*nblk .. b*nblk+nblk-1
  kp = k.reshape(batch * nblk, bs, heads, dim).transpose(2, 0, 1, 3)
  vp = v.reshape(batch * nblk, bs, heads, dim).transpose(2, 0, 1, 3)
  blocks = np.arange(batch * nblk, dtype=np.int32).reshape(batch, nblk)
  out = pa.ref_decode_attention(
      jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(blocks),
      jnp.zeros_like(blocks), jnp.full_like(blocks, bs),
      jnp.full((batch,), nblk, jnp.int32))
  dense = jax.nn.dot_product_attention(q[:, None], k, v)[:, 0]
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=1e-5,
                             atol=1e-5)


def test_validation_errors():
  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  with pytest.raises(ValueError, match="multiple of"):
    pa.decode_attention(q[:, :3], k, v, *table)
  with pytest.raises(ValueError, match="impl"):
    pa.decode_attention(q, k, v, *table, impl="triton")
  with pytest.raises(ValueError, match="not implemented"):
    pa.decode_attention(q, k, v, *table, impl="mosaic")
  with pytest.raises(ValueError, match="int32"):
    pa.decode_attention(q, k, v, table[0].astype(jnp.int16), *table[1:])
  blk, st, ln, ns = (np.asarray(t).copy() for t in table)
  ln[0, 0] = 99
  with pytest.raises(ValueError, match="invalid segment"):
    pa.dynamic_validate_inputs(blk, st, ln, ns, num_blocks=48, block_size=8)


def test_no_recompile_on_new_table_values():
  q, k, v, table = _case(2, dtype=jnp.float32, group=2, seq_lens=(3, 9),
                         check_coverage=False)
  pa.decode_attention(q, k, v, *table, impl="xla").block_until_ready()
  q2, k2, v2, table2 = _case(3, dtype=jnp.float32, group=2, seq_lens=(7, 2),
                             check_coverage=False)
  with jax.log_compiles(True):
    before = pa.decode_attention._cache_size()
    pa.decode_attention(q2, k2, v2, *table2, impl="xla").block_until_ready()
    assert pa.decode_attention._cache_size() == before


# Stacked pages (the pool) and a layer index -----------------------------------


def stack_layers(rng, pages, *, num_layers, layer):
  """`[num_layers, *pages.shape]`: `pages` at `layer`, every other layer random
  with NaN wherever `pages` is NaN, so a read of the wrong layer shows twice
  (wrong numbers, and NaN where the right layer is live but not the other)."""
  other = rng.standard_normal((num_layers,) + pages.shape).astype(np.float32)
  other[:, ~np.isnan(np.asarray(pages, np.float32))] = np.nan
  stacked = jnp.asarray(other, pages.dtype)
  return stacked.at[layer].set(pages)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("traced", [False, True])
def test_stacked_pages_read_the_given_layer(impl, traced):
  """`layer=` with the pool's stacked pages equals the one-layer call and the
  reference, for a Python int and a traced layer (layer != 0)."""
  q, k, v, table = _case(31, dtype=jnp.float32, group=4, seq_lens=_SEQ_LENS)
  rng = np.random.default_rng(5)
  k5 = stack_layers(rng, k, num_layers=3, layer=2)
  v5 = stack_layers(rng, v, num_layers=3, layer=2)
  kw = dict(impl=impl, interpret=impl != "xla", num_splits=2)
  if traced:
    fn = jax.jit(lambda layer, *a: pa.decode_attention(*a, layer=layer, **kw))
    out = fn(jnp.int32(2), q, k5, v5, *table)
  else:
    out = pa.decode_attention(q, k5, v5, *table, layer=2, **kw)
  want = ref64(pa.ref_decode_attention, q, k, v, *table)
  got = np.asarray(out)
  assert np.all(np.isfinite(got)), "a poisoned slot or the wrong layer was read"
  np.testing.assert_allclose(got, want, **_TOL[jnp.float32])
  np.testing.assert_allclose(
      got, np.asarray(pa.decode_attention(q, k, v, *table, **kw)), rtol=1e-6, atol=1e-6)
  # A negative layer counts from the end, as a numpy index.
  neg = pa.decode_attention(q, k5, v5, *table, layer=jnp.int32(-1), **kw)
  np.testing.assert_allclose(np.asarray(neg), got, rtol=1e-6, atol=1e-6)


def test_stacked_pages_need_a_layer():
  q, k, v, table = _case(1, dtype=jnp.float32, group=2, seq_lens=(3, 4),
                         check_coverage=False)
  with pytest.raises(ValueError, match="need layer="):
    pa.decode_attention(q, k[None], v[None], *table)
  with pytest.raises(ValueError, match="stacked"):
    pa.decode_attention(q, k, v, *table, layer=1)
  with pytest.raises(ValueError, match="outside"):
    pa.stacked_pages(k[None], v[None], 1)


# Split-K by default ---------------------------------------------------------------


def test_default_num_splits_fills_the_gpu_from_static_shapes():
  """Batch 1 x 8 kv heads x a 128k-token bound: enough splits for 2 x 132 SMs;
  a full batch: 1; a short table: no split below MIN_KEYS_PER_SPLIT slots."""
  kw = dict(num_kv_heads=8, pages_per_step=4, block_size=16, num_cores=132)
  long = pa.default_num_splits(batch=1, num_seg_slots=8192, **kw)
  assert long > 1 and 8 * long >= 2 * 132, long
  assert pa.default_num_splits(batch=256, num_seg_slots=512, **kw) == 1
  assert pa.default_num_splits(batch=64, num_seg_slots=512, **kw) == 1
  assert pa.default_num_splits(batch=1, num_seg_slots=64, **kw) == 4  # 1k tokens
  assert pa.default_num_splits(batch=1, num_seg_slots=1, **kw) == 1
  assert pa.default_num_splits(batch=1, num_seg_slots=10**6, **kw) <= pa.MAX_SPLITS
  with jax.sharding.use_abstract_mesh(lowering.abstract_gpu_mesh(num_cores=66)):
    assert pa.target_num_cores() == 66
  assert pa.split_entries(10, 4, 1) == (4, 3)
  assert pa.split_entries(9, 4, 1) == (3, 3)  # no empty split
  assert pa.split_entries(9, 4, 4) == (3, 4)


def test_pallas_default_splits_match_reference():
  """`num_splits=None` (the default) on a long-ish table splits K (interpret)."""
  q, k, v, table = _case(17, dtype=jnp.float32, group=2, seq_lens=(300, 5, 0, 77),
                         block_size=16, num_blocks=64, max_segments=40,
                         check_coverage=False)
  assert pa.default_num_splits(batch=4, num_kv_heads=2, num_seg_slots=40,
                               pages_per_step=4, block_size=16) > 1
  out = pa.decode_attention(q, k, v, *table, impl="pallas", interpret=True)
  want = ref64(pa.ref_decode_attention, q, k, v, *table)
  np.testing.assert_allclose(np.asarray(out), want, **_TOL[jnp.float32])


# fp8 pages -----------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fp8_pages_keep_probabilities_in_the_compute_dtype(impl):
  """e4m3 pages, f32 queries: V is upcast for P V; rounding P to e4m3 (3
  mantissa bits, ~6% steps) would miss this tolerance by far."""
  q, k, v, table = _case(23, dtype=jnp.float32, group=4, seq_lens=_SEQ_LENS)
  k8, v8 = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
  out = pa.decode_attention(q, k8, v8, *table, impl=impl, interpret=impl != "xla")
  want = ref64(pa.ref_decode_attention, q, k8.astype(jnp.float32),
               v8.astype(jnp.float32), *table)
  got = np.asarray(out)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
