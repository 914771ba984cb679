"""Prefill / extend attention with a cached prefix, over segment tables.

A ragged batch of new tokens `q [T, num_q_heads, head_dim]` is split by
`cu_q_lens i32[B+1]`: tokens `cu_q_lens[b] .. cu_q_lens[b+1]-1` belong to row b.
Each row's segment table already covers its cached prefix *and* its new tokens
(their K/V were written by `write_kv` before this call), so with
`seq_len_b = sum of valid segment lengths` and `q_len_b = cu[b+1] - cu[b]`, new token
i of row b sits at logical position `seq_len_b - q_len_b + i` and attends causally
to logical positions `<= ` its own. Tokens at `t >= cu_q_lens[B]` (padding) give 0.

Implementations (`impl=`):
  * "xla":    tiles of one row's new tokens (`xla_tile_size`), each gathering its
              row's blocks for a masked softmax; cost linear in the batch. The
              CPU default.
  * "pallas": grid (q tile, kv head); a program holds `block_q` tokens times the
              GQA group (padded to a power of two) as the rows of its dots and
              walks each of its rows' segments with an online softmax, stopping
              at the last one its tokens can see (`entries_needed`). A row's pages
              are streamed once per tile of its tokens.
  * "mosaic": the Hopper kernel of `prefill_attention_mosaic`; bf16/f16, head_dim
              64 or 128; on CPU only with `interpret=`.

Pages: one layer's `[num_kv_heads, num_blocks, block_size, head_dim]` or the stacked
pool with `layer=`, read in place as the decode kernels do.

`ref_prefill_attention` is the float reference on logical token order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import decode_attention as _pa

# Constants ------------------------------------------------------------------

DEFAULT_BLOCK_Q = 64  # new tokens per program (`default_block_q` may lower it)
# Largest query tile (block_q x padded group x head_dim elements) of the default
# `block_q`: compiled for sm_90a, 128 x 128 with 8 warps spills nothing at the compile
# tier's prefill shapes, 256 x 128 spills and 256 x 256 exceeds shared memory. Not
# timed on a GPU.
MAX_QUERY_TILE = 128 * 128
_WIDE_TILE = 64 * 128  # query tiles of this many elements or more run 8 warps
DEFAULT_PAGES_PER_STEP = _pa.DEFAULT_PAGES_PER_STEP
_SUPPORTED_IMPLS = ("xla", "pallas", "mosaic")
_XLA_MAX_TILE = 64  # new tokens per tile of the "xla" path
_XLA_TILES_PER_STEP = 8  # tiles evaluated together (vectorised) by `lax.map`
_KNOWN_IMPLS = ("xla", "pallas", "mosaic")
_NEG_INF = float("-inf")


def _token_rows(cu_q_lens, seq_lens, num_tokens):
  """Row `i32[T]` (B for padding tokens) and logical position `i32[T]` per token."""
  batch = cu_q_lens.shape[0] - 1
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  row = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1
  in_batch = (t >= cu_q_lens[0]) & (t < cu_q_lens[batch])
  row = jnp.where(in_batch, jnp.clip(row, 0, batch - 1), batch)
  safe = jnp.minimum(row, batch - 1)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  pos = seq_lens[safe] - q_lens[safe] + (t - cu_q_lens[safe])
  return row, jnp.where(in_batch, pos, -1)


def entries_needed(cum_before, num_segments, row, pos):
  """`i32[T]`: table entries token t (of `row[t]`, at position `pos[t]`) can see:
  those whose segment starts at or before `pos[t]`; 0 for padding tokens. A binary
  search per token over `cum_before i32[B, S]`: O(T log S), nothing of size T x S."""
  batch, num_seg_slots = cum_before.shape
  safe = jnp.minimum(row, batch - 1)

  def bisect(_, bounds):  # first entry with cum_before > pos, in [lo, hi]
    lo, hi = bounds
    mid = (lo + hi) // 2
    right = cum_before[safe, jnp.minimum(mid, num_seg_slots - 1)] <= pos
    live = lo < hi
    return (jnp.where(live & right, mid + 1, lo), jnp.where(live & ~right, mid, hi))

  lo = jnp.zeros(row.shape, jnp.int32)
  hi = jnp.full(row.shape, num_seg_slots, jnp.int32)
  count, _ = jax.lax.fori_loop(0, num_seg_slots.bit_length(), bisect, (lo, hi))
  return jnp.where((row < batch) & (pos >= 0),
                   jnp.minimum(count, num_segments[safe]), 0).astype(jnp.int32)


def default_block_q(*, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
  """`block_q` for `block_q=None`: `DEFAULT_BLOCK_Q` new tokens per program, halved
  until the query tile `block_q x padded_group x head_dim` fits `MAX_QUERY_TILE`
  (head_dim 128: group 1-2 -> 64, 4 -> 32, 8 -> 16)."""
  rows_per_token = _pa.padded_group(num_q_heads // num_kv_heads)
  block_q = DEFAULT_BLOCK_Q
  while block_q > 1 and block_q * rows_per_token * head_dim > MAX_QUERY_TILE:
    block_q //= 2
  return block_q


def _seq_lens_and_cum(seg_length, num_segments):
  valid = jnp.arange(seg_length.shape[1])[None, :] < num_segments[:, None]
  lengths = jnp.where(valid, seg_length, 0)
  cum_end = jnp.cumsum(lengths, axis=1)
  return cum_end[:, -1].astype(jnp.int32), (cum_end - lengths).astype(jnp.int32)


# Reference --------------------------------------------------------------------


def ref_prefill_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    cu_q_lens: jax.Array,  # i32[B+1]
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
  """Plain reference: logical K/V of each token's row, causal masked softmax.
  Stacked pages (`[num_layers, ...]`) are read at `layer`."""
  if layer is not None:
    k_pages, v_pages = k_pages[layer], v_pages[layer]
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  max_tokens = seg_block.shape[1] * block_size
  block, slot, seq_lens = _pa.logical_token_slots(
      seg_block, seg_start, seg_length, num_segments, max_tokens=max_tokens)
  row, pos = _token_rows(cu_q_lens, seq_lens, num_tokens)
  safe_row = jnp.minimum(row, seg_block.shape[0] - 1)
  k = k_pages[:, block[safe_row], slot[safe_row]]  # [KVH, T, L, D]
  v = v_pages[:, block[safe_row], slot[safe_row]]
  j = jnp.arange(max_tokens)[None, :]
  mask = (j <= pos[:, None]) & (j < seq_lens[safe_row][:, None])  # [T, L]
  out = _pa.masked_attention(q.reshape(num_tokens, num_kv_heads, group, head_dim), k, v, mask,
                             sm_scale=sm_scale, soft_cap=soft_cap)
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# Validators --------------------------------------------------------------------


def static_validate_inputs(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                           seg_length, num_segments, *, sm_scale, soft_cap, impl,
                           block_q, pages_per_step, interpret=False):
  """Checks shapes, dtypes and static arguments; raises ValueError. On a GPU target
  "pallas" follows the decode rules of `decode_impl_problem`, and `block_q` must be
  None or a power of two."""
  if q.ndim != 3:
    raise ValueError(f"q must be [T, num_q_heads, head_dim], got {q.shape}")
  batch = seg_block.shape[0] if seg_block.ndim == 2 else -1
  if cu_q_lens.shape != (batch + 1,) or cu_q_lens.dtype != jnp.int32:
    raise ValueError(f"cu_q_lens must be i32[{batch + 1}] (B+1), got "
                     f"{cu_q_lens.dtype}{list(cu_q_lens.shape)}")
  # Shared checks of the segment table, pages and statics (one query per row).
  _pa.static_validate_inputs(
      jax.ShapeDtypeStruct((batch, q.shape[1], q.shape[2]), q.dtype), k_pages,
      v_pages, seg_block, seg_start, seg_length, num_segments, sm_scale=sm_scale,
      soft_cap=soft_cap, num_splits=1, impl=impl, pages_per_step=pages_per_step,
      interpret=interpret, supported_impls=_SUPPORTED_IMPLS)
  if impl == "mosaic":  # on every platform: interpret mode runs only what lowers
    from pallas_kernels import prefill_attention_mosaic as pm

    problem = pm.mosaic_prefill_problem(
        num_q_heads=q.shape[1], num_kv_heads=k_pages.shape[-4],
        head_dim=q.shape[2], block_size=k_pages.shape[-2], dtype=k_pages.dtype,
        num_seg_slots=seg_block.shape[1], q_dtype=q.dtype)
    if problem is not None:
      raise ValueError(problem)
    if pages_per_step is not None and pages_per_step * k_pages.shape[-2] != pm.BLOCK_KV:
      raise ValueError(f"impl='mosaic' stages {pm.BLOCK_KV} keys: pages_per_step must "
                       f"be None or {pm.BLOCK_KV // k_pages.shape[-2]}, got "
                       f"{pages_per_step}")
  if block_q is not None and (not isinstance(block_q, int) or block_q < 1):
    raise ValueError(f"block_q must be None or an int >= 1, got {block_q!r}")
  from pallas_kernels import lowering

  if (impl == "pallas" and not interpret and lowering.is_gpu_target() and
      block_q is not None and block_q & (block_q - 1)):
    raise ValueError(f"impl='pallas' (Triton) needs a power-of-two block_q, got "
                     f"{block_q}")


def dynamic_validate_inputs(cu_q_lens, seg_block, seg_start, seg_length,
                            num_segments, *, num_tokens: int, num_blocks: int,
                            block_size: int):
  """Host-side check (debug/tests): the segment table is valid, `cu_q_lens` starts
  at 0, is non-decreasing, ends `<= num_tokens`, and `q_len_b <= seq_len_b`."""
  _pa.dynamic_validate_inputs(seg_block, seg_start, seg_length, num_segments,
                              num_blocks=num_blocks, block_size=block_size)
  cu = np.asarray(cu_q_lens)
  if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > num_tokens:
    raise ValueError(f"cu_q_lens must start at 0, be non-decreasing and end <= "
                     f"{num_tokens}, got {cu}")
  ln, ns = np.asarray(seg_length), np.asarray(num_segments)
  seq_lens = np.where(np.arange(ln.shape[1])[None] < ns[:, None], ln, 0).sum(1)
  if np.any(np.diff(cu) > seq_lens):
    raise ValueError(f"a row has more new tokens than its table covers: q_lens="
                     f"{np.diff(cu)}, seq_lens={seq_lens}")


# XLA path ------------------------------------------------------------------------


def xla_tile_size(num_tokens: int, batch: int) -> int:
  """Tokens per tile of the "xla" path: the mean new tokens per row rounded up
  to a power of two, at most `_XLA_MAX_TILE` (decode-like batches get 1)."""
  mean = max(1, -(-num_tokens // max(batch, 1)))
  return min(_XLA_MAX_TILE, 1 << (mean - 1).bit_length())


def _xla_prefill_attention(q, k_pages, v_pages, layer, cu_q_lens, seg_block,
                           seg_start, seg_length, num_segments, *, sm_scale,
                           soft_cap):
  """Tiles of `tile` new tokens of one row each (at most `cdiv(T, tile) + B`), each
  gathering only its row's blocks of `layer`: O((T + B * tile) * S * block_size).
  `_XLA_TILES_PER_STEP` tiles at a time under `lax.map` bound memory."""
  num_tokens, num_q_heads, head_dim = q.shape
  _, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  batch, num_seg_slots = seg_block.shape
  tile = xla_tile_size(num_tokens, batch)
  num_tiles = pl.cdiv(num_tokens, tile) + batch
  seq_lens, cum_before = _seq_lens_and_cum(seg_length, num_segments)
  q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [B]
  cu_tiles = jnp.concatenate(
      [jnp.zeros(1, jnp.int32), jnp.cumsum((q_lens + tile - 1) // tile)])
  tile_idx = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_row = jnp.clip(
      jnp.searchsorted(cu_tiles, tile_idx, side="right").astype(jnp.int32) - 1,
      0, batch - 1)  # [num_tiles]; tiles past cu_tiles[B] have no valid token
  first = cu_q_lens[tile_row] + (tile_idx - cu_tiles[tile_row]) * tile
  tok = first[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [NT, tile]
  tok_ok = (tile_idx[:, None] < cu_tiles[batch]) & (
      tok < cu_q_lens[tile_row + 1][:, None])
  tok = jnp.where(tok_ok, tok, num_tokens)  # out of range: dropped on scatter
  tok_pos = (seq_lens[tile_row] - q_lens[tile_row])[:, None] + (
      tok - cu_q_lens[tile_row][:, None])  # [NT, tile] logical positions
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  j = jnp.arange(block_size)[None, :]

  def one_tile(args):
    b, tok_t, ok_t, pos_t = args  # row, i32[tile], bool[tile], i32[tile]
    valid = jnp.arange(num_seg_slots) < num_segments[b]  # [S]
    blocks = jnp.clip(jnp.where(valid, seg_block[b], 0), 0, num_blocks - 1)
    start = seg_start[b][:, None]
    in_seg = valid[:, None] & (j >= start) & (j < start + seg_length[b][:, None])
    key_pos = (cum_before[b][:, None] + j - start).reshape(-1)  # [S*bs]
    in_seg = in_seg.reshape(-1)
    k = k_pages[layer, :, blocks]  # [S, KVH, bs, D]
    v = v_pages[layer, :, blocks]
    k = jnp.swapaxes(k, 0, 1).reshape(num_kv_heads, -1, head_dim)
    v = jnp.swapaxes(v, 0, 1).reshape(num_kv_heads, -1, head_dim)
    v = jnp.where(in_seg[None, :, None], v, jnp.zeros((), v.dtype))
    qt = qg[jnp.minimum(tok_t, num_tokens - 1)]  # [tile, KVH, G, D]
    mask = ok_t[:, None] & in_seg[None, :] & (key_pos[None, :] <= pos_t[:, None])
    ct = _pa.compute_dtype(qt.dtype, k.dtype)
    logits = jnp.einsum("thgd,hjd->thgj", qt.astype(ct), k.astype(ct),
                        preferred_element_type=jnp.float32) * sm_scale
    logits = _pa._apply_soft_cap(logits, soft_cap)
    logits = jnp.where(mask[:, None, None, :], logits, _NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgj,hjd->thgd", p, v.astype(jnp.float32))
    return jnp.where(denom == 0, 0.0, o / jnp.where(denom == 0, 1.0, denom))

  out_tiles = jax.lax.map(one_tile, (tile_row, tok, tok_ok, tok_pos),
                          batch_size=min(_XLA_TILES_PER_STEP, num_tiles))
  out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
  out = out.at[tok.reshape(-1)].set(
      out_tiles.reshape(-1, num_kv_heads, group, head_dim), mode="drop")
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# Pallas kernel -------------------------------------------------------------------


def prefill_attention_kernel(
    layer_ref,  # i32[1] the layer to read
    num_segments_ref,  # i32[B]
    seg_block_ref,  # i32[B, S]
    seg_start_ref,  # i32[B, S]
    seg_length_ref,  # i32[B, S]
    cum_before_ref,  # i32[B, S] tokens before each segment
    tok_row_ref,  # i32[block_q] row of each token of this tile (B = padding)
    tok_pos_ref,  # i32[block_q] logical position of each token
    tok_need_ref,  # i32[block_q] table entries each token can see
    q_ref,  # [block_q, G_pad, D] (heads >= G are zero padding)
    k_ref,  # [num_layers, num_blocks, bs, D] (kv head h, every layer)
    v_ref,  # [num_layers, num_blocks, bs, D]
    o_ref,  # [block_q, G_pad, D]
    *, sm_scale, soft_cap, pages_per_step):
  """Program (tile, h): tokens of the tile times the GQA group of kv head h,
  `block_q * G_pad` rows in every dot (one read of a page serves them all).

  Per row, the loop over segments stops at the last entry one of the tile's
  tokens of that row can see (causal cutoff per tile)."""
  block_q, group, head_dim = q_ref.shape
  batch = num_segments_ref.shape[0]
  rows = block_q * group
  layer = layer_ref[0]
  q = q_ref[...].reshape(rows, head_dim)
  tok_row = tok_row_ref[...]
  tok_pos = tok_pos_ref[...]
  tok_need = tok_need_ref[...]
  row_of = jnp.repeat(tok_row, group)  # [rows]
  pos_of = jnp.repeat(tok_pos, group)
  real = tok_row < batch
  b_lo = jnp.min(jnp.where(real, tok_row, batch))
  b_hi = jnp.max(jnp.where(real, tok_row, -1))
  p_dtype = _pa.pv_dtype(q.dtype, v_ref.dtype)

  def one_row(b, carry):
    end = jnp.max(jnp.where(tok_row == b, tok_need, 0))
    num_steps = pl.cdiv(end, pages_per_step)
    mine = row_of == b

    def step(i, carry):
      k, v, mask, key_pos = _pa.load_segment_pages(
          k_ref, v_ref, seg_block_ref, seg_start_ref, seg_length_ref, row=b,
          first=i * pages_per_step, end=end, pages_per_step=pages_per_step,
          cum_before_ref=cum_before_ref, layer=layer)
      logits = jax.lax.dot_general(
          q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32) * sm_scale
      logits = _pa._apply_soft_cap(logits, soft_cap)
      keep = (mine[:, None] & mask[None, :] &
              (key_pos[None, :] <= pos_of[:, None]))
      logits = jnp.where(keep, logits, _NEG_INF)
      return _pa.online_softmax_update(carry, logits, v, p_dtype)

    return jax.lax.fori_loop(0, num_steps, step, carry)

  init = (jnp.full((rows,), _NEG_INF, jnp.float32),
          jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, head_dim), jnp.float32))
  _, l, acc = jax.lax.fori_loop(b_lo, b_hi + 1, one_row, init)
  out = jnp.where(l[:, None] == 0, 0.0,
                  acc / jnp.where(l == 0, 1.0, l)[:, None])
  o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _pallas_prefill_attention(q, k_pages, v_pages, layer, cu_q_lens, seg_block,
                              seg_start, seg_length, num_segments, *, sm_scale,
                              soft_cap, block_q, pages_per_step, interpret):
  num_tokens, num_q_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  group_pad = _pa.padded_group(group)
  num_tiles = pl.cdiv(num_tokens, block_q)
  padded = num_tiles * block_q
  seq_lens, cum_before = _seq_lens_and_cum(seg_length, num_segments)
  tok_row, tok_pos = _token_rows(cu_q_lens, seq_lens, padded)
  tok_need = entries_needed(cum_before, num_segments, tok_row, tok_pos)
  seg_block, seg_start, seg_length = _pa.pad_segment_table(
      seg_block, seg_start, seg_length, multiple=pages_per_step)
  cum_before, = _pa.pad_segment_table(cum_before, multiple=pages_per_step)
  qg = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
  qg = qg.reshape(padded, num_kv_heads, group, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
  kernel = functools.partial(prefill_attention_kernel, sm_scale=sm_scale,
                             soft_cap=soft_cap, pages_per_step=pages_per_step)
  # Large query tiles run 8 warps, as Triton's own attention tiles do (the f32
  # accumulator, block_q * G_pad x D, is spread over twice the threads).
  num_warps = 8 if block_q * group_pad * head_dim >= _WIDE_TILE else 4
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  tile = pl.BlockSpec((None, block_q), lambda i, h: (i, 0))
  qo_spec = pl.BlockSpec((block_q, None, group_pad, head_dim),
                         lambda i, h: (i, h, 0, 0))
  head_pages = _pa.pages_spec(num_layers, num_blocks, block_size, head_dim,
                              lambda i, h: h)
  layer = jnp.reshape(layer, (1,))
  out = pl.pallas_call(
      kernel,
      grid=(num_tiles, num_kv_heads),
      in_specs=[whole(layer), whole(num_segments), whole(seg_block),
                whole(seg_start), whole(seg_length), whole(cum_before), tile,
                tile, tile, qo_spec, head_pages, head_pages],
      out_specs=qo_spec,
      out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
      interpret=interpret,
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
      name="prefill_attention",
  )(layer, num_segments, seg_block, seg_start, seg_length, cum_before,
    tok_row.reshape(num_tiles, block_q), tok_pos.reshape(num_tiles, block_q),
    tok_need.reshape(num_tiles, block_q), qg, k_pages, v_pages)
  out = out[:num_tokens, :, :group]
  return out.reshape(num_tokens, num_q_heads, head_dim)


# Public wrapper -----------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "impl", "interpret", "block_q",
                     "pages_per_step"))
def prefill_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim] or [L, ...]
    v_pages: jax.Array,  # same shape as k_pages
    cu_q_lens: jax.Array,  # i32[B+1]
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    impl: str = "xla",
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    layer: jax.Array | int | None = None,  # i32[] with stacked pages
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
  """Causal attention of ragged new tokens over their rows' segment tables.

  Args:
    q: new tokens of all rows, concatenated (T may include trailing padding).
    k_pages, v_pages: one layer's pages, or the pool's stacked pages with
      `layer`, already holding the new tokens' K/V.
    cu_q_lens: row b owns tokens `cu_q_lens[b] : cu_q_lens[b+1]`; `cu_q_lens[0]`
      must be 0.
    seg_block, seg_start, seg_length, num_segments: segment table covering prefix
      plus new tokens of each row (padded to S entries; padding never read).
    sm_scale, soft_cap: as in `paged_attention`.
    impl: "xla" (CPU default), "pallas" or "mosaic" (Hopper; module docstring).
    interpret: run the Pallas kernel in interpret mode (CPU); for "mosaic" also
      a `plgpu.InterpretGPUParams` (True: with race detection).
    block_q: new tokens per Pallas program; None = `default_block_q`.
    pages_per_step: segments loaded per online-softmax step ("pallas"); None =
      `paged_attention.default_pages_per_step(block_size)`.
    layer: which layer of stacked pages (as in `paged_attention.paged_attention`).
  """
  static_validate_inputs(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                         seg_length, num_segments, sm_scale=sm_scale,
                         soft_cap=soft_cap, impl=impl, block_q=block_q,
                         pages_per_step=pages_per_step, interpret=interpret)
  k_pages, v_pages, layer = _pa.stacked_pages(k_pages, v_pages, layer)
  sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
  if pages_per_step is None:
    pages_per_step = _pa.default_pages_per_step(k_pages.shape[3])
  if block_q is None:
    block_q = default_block_q(num_q_heads=q.shape[1], num_kv_heads=k_pages.shape[1],
                              head_dim=q.shape[2])
  if impl == "xla":
    return _xla_prefill_attention(q, k_pages, v_pages, layer, cu_q_lens, seg_block,
                                  seg_start, seg_length, num_segments,
                                  sm_scale=sm_scale, soft_cap=soft_cap)
  if impl == "mosaic":
    from pallas_kernels import prefill_attention_mosaic as pm

    return pm.mosaic_prefill_attention(
        q, k_pages, v_pages, jnp.asarray(layer, jnp.int32), cu_q_lens, seg_block,
        seg_start, seg_length, num_segments, sm_scale=sm_scale, soft_cap=soft_cap,
        interpret=interpret)
  return _pallas_prefill_attention(q, k_pages, v_pages, layer, cu_q_lens,
                                   seg_block, seg_start, seg_length, num_segments,
                                   sm_scale=sm_scale, soft_cap=soft_cap,
                                   block_q=block_q, pages_per_step=pages_per_step,
                                   interpret=interpret)
