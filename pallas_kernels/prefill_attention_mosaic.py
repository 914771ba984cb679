"""Mosaic GPU (Hopper) prefill attention over segment tables (`impl="mosaic"`).

Same contract as `prefill_attention.prefill_attention`, tested against
`prefill_attention.ref_prefill_attention`; built like the decode kernel
(`decode_attention_mosaic`, whose constants it shares):

  * tiles of one row each: `tile_tokens = NC * 64 / padded group` new tokens of a
    row times the GQA group fill the `NC` (`NUM_CONSUMERS` = 2) consumer
    warpgroups' 64-row wgmma tiles, token-major; the consumers share every K/V
    stage. The grid is (tile, kv head) over a static `ceil(T / tile_tokens) + B`
    tiles, unused ones empty; a decode row is a one-token tile, so one launch can
    serve a mixed step;
  * causal cutoff per tile (`prefill_attention.entries_needed`);
  * per tile a 128-lane i32 header gives the row, entry count, first position,
    token count and layer; the producer copies the row's table `[3, chunks, 128]`
    and the query tile, then refills a K/V ring of `BLOCK_KV`-key stages (2-4, as
    fit shared memory beside the table);
  * masked V rows of a stage not made of whole valid pages are zeroed in SMEM by
    consumer 0 (unused slots may hold NaN), which then arrives on `v_masked`;
  * the first stage holds position 0, which every token sees, so every live query
    row has a finite running max from the first stage on;
  * the output tile is written in the query's dtype, scattered back to token order
    by the wrapper.

Shapes it builds for (`mosaic_prefill_problem`): bf16/f16 pages with q in the same
dtype, head_dim 64 or 128, block_size 8-64 dividing 64, GQA group <= 64, a row's
table within shared memory beside two stages. Not yet timed on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import decode_attention_mosaic as _pm

# Constants ------------------------------------------------------------------

BLOCK_ROWS = _pm.BLOCK_ROWS  # wgmma M tile: tile tokens x padded group
BLOCK_KV = _pm.BLOCK_KV  # keys per ring stage
TABLE_LANES = _pm.TABLE_LANES  # segment-table entries per TMA row
MAX_STAGES = _pm.MAX_STAGES
SMEM_BUDGET = _pm.SMEM_BUDGET
HEAD_DIMS = (64, 128)  # the warp-specialized layout, no spill (decode kernel)
NUM_CONSUMERS = 2  # consumer warpgroups of 64 query rows sharing each K/V stage
META_LANES = 128  # the tile header: row, count, first position, tokens, layer
_META_ROW, _META_COUNT, _META_POS, _META_TOKENS, _META_LAYER = range(5)
_DTYPES = (jnp.bfloat16, jnp.float16)
_LOG2E = _pm._LOG2E
_NEG_INF = float("-inf")


def table_chunks(num_seg_slots: int) -> int:
  """128-entry chunks of a row's segment table in shared memory."""
  return max(1, pl.cdiv(num_seg_slots, TABLE_LANES))


def _smem_bytes(head_dim, itemsize, num_stages, chunks, num_consumers):
  table = 3 * chunks * TABLE_LANES * 4
  q = num_consumers * BLOCK_ROWS * head_dim * itemsize  # also the output tiles
  ring = 2 * num_stages * BLOCK_KV * head_dim * itemsize
  probs = num_consumers * BLOCK_ROWS * BLOCK_KV * itemsize
  return META_LANES * 4 + table + q + ring + probs


def num_stages(head_dim: int, dtype, num_seg_slots: int,
               num_consumers: int = NUM_CONSUMERS) -> int:
  """Ring stages (<= `MAX_STAGES`, >= 2) that fit `SMEM_BUDGET` beside the
  table of `num_seg_slots` entries; 0 if two do not."""
  itemsize = jnp.dtype(dtype).itemsize
  chunks = table_chunks(num_seg_slots)
  for stages in range(MAX_STAGES, 1, -1):
    if _smem_bytes(head_dim, itemsize, stages, chunks, num_consumers) <= SMEM_BUDGET:
      return stages
  return 0


def padded_group(group: int) -> int:
  """The GQA group padded to a power of two (a divisor of the 64 rows)."""
  return 1 << max(0, (group - 1).bit_length())


def tile_tokens(group: int, num_consumers: int = NUM_CONSUMERS) -> int:
  """New tokens per tile: 64 query rows per consumer over the padded group."""
  return num_consumers * BLOCK_ROWS // padded_group(group)


def mosaic_prefill_problem(*, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                           num_seg_slots=None, q_dtype=None,
                           num_consumers: int = NUM_CONSUMERS) -> str | None:
  """Why this kernel cannot be built for Hopper at this shape (None if it can).
  `num_seg_slots` (the table width S), when given, must fit shared memory."""
  shape = (f"{num_q_heads}/{num_kv_heads} heads, head_dim {head_dim}, block "
           f"{block_size}, {jnp.dtype(dtype).name}")
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
    return (f"prefill impl='mosaic' takes bf16/f16 pages only (wgmma), got "
            f"{jnp.dtype(dtype).name} ({shape})")
  if q_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(dtype):
    return (f"prefill impl='mosaic' needs q in the pages' dtype, got q "
            f"{jnp.dtype(q_dtype).name} ({shape})")
  if head_dim not in HEAD_DIMS:
    return f"prefill impl='mosaic' needs head_dim in {HEAD_DIMS} ({shape})"
  if block_size > BLOCK_KV or BLOCK_KV % block_size or block_size % 8:
    return f"prefill impl='mosaic' needs block_size in (8, 16, 32, 64) ({shape})"
  if num_q_heads // num_kv_heads > BLOCK_ROWS:
    return (f"prefill impl='mosaic' holds a GQA group of <= {BLOCK_ROWS} query "
            f"heads ({shape})")
  if num_consumers not in (1, 2):
    return f"prefill impl='mosaic' runs 1 or 2 consumer warpgroups, got {num_consumers}"
  if num_seg_slots is not None and not num_stages(head_dim, dtype, num_seg_slots,
                                                  num_consumers):
    return (f"prefill impl='mosaic': a table of {num_seg_slots} entries and two "
            f"ring stages do not fit shared memory ({shape})")
  return None


# Kernel -------------------------------------------------------------------------


def mosaic_prefill_kernel(
    meta_gmem,  # i32[NT, 128]: row, count, first position, tokens, layer
    table_gmem,  # i32[B, 3, C, 128]: block, start, length
    q_gmem,  # [NT, KVH, NC, 64, D] (tile tokens x padded group, token-major)
    k_gmem,  # [L * KVH, num_blocks, bs, D] (layer-major, every layer)
    v_gmem,  # [L * KVH, num_blocks, bs, D]
    o_gmem,  # [NT, KVH, NC, 64, D] normalised output, q's dtype
    *, sm_scale, soft_cap, group_pad, num_stages, chunks, num_kv_heads,
    num_consumers):
  """Program (tile, kv head): causal attention of the tile's query rows over
  its row's entries `[0, count)`. Warpgroup `NC` (the producer) issues every
  copy; warpgroups `0 .. NC-1` (consumers) each own 64 query rows (tokens
  `c * 64 / group_pad ..` of the tile), share every K/V stage and write their
  output tile. Consumer 0 zeroes a stage's masked V rows; the others wait for
  it on `v_masked` before their P V."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  tile = jax.lax.axis_index("tile")
  head = jax.lax.axis_index("head")
  wg = jax.lax.axis_index("wg")
  num_blocks, block_size, head_dim = k_gmem.shape[1:]
  num_pages = BLOCK_KV // block_size
  rows, lanes = BLOCK_ROWS, TABLE_LANES
  dtype = k_gmem.dtype
  wgmma = plgpu.Layout.WGMMA
  as_producer = pl.when(wg == num_consumers)
  as_consumer = pl.when(wg < num_consumers)
  tokens_per_consumer = rows // group_pad

  def program(meta_smem, table_smem, q_all, in_barriers, k_barriers, v_barriers,
              k_free, v_free, v_masked, k_ring, v_ring, p_all):
    @as_producer
    def _():
      plgpu.copy_gmem_to_smem(meta_gmem.at[tile], meta_smem, in_barriers.at[0])

    plgpu.barrier_wait(in_barriers.at[0])
    count = meta_smem[_META_COUNT]
    page_row = meta_smem[_META_LAYER] * num_kv_heads + head
    num_steps = (count + num_pages - 1) // num_pages

    @as_producer
    def _():
      plgpu.copy_gmem_to_smem(table_gmem.at[meta_smem[_META_ROW]], table_smem,
                              in_barriers.at[1])
      for c in range(num_consumers):
        plgpu.copy_gmem_to_smem(q_gmem.at[tile, head, c], q_all.at[c],
                                in_barriers.at[2 + c])

    plgpu.barrier_wait(in_barriers.at[1])

    def entry(r, idx):
      return table_smem[r, idx // lanes, idx % lanes]

    def page(step, p):
      """Block of page `p` of stage `step` (block 0 past the count)."""
      idx = step * num_pages + p
      return jnp.clip(jnp.where(idx < count, entry(0, idx), 0), 0, num_blocks - 1)

    def issue_k(step, slot):
      for p in range(num_pages):
        plgpu.copy_gmem_to_smem(k_gmem.at[page_row, page(step, p)],
                                k_ring.at[slot, pl.ds(p * block_size, block_size)],
                                k_barriers.at[slot * num_pages + p])

    def issue_v(step, slot):
      for p in range(num_pages):
        plgpu.copy_gmem_to_smem(v_gmem.at[page_row, page(step, p)],
                                v_ring.at[slot, pl.ds(p * block_size, block_size)],
                                v_barriers.at[slot * num_pages + p])

    def stage_pages(step, base):
      """Per page of stage `step`: (live, start, end, logical position of its
      first live slot), and the position after the stage; `base` is the
      position of the stage's first key."""
      pages = []
      for p in range(num_pages):
        idx = step * num_pages + p
        live = idx < count
        start = entry(1, idx)
        length = jnp.where(live, entry(2, idx), 0)
        pages.append((live, start, start + length, base))
        base = base + length
      return pages, base

    def key_mask(pages, shape, dim):
      """bool[shape] (WGMMA layout): key `iota(dim)` is a live slot; i32[shape]
      its logical position; whether the stage is made of whole valid pages."""
      key = plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma)
      page_of_key = key // block_size
      slot = key - page_of_key * block_size
      mask, pos, full = None, None, True
      for p, (live, start, end, first) in enumerate(pages):
        here = page_of_key == p
        m = here & (slot >= start) & (slot < end) & live
        kp = jnp.where(here, first + slot - start, 0)
        mask = m if mask is None else mask | m
        pos = kp if pos is None else pos + kp
        full = full & live & (start == 0) & (end == block_size)
      return mask, pos, full

    @as_producer
    def _():
      plgpu.set_max_registers(40, action="decrease")
      for s in range(num_stages):  # prologue: fill the ring
        @pl.when(s < num_steps)
        def _():
          issue_k(s, s)
          issue_v(s, s)

      def refill(step, carry):
        slot = jax.lax.rem(step, num_stages)
        plgpu.barrier_wait(k_free.at[slot])
        issue_k(step, slot)
        plgpu.barrier_wait(v_free.at[slot])
        issue_v(step, slot)
        return carry

      jax.lax.fori_loop(num_stages, jnp.maximum(num_steps, num_stages), refill, 0)

      # Observe every phase of the barriers shared with the consumer (the GPU
      # interpreter checks it when they are deallocated).
      def drain(step, carry):
        slot = jax.lax.rem(step, num_stages)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        return carry

      for c in range(num_consumers):
        plgpu.barrier_wait(in_barriers.at[2 + c])
      jax.lax.fori_loop(jnp.maximum(num_steps - num_stages, 0), num_steps, drain, 0)

    @as_consumer
    def _():
      plgpu.set_max_registers(232, action="increase")
      q_smem, p_smem = q_all.at[wg], p_all.at[wg]
      for c in range(num_consumers):
        @pl.when(wg == c)
        def _():
          plgpu.barrier_wait(in_barriers.at[2 + c])
      # Query row r of consumer c is token c * 64 / group_pad + r // group_pad of
      # the tile; rows past the tile's tokens repeat its last token (finite,
      # discarded by the wrapper).
      q_tok = wg * tokens_per_consumer + plgpu.broadcasted_iota(
          jnp.int32, (rows, BLOCK_KV), 0, layout=wgmma) // group_pad
      q_pos = meta_smem[_META_POS] + jnp.minimum(
          q_tok, jnp.maximum(meta_smem[_META_TOKENS] - 1, 0))

      def body(step, carry):
        acc, m_i, l_i, base = carry
        slot = jax.lax.rem(step, num_stages)
        for p in range(num_pages):
          plgpu.barrier_wait(k_barriers.at[slot * num_pages + p])

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_ring.at[slot].T)
          return acc_ref[...]

        s = pl.run_scoped(compute_qk, plgpu.ACC((rows, BLOCK_KV), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        if soft_cap is None:
          s = s * (sm_scale * _LOG2E)
        else:
          s = (soft_cap * _LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
        pages, next_base = stage_pages(step, base)
        mask, k_pos, full = key_mask(pages, (rows, BLOCK_KV), 1)
        s = jnp.where(mask & (k_pos <= q_pos), s, _NEG_INF)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        probs = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_new = l_i * alpha + probs.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        p_smem[...] = probs.astype(dtype)
        v_slot = v_ring.at[slot]
        for p in range(num_pages):
          plgpu.barrier_wait(v_barriers.at[slot * num_pages + p])

        @pl.when(jnp.logical_not(full) & (wg == 0))
        def _():
          vmask, _, _ = key_mask(pages, (BLOCK_KV, head_dim), 0)
          v = plgpu.load(v_slot, layout=wgmma)
          v_slot[...] = jnp.where(vmask, v, jnp.zeros((), v.dtype))

        plgpu.commit_smem()  # generic-proxy SMEM writes before the wgmma reads
        if num_consumers > 1:  # the others read V once consumer 0 has masked it
          @pl.when(wg == 0)
          def _():
            plgpu.barrier_arrive(v_masked.at[slot])

          @pl.when(wg > 0)
          def _():
            plgpu.barrier_wait(v_masked.at[slot])

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, v_slot)
          return acc_ref[...]

        acc = acc + pl.run_scoped(compute_pv,
                                  plgpu.ACC((rows, head_dim), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_new, next_base

      init = (
          plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), wgmma),
          plgpu.layout_cast(jnp.full((rows,), _NEG_INF, jnp.float32),
                            wgmma.reduce(1)),
          plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), wgmma.reduce(1)),
          jnp.int32(0))
      acc, _, l_i, _ = jax.lax.fori_loop(0, num_steps, body, init)
      safe_l = jnp.where(l_i == 0, 1.0, l_i)  # an empty tile gives 0
      q_smem[...] = (acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0])
                     ).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[tile, head, wg])
      plgpu.wait_smem_to_gmem(0)

  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = lambda shape, dt=dtype, **kw: plgpu.SMEM(shape, dt, **kw)
  num_barriers = num_stages * num_pages
  free = plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages)
  pl.run_scoped(
      program,
      smem((META_LANES,), jnp.int32),
      smem((3, chunks, lanes), jnp.int32),
      smem((num_consumers, rows, head_dim), transforms=tiled),
      plgpu.Barrier(num_arrivals=1, num_barriers=2 + num_consumers),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_barriers),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_barriers),
      free, free,
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
      smem((num_stages, BLOCK_KV, head_dim), transforms=tiled),
      smem((num_stages, BLOCK_KV, head_dim), transforms=tiled),
      smem((num_consumers, rows, BLOCK_KV), transforms=tiled),
      collective_axes="wg")


# Wrapper --------------------------------------------------------------------------


def tile_plan(cu_q_lens, seg_length, num_segments, *, num_tokens: int, group: int,
              num_consumers: int = NUM_CONSUMERS):
  """The static tiling of a ragged batch: `(meta i32[NT, 128], tok i32[NT, tt],
  tok_ok bool[NT, tt], out_index i32[T])`, `tt = tile_tokens(...)`, `NT = ceil(T /
  tt) + B`; `tok[n, i]` is tile n's i-th token (clipped where not `tok_ok`) and
  `out_index[t]` token t's flat (tile, token) slot (NT * tt: padding)."""
  from pallas_kernels import prefill_attention as pf

  batch = seg_length.shape[0]
  tt = tile_tokens(group, num_consumers)
  num_tiles = pl.cdiv(num_tokens, tt) + batch
  seq_lens, cum_before = pf._seq_lens_and_cum(seg_length, num_segments)
  q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
  cu_tiles = jnp.concatenate(
      [jnp.zeros(1, jnp.int32), jnp.cumsum(pl.cdiv(q_lens, tt)).astype(jnp.int32)])
  idx = jnp.arange(num_tiles, dtype=jnp.int32)
  used = idx < cu_tiles[batch]
  row = jnp.clip(jnp.searchsorted(cu_tiles, idx, side="right").astype(jnp.int32) - 1,
                 0, batch - 1)
  first = cu_q_lens[row] + (idx - cu_tiles[row]) * tt
  ntok = jnp.where(used, jnp.clip(cu_q_lens[row + 1] - first, 0, tt), 0)
  pos0 = seq_lens[row] - q_lens[row] + (first - cu_q_lens[row])
  count = pf.entries_needed(cum_before, num_segments, jnp.where(used, row, batch),
                            jnp.where(used & (ntok > 0), pos0 + ntok - 1, -1))
  meta = jnp.zeros((num_tiles, META_LANES), jnp.int32)
  for lane, value in ((_META_ROW, row), (_META_COUNT, count), (_META_POS, pos0),
                      (_META_TOKENS, ntok)):
    meta = meta.at[:, lane].set(value)
  i = jnp.arange(tt, dtype=jnp.int32)
  tok_ok = i[None, :] < ntok[:, None]
  tok = jnp.clip(first[:, None] + i[None, :], 0, num_tokens - 1)
  t_row, _ = pf._token_rows(cu_q_lens, seq_lens, num_tokens)
  safe = jnp.minimum(t_row, batch - 1)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  local = t - cu_q_lens[safe]
  out_index = (cu_tiles[safe] + local // tt) * tt + local % tt
  out_index = jnp.where(t_row < batch, out_index, num_tiles * tt)
  return meta, tok, tok_ok, out_index


def pack_row_tables(seg_block, seg_start, seg_length):
  """`i32[B, 3, C, 128]`: each row's entries as rows block, start, length,
  padded to `C = table_chunks(S)` chunks of 128 lanes."""
  batch, num_seg_slots = seg_block.shape
  chunks = table_chunks(num_seg_slots)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, chunks * TABLE_LANES - num_seg_slots)))
  table = jnp.stack([pad(seg_block), pad(seg_start), pad(seg_length)], axis=1)
  return table.reshape(batch, 3, chunks, TABLE_LANES)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "num_consumers"))
def mosaic_prefill_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [L, num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # same shape as k_pages
    layer: jax.Array,  # i32[]
    cu_q_lens: jax.Array,  # i32[B+1]
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret=None,
    num_consumers: int = NUM_CONSUMERS,
) -> jax.Array:  # [T, num_q_heads, head_dim], q.dtype
  """Prefill attention with the Mosaic GPU kernel on the stacked pool (inputs
  validated by the caller; `mosaic_prefill_problem` raised as ValueError).

  interpret: None (compile for Hopper), True (`InterpretGPUParams(
  detect_races=True)`) or a `plgpu.InterpretGPUParams`.
  num_consumers: consumer warpgroups (1 or 2) of 64 query rows each per
  program, sharing its K/V stages."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  from pallas_kernels import lowering

  num_tokens, num_q_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  num_seg_slots = seg_block.shape[1]
  problem = mosaic_prefill_problem(
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, dtype=k_pages.dtype, num_seg_slots=num_seg_slots,
      q_dtype=q.dtype, num_consumers=num_consumers)
  if problem is not None:
    raise ValueError(problem)
  if interpret is True:
    interpret = lowering.gpu_interpret_params(detect_races=True)
  elif interpret is False:
    interpret = None
  group_pad = padded_group(group)
  tt = tile_tokens(group, num_consumers)
  meta, tok, tok_ok, out_index = tile_plan(
      cu_q_lens, seg_length, num_segments, num_tokens=num_tokens, group=group,
      num_consumers=num_consumers)
  meta = meta.at[:, _META_LAYER].set(jnp.asarray(layer, jnp.int32))
  num_tiles = meta.shape[0]
  table = pack_row_tables(seg_block, seg_start, seg_length)
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok]  # [NT, tt, KVH, G, D]
  qg = jnp.where(tok_ok[:, :, None, None, None], qg, jnp.zeros((), q.dtype))
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, group_pad - group), (0, 0)))
  qg = jnp.swapaxes(qg, 1, 2).reshape(num_tiles, num_kv_heads, num_consumers,
                                      BLOCK_ROWS, head_dim)
  k_rows = k_pages.reshape(num_layers * num_kv_heads, num_blocks, block_size, head_dim)
  v_rows = v_pages.reshape(num_layers * num_kv_heads, num_blocks, block_size, head_dim)
  kernel = functools.partial(
      mosaic_prefill_kernel, sm_scale=sm_scale, soft_cap=soft_cap, group_pad=group_pad,
      num_stages=num_stages(head_dim, k_pages.dtype, num_seg_slots, num_consumers),
      chunks=table.shape[2], num_kv_heads=num_kv_heads, num_consumers=num_consumers)
  o = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(qg.shape, q.dtype),
      grid=(num_tiles, num_kv_heads),
      grid_names=("tile", "head"),
      num_threads=num_consumers + 1,
      thread_name="wg",
      interpret=interpret,
  )(meta, table, qg, k_rows, v_rows)
  o = o.reshape(num_tiles, num_kv_heads, tt, group_pad, head_dim)[:, :, :, :group]
  o = jnp.swapaxes(o, 1, 2).reshape(num_tiles * tt, num_q_heads, head_dim)
  o = jnp.concatenate([o, jnp.zeros((1, num_q_heads, head_dim), o.dtype)])
  return o[out_index]
