"""Prefill/extend attention with a cached prefix: xla and Pallas (interpret) vs ref."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as pa
from pallas_kernels import prefill_attention as pf
from tests.kernels.test_decode_attention import (_TOL, assert_table_coverage,
                                          make_segment_tables, poisoned_pages,
                                          ref64)

# Rows: (seq_len, q_len). Full prefill, extend after a cached prefix, a single new
# token, a row with no new token, lengths that are multiples of block_size (8).
_ROWS = ((13, 13), (16, 3), (24, 1), (9, 0), (11, 5), (8, 8))


def _case(seed, *, dtype, group, num_kv_heads=2, head_dim=16, block_size=8,
          num_blocks=48, max_segments=8, pad_tokens=3, rows=_ROWS):
  rng = np.random.default_rng(seed)
  seq_lens = [s for s, _ in rows]
  *table, used = make_segment_tables(rng, seq_lens, num_blocks=num_blocks,
                                     block_size=block_size,
                                     max_segments=max_segments)
  assert_table_coverage(*table)
  cu = np.concatenate([[0], np.cumsum([q for _, q in rows])]).astype(np.int32)
  num_tokens = int(cu[-1]) + pad_tokens
  pf.dynamic_validate_inputs(cu, *table, num_tokens=num_tokens,
                             num_blocks=num_blocks, block_size=block_size)
  k, v = poisoned_pages(rng, used, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype)
  q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
  q[cu[-1]:] = np.nan  # padding tokens must not matter (their output is 0)
  return (jnp.asarray(q, dtype), k, v, jnp.asarray(cu),
          [jnp.asarray(t) for t in table])


def _check(out, want, q, cu, dtype):
  got = np.asarray(out.astype(jnp.float32))
  real = int(cu[-1])
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.all(np.isfinite(got[:real])), "a poisoned slot reached the output"
  np.testing.assert_allclose(got[:real], want[:real], **_TOL[dtype])
  np.testing.assert_array_equal(got[real:], 0.0)


@pytest.mark.parametrize("dtype,group,soft_cap,block_q,pages_per_step", [
    (jnp.float32, 1, None, 4, 2),
    (jnp.float32, 4, 5.0, 8, 1),
    (jnp.bfloat16, 8, None, 8, 3),
])
def test_pallas_matches_reference(dtype, group, soft_cap, block_q, pages_per_step):
  q, k, v, cu, table = _case(group + block_q, dtype=dtype, group=group)
  out = pf.prefill_attention(q, k, v, cu, *table, soft_cap=soft_cap,
                             impl="pallas", interpret=True, block_q=block_q,
                             pages_per_step=pages_per_step)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table, soft_cap=soft_cap)
  _check(out, want, q, cu, dtype)


@pytest.mark.parametrize("dtype,group,soft_cap", [
    (jnp.float32, 1, 2.0), (jnp.float32, 8, None), (jnp.bfloat16, 4, None),
    (jnp.bfloat16, 4, 3.0)])
def test_xla_matches_reference(dtype, group, soft_cap):
  q, k, v, cu, table = _case(group * 3 + 1, dtype=dtype, group=group)
  out = pf.prefill_attention(q, k, v, cu, *table, soft_cap=soft_cap, impl="xla")
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table, soft_cap=soft_cap)
  _check(out, want, q, cu, dtype)


# Long rows: 97 + 33 new tokens (+3 padding: T = 133, not a multiple of 64), so
# 64-token tiles straddle rows and end inside a row.
_LONG_ROWS = ((150, 97), (40, 0), (70, 33))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,group,rows", [
    (jnp.float32, 4, _ROWS),  # T = 52 < 64: one tile, padded
    (jnp.float32, 2, _LONG_ROWS),
    (jnp.bfloat16, 8, _LONG_ROWS),  # group 8: default_block_q 64 at head_dim 16
])
def test_pallas_default_tile_matches_reference(dtype, group, rows):
  """The default `block_q` (64 tokens at head_dim 16) vs the reference."""
  assert pf.default_block_q(num_q_heads=2 * group, num_kv_heads=2, head_dim=16) == 64
  q, k, v, cu, table = _case(group + len(rows), dtype=dtype, group=group, rows=rows,
                             num_blocks=96, max_segments=32)
  out = pf.prefill_attention(q, k, v, cu, *table, impl="pallas", interpret=True)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table)
  _check(out, want, q, cu, dtype)


def test_default_block_q_fits_the_query_tile():
  """64 tokens unless block_q x padded group x head_dim would pass MAX_QUERY_TILE;
  every dot keeps >= 64 rows."""
  got = {(g, d): pf.default_block_q(num_q_heads=8 * g, num_kv_heads=8, head_dim=d)
         for g in (1, 2, 4, 5, 8) for d in (64, 128, 256)}
  assert got[(1, 128)] == got[(2, 128)] == got[(4, 64)] == got[(1, 256)] == 64
  assert got[(4, 128)] == got[(8, 64)] == 32
  assert got[(5, 128)] == got[(8, 128)] == 16  # group 5 pads to 8
  assert got[(8, 256)] == 8
  for (g, d), bq in got.items():
    assert bq * pa.padded_group(g) * d <= pf.MAX_QUERY_TILE
    assert bq * pa.padded_group(g) >= 64


def test_last_token_equals_decode():
  """The last new token of each row attends to the whole row, like decode."""
  q, k, v, cu, table = _case(5, dtype=jnp.float32, group=4)
  out = np.asarray(pf.prefill_attention(q, k, v, cu, *table, impl="xla"))
  cu_np = np.asarray(cu)
  rows = np.array([b for b in range(len(_ROWS)) if cu_np[b + 1] > cu_np[b]])
  last = cu_np[1:][rows] - 1
  dec = np.asarray(pa.decode_attention(q[last], k, v, *[t[rows] for t in table]))
  np.testing.assert_allclose(out[last], dec, rtol=1e-5, atol=1e-5)


def test_validation_errors():
  q, k, v, cu, table = _case(1, dtype=jnp.float32, group=2)
  with pytest.raises(ValueError, match="cu_q_lens"):
    pf.prefill_attention(q, k, v, cu[:-1], *table)
  with pytest.raises(ValueError, match="block_q"):
    pf.prefill_attention(q, k, v, cu, *table, impl="pallas", block_q=0)
  bad = np.asarray(cu).copy()
  bad[1] = 40  # more new tokens than row 0's table covers
  with pytest.raises(ValueError, match="more new tokens|non-decreasing"):
    pf.dynamic_validate_inputs(bad, *table, num_tokens=q.shape[0],
                               num_blocks=48, block_size=8)


# Stacked pages and a layer index ----------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_stacked_pages_read_the_given_layer(impl):
  """`layer=` (traced, != 0) with the pool's stacked pages equals the reference
  on that layer; every other layer is poisoned."""
  from tests.kernels.test_decode_attention import stack_layers

  q, k, v, cu, table = _case(11, dtype=jnp.float32, group=2)
  rng = np.random.default_rng(3)
  k5 = stack_layers(rng, k, num_layers=4, layer=1)
  v5 = stack_layers(rng, v, num_layers=4, layer=1)
  fn = jax.jit(lambda layer, *a: pf.prefill_attention(
      *a, layer=layer, impl=impl, interpret=impl != "xla", block_q=4,
      pages_per_step=2))
  out = fn(jnp.int32(1), q, k5, v5, cu, *table)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table)
  _check(out, want, q, cu, jnp.float32)


# Causal cutoff per tile -----------------------------------------------------------


def test_entries_needed_stops_at_the_tokens_last_visible_segment():
  seg_length = jnp.array([[4, 4, 2, 4, 0]], jnp.int32)
  num_segments = jnp.array([4], jnp.int32)
  _, cum_before = pf._seq_lens_and_cum(seg_length, num_segments)  # 0, 4, 8, 10
  row = jnp.zeros((7,), jnp.int32).at[-1].set(1)  # last token: padding
  pos = jnp.array([0, 3, 4, 8, 9, 13, -1], jnp.int32)
  got = pf.entries_needed(cum_before, num_segments, row, pos)
  np.testing.assert_array_equal(np.asarray(got), [1, 1, 2, 3, 3, 4, 0])


@pytest.mark.slow
@pytest.mark.parametrize("block_q", [8, 64])
def test_prefill_tile_does_not_stream_future_pages(block_q):
  """A `4 * block_q`-token prefill from nothing in 8 whole blocks of
  `block_q / 2`: the blocks of the second half hold NaN. Tiles of `block_q`
  tokens: the first two tiles (the first half) see only the first 4 blocks and
  must not load the others (a load would poison them: 0 * NaN), so their
  outputs are finite and right."""
  impl = "pallas"
  block_size, num_blocks, seq_len = block_q // 2, 12, 4 * block_q
  rng = np.random.default_rng(7)
  blocks = rng.permutation(num_blocks)[:8].astype(np.int32)
  seg_block = jnp.asarray(blocks[None])
  seg_start = jnp.zeros((1, 8), jnp.int32)
  seg_length = jnp.full((1, 8), block_size, jnp.int32)
  num_segments = jnp.array([8], jnp.int32)
  cu = jnp.array([0, seq_len], jnp.int32)
  k = rng.standard_normal((2, num_blocks, block_size, 16)).astype(np.float32)
  v = rng.standard_normal((2, num_blocks, block_size, 16)).astype(np.float32)
  k[:, blocks[4:]] = np.nan
  v[:, blocks[4:]] = np.nan
  q = jnp.asarray(rng.standard_normal((seq_len, 4, 16)), jnp.float32)
  k, v = jnp.asarray(k), jnp.asarray(v)
  table = (seg_block, seg_start, seg_length, num_segments)
  out = pf.prefill_attention(q, k, v, cu, *table, impl=impl, interpret=True,
                             block_q=block_q, pages_per_step=1)
  want = ref64(pf.ref_prefill_attention, q, k, v, cu, *table)
  got = np.asarray(out)
  half = seq_len // 2
  assert np.all(np.isfinite(got[:half])), "a tile streamed a future token's page"
  np.testing.assert_allclose(got[:half], want[:half], **_TOL[jnp.float32])


def test_entries_needed_matches_a_linear_count():
  """The binary search against counting entries, on random tables."""
  rng = np.random.default_rng(2)
  for num_seg_slots in (1, 2, 5, 8, 33):
    lengths = rng.integers(1, 9, (3, num_seg_slots)).astype(np.int32)
    num_segments = rng.integers(0, num_seg_slots + 1, 3).astype(np.int32)
    seq_lens, cum_before = pf._seq_lens_and_cum(jnp.asarray(lengths),
                                                jnp.asarray(num_segments))
    row = rng.integers(0, 4, 50).astype(np.int32)  # 3 = padding
    pos = rng.integers(-1, int(np.asarray(seq_lens).max()) + 1, 50).astype(np.int32)
    got = np.asarray(pf.entries_needed(cum_before, jnp.asarray(num_segments),
                                       jnp.asarray(row), jnp.asarray(pos)))
    cb = np.asarray(cum_before)
    for t in range(50):
      want = 0
      if row[t] < 3 and pos[t] >= 0:
        want = min(int(np.sum(cb[row[t]] <= pos[t])), int(num_segments[row[t]]))
      assert got[t] == want, (num_seg_slots, t, got[t], want)
