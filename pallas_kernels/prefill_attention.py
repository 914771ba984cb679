"""Prefill / extend attention with a cached prefix, over segment tables.

A ragged batch of new tokens `q [T, num_q_heads, head_dim]` is split by
`cu_q_lens i32[B+1]`: tokens `cu_q_lens[b] .. cu_q_lens[b+1]-1` belong to row b.
Each row's segment table already covers its cached prefix *and* its new tokens
(their K/V were written by `write_kv` before this call), so with
`seq_len_b = sum of valid segment lengths` and `q_len_b = cu[b+1] - cu[b]`, new token
i of row b sits at logical position `seq_len_b - q_len_b + i` and attends causally
to logical positions `<= ` its own. Tokens at `t >= cu_q_lens[B]` (padding) give 0.

Implementations (`impl=`):
  * "xla":    per row, gathers the row's blocks (`jnp.take`) and runs a masked
              softmax for all T tokens, keeping the rows that belong to it
              (`lax.scan` over rows: memory O(T * S * block_size), compute B times
              that). The library's CPU default, sized for a tiny model.
  * "pallas": grid (q tile, kv head). A program holds `block_q` consecutive tokens
              times the GQA group, loops over the rows its tokens belong to and,
              per row, over its segments `pages_per_step` blocks at a time with an
              online softmax; masks keep keys of other rows, slots outside
              segments and future positions out. Output tiles never overlap, so
              programs are independent.
  * "mosaic": not implemented (ValueError).

`ref_prefill_attention` is the float reference on logical token order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import paged_attention as _pa

# Constants ------------------------------------------------------------------

DEFAULT_BLOCK_Q = 8  # new tokens per program
DEFAULT_PAGES_PER_STEP = _pa.DEFAULT_PAGES_PER_STEP
_SUPPORTED_IMPLS = ("xla", "pallas")
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
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
  """Plain reference: logical K/V of each token's row, causal masked softmax."""
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
                           block_q, pages_per_step):
  """Checks shapes, dtypes and static arguments; raises ValueError."""
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
      soft_cap=soft_cap, num_splits=1, impl=impl, pages_per_step=pages_per_step)
  if not isinstance(block_q, int) or block_q < 1:
    raise ValueError(f"block_q must be an int >= 1, got {block_q!r}")


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


def _xla_prefill_attention(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                           seg_length, num_segments, *, sm_scale, soft_cap):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  batch, num_seg_slots = seg_block.shape
  seq_lens, cum_before = _seq_lens_and_cum(seg_length, num_segments)
  tok_row, tok_pos = _token_rows(cu_q_lens, seq_lens, num_tokens)
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  j = jnp.arange(block_size)[None, :]

  def one_row(out, b):
    valid = jnp.arange(num_seg_slots) < num_segments[b]  # [S]
    blocks = jnp.clip(jnp.where(valid, seg_block[b], 0), 0, num_blocks - 1)
    start = seg_start[b][:, None]
    in_seg = valid[:, None] & (j >= start) & (j < start + seg_length[b][:, None])
    key_pos = (cum_before[b][:, None] + j - start).reshape(-1)  # [S*bs]
    in_seg = in_seg.reshape(-1)
    k = k_pages[:, blocks].reshape(num_kv_heads, -1, head_dim)
    v = v_pages[:, blocks].reshape(num_kv_heads, -1, head_dim)
    v = jnp.where(in_seg[None, :, None], v, jnp.zeros((), v.dtype))
    mine = tok_row == b  # [T]
    mask = mine[:, None] & in_seg[None, :] & (key_pos[None, :] <= tok_pos[:, None])
    logits = jnp.einsum("thgd,hjd->thgj", qg, k,
                        preferred_element_type=jnp.float32) * sm_scale
    logits = _pa._apply_soft_cap(logits, soft_cap)
    logits = jnp.where(mask[:, None, None, :], logits, _NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thgj,hjd->thgd", p, v.astype(jnp.float32))
    o = jnp.where(denom == 0, 0.0, o / jnp.where(denom == 0, 1.0, denom))
    return jnp.where(mine[:, None, None, None], o, out), None

  init = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
  out, _ = jax.lax.scan(one_row, init, jnp.arange(batch))
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# Pallas kernel -------------------------------------------------------------------


def prefill_attention_kernel(
    num_segments_ref,  # i32[B]
    seg_block_ref,  # i32[B, S]
    seg_start_ref,  # i32[B, S]
    seg_length_ref,  # i32[B, S]
    cum_before_ref,  # i32[B, S] tokens before each segment
    tok_row_ref,  # i32[block_q] row of each token of this tile (B = padding)
    tok_pos_ref,  # i32[block_q] logical position of each token
    q_ref,  # [block_q, G, D]
    k_ref,  # [KVH, num_blocks, bs, D] (whole array)
    v_ref,  # [KVH, num_blocks, bs, D]
    o_ref,  # [block_q, G, D]
    *, sm_scale, soft_cap, pages_per_step):
  """Program (tile, h): tokens of the tile times the GQA group of kv head h."""
  head = pl.program_id(1)
  block_q, group, head_dim = q_ref.shape
  batch = num_segments_ref.shape[0]
  rows = block_q * group
  q = q_ref[...].astype(jnp.float32).reshape(rows, head_dim) * sm_scale
  tok_row = tok_row_ref[...]
  tok_pos = tok_pos_ref[...]
  row_of = jnp.repeat(tok_row, group)  # [rows]
  pos_of = jnp.repeat(tok_pos, group)
  real = tok_row < batch
  b_lo = jnp.min(jnp.where(real, tok_row, batch))
  b_hi = jnp.max(jnp.where(real, tok_row, -1))

  def one_row(b, carry):
    end = num_segments_ref[b]
    num_steps = pl.cdiv(end, pages_per_step)
    mine = row_of == b

    def step(i, carry):
      k, v, mask, key_pos = _pa.load_segment_pages(
          k_ref, v_ref, seg_block_ref, seg_start_ref, seg_length_ref, row=b,
          head=head, first=i * pages_per_step, end=end,
          pages_per_step=pages_per_step, cum_before_ref=cum_before_ref)
      logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
      logits = _pa._apply_soft_cap(logits, soft_cap)
      keep = (mine[:, None] & mask[None, :] &
              (key_pos[None, :] <= pos_of[:, None]))
      logits = jnp.where(keep, logits, _NEG_INF)
      return _pa.online_softmax_update(carry, logits, v)

    return jax.lax.fori_loop(0, num_steps, step, carry)

  init = (jnp.full((rows,), _NEG_INF, jnp.float32),
          jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, head_dim), jnp.float32))
  _, l, acc = jax.lax.fori_loop(b_lo, b_hi + 1, one_row, init)
  out = jnp.where(l[:, None] == 0, 0.0,
                  acc / jnp.where(l == 0, 1.0, l)[:, None])
  o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _pallas_prefill_attention(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                              seg_length, num_segments, *, sm_scale, soft_cap,
                              block_q, pages_per_step, interpret):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  num_tiles = pl.cdiv(num_tokens, block_q)
  padded = num_tiles * block_q
  seq_lens, cum_before = _seq_lens_and_cum(seg_length, num_segments)
  tok_row, tok_pos = _token_rows(cu_q_lens, seq_lens, padded)
  qg = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
  qg = qg.reshape(padded, num_kv_heads, group, head_dim)
  kernel = functools.partial(prefill_attention_kernel, sm_scale=sm_scale,
                             soft_cap=soft_cap, pages_per_step=pages_per_step)
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  tile = pl.BlockSpec((None, block_q), lambda i, h: (i, 0))
  qo_spec = pl.BlockSpec((block_q, None, group, head_dim), lambda i, h: (i, h, 0, 0))
  out = pl.pallas_call(
      kernel,
      grid=(num_tiles, num_kv_heads),
      in_specs=[whole(num_segments), whole(seg_block), whole(seg_start),
                whole(seg_length), whole(cum_before), tile, tile, qo_spec,
                whole(k_pages), whole(v_pages)],
      out_specs=qo_spec,
      out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
      interpret=interpret,
      name="prefill_attention",
  )(num_segments, seg_block, seg_start, seg_length, cum_before,
    tok_row.reshape(num_tiles, block_q), tok_pos.reshape(num_tiles, block_q), qg,
    k_pages, v_pages)
  return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)


# Public wrapper -----------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "impl", "interpret", "block_q",
                     "pages_per_step"))
def prefill_attention(
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
    impl: str = "xla",
    interpret: bool = False,
    block_q: int = DEFAULT_BLOCK_Q,
    pages_per_step: int = DEFAULT_PAGES_PER_STEP,
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
  """Causal attention of ragged new tokens over their rows' segment tables.

  Args:
    q: new tokens of all rows, concatenated (T may include trailing padding).
    k_pages, v_pages: one layer's pages, already holding the new tokens' K/V.
    cu_q_lens: row b owns tokens `cu_q_lens[b] : cu_q_lens[b+1]`; `cu_q_lens[0]`
      must be 0.
    seg_block, seg_start, seg_length, num_segments: segment table covering prefix
      plus new tokens of each row (padded to S entries; padding never read).
    sm_scale, soft_cap: as in `paged_attention`.
    impl: "xla" (CPU default) or "pallas"; "mosaic" raises (not implemented).
    interpret: run the Pallas kernel in interpret mode (CPU).
    block_q: new tokens per Pallas program.
    pages_per_step: segments loaded per online-softmax step ("pallas").
  """
  static_validate_inputs(q, k_pages, v_pages, cu_q_lens, seg_block, seg_start,
                         seg_length, num_segments, sm_scale=sm_scale,
                         soft_cap=soft_cap, impl=impl, block_q=block_q,
                         pages_per_step=pages_per_step)
  sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
  if impl == "xla":
    return _xla_prefill_attention(q, k_pages, v_pages, cu_q_lens, seg_block,
                                  seg_start, seg_length, num_segments,
                                  sm_scale=sm_scale, soft_cap=soft_cap)
  return _pallas_prefill_attention(q, k_pages, v_pages, cu_q_lens, seg_block,
                                   seg_start, seg_length, num_segments,
                                   sm_scale=sm_scale, soft_cap=soft_cap,
                                   block_q=block_q, pages_per_step=pages_per_step,
                                   interpret=interpret)
