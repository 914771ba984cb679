"""Mosaic GPU (Hopper) decode attention over segment tables (`impl="mosaic"`).

Same contract as `paged_attention.paged_attention` (see that module for the segment
table format); `paged_attention.ref_paged_attention` is the reference it is tested
against.

Kernel layout (`plgpu.kernel`, grid (row, kv_head), named ("row", "head")):
  * one program per (sequence row, kv head); it holds the GQA group of query heads
    (`num_q_heads / num_kv_heads` rows) of that kv head;
  * the row's segment table (block, start, length, plus num_segments) is TMA-copied
    GMEM -> SMEM together with the program's queries, and waited on before any
    scalar is read;
  * the row's valid segments are walked `pages_per_step` at a time ("a stage"): each
    stage's pages of K and V (`[pages_per_step, block_size, head_dim]`) stream through
    a `_NUM_STAGES`-deep SMEM ring filled by TMA copies, one barrier per (slot, page,
    K|V). Stages `0.._NUM_STAGES-1` are issued up front; after computing on stage i
    the program refills its slot with stage `i + _NUM_STAGES`, so the copies of the
    next stages overlap the math of the current one. Before a refill,
    `plgpu.commit_smem()` (proxy fence) orders the kernel's generic-proxy reads of
    the slot before the TMA (async-proxy) write; without it the race detector
    reports a race (see the negative-control test). A copy is issued and its
    barrier waited under the same condition (stage < number of stages), so barrier
    phases stay in step;
  * padding entries of a partly filled last stage load block 0 (never a garbage
    index) and are masked; slots outside `[start, start + length)` are masked; V
    rows of masked slots are replaced by 0 with `where` (not a multiply) so a NaN
    in an unused slot cannot leak through `p @ v`;
  * online softmax in float32 (running max, denominator, accumulator); a row with
    no segment writes zeros; the normalised result goes registers -> SMEM -> GMEM
    by a TMA store (`commit_smem` before it, `wait_smem_to_gmem(0)` at the end).

Not done here (compared with the "pallas" path): no split-K (`num_splits` is
ignored, one program walks all segments of its row), so a single very long row is
walked by `num_kv_heads` programs only.

Interpreter notes (JAX 0.12, `plgpu.InterpretGPUParams(detect_races=True)` on CPU):
  * `pl.program_id` is always 0 there, so the program reads its coordinates with
    `lax.axis_index` on the named grid axes;
  * TMA copies, barrier waits, the proxy fence, dynamic ring-slot indexing and the
    TMA store all run and are race-checked (the interpreter tracks generic and
    async-proxy SMEM clocks separately); the tests assert zero races;
  * nothing was faked or replaced by plain copies: every K/V page goes through the
    TMA/barrier ring;
  * the math (a `[group, head_dim] x [head_dim, pages*block_size]` dot, exp,
    reductions) is evaluated as plain jnp on values loaded from SMEM. The interpreter
    does not check that these ops lower on Hopper: a real Mosaic GPU compile may
    reject the small dots (WGMMA wants 64-row tiles) or the layouts of the
    reductions; that, and real-hardware timing, is what a GPU run must check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Constants ------------------------------------------------------------------

DEFAULT_PAGES_PER_STEP = 2  # segments (hence pages) per ring stage
_NUM_STAGES = 2  # SMEM ring depth (stages in flight)
_TABLE_ALIGN = 4  # i32 table rows padded to 16 bytes for TMA
_TABLE_ROWS = 4  # block, start, length, [num_segments, 0, ...]
_NEG_INF = float("-inf")


# Kernel -------------------------------------------------------------------------


def _soft_cap(logits, soft_cap):
  if soft_cap is None:
    return logits
  return soft_cap * jnp.tanh(logits / soft_cap)


def mosaic_paged_attention_kernel(
    table_gmem,  # i32[B, 4, S_pad]: rows block, start, length; [b, 3, 0] = count
    q_gmem,  # [B, KVH, G, D]
    k_gmem,  # [KVH, num_blocks, bs, D]
    v_gmem,  # [KVH, num_blocks, bs, D]
    out_gmem,  # [B, KVH, G, D] (q dtype)
    table_smem,  # i32[4, S_pad]
    q_smem,  # [G, D]
    k_ring,  # [stages, P, bs, D]
    v_ring,  # [stages, P, bs, D]
    out_smem,  # [G, D]
    in_barriers,  # 2 barriers: table, q
    k_barriers,  # stages * P barriers
    v_barriers,  # stages * P barriers
    *, sm_scale, soft_cap, pages_per_step):
  """Program (row b, kv head h): out[b, h] = softmax(q[b, h] K^T) V over b's segments."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  row = jax.lax.axis_index("row")
  head = jax.lax.axis_index("head")
  num_blocks = k_gmem.shape[1]
  num_stages, _, block_size, head_dim = k_ring.shape
  group = q_smem.shape[0]
  num_seg_slots = table_smem.shape[1]
  num_pages = pages_per_step

  plgpu.copy_gmem_to_smem(table_gmem.at[row], table_smem, in_barriers.at[0])
  plgpu.copy_gmem_to_smem(q_gmem.at[row, head], q_smem, in_barriers.at[1])
  plgpu.barrier_wait(in_barriers.at[0])
  plgpu.barrier_wait(in_barriers.at[1])
  num_segments = jnp.clip(table_smem[3, 0], 0, num_seg_slots)
  num_steps = (num_segments + num_pages - 1) // num_pages

  def segment_block(idx):
    """Block of segment `idx` (block 0 for padding entries, clamped in range)."""
    safe = jnp.minimum(idx, num_seg_slots - 1)
    blk = jnp.where(idx < num_segments, table_smem[0, safe], 0)
    return jnp.clip(blk, 0, num_blocks - 1)

  def issue_stage(step, slot):
    """TMA-loads the pages of stage `step` into ring slot `slot`."""
    for p in range(num_pages):
      blk = segment_block(step * num_pages + p)
      plgpu.copy_gmem_to_smem(k_gmem.at[head, blk], k_ring.at[slot, p],
                              k_barriers.at[slot * num_pages + p])
      plgpu.copy_gmem_to_smem(v_gmem.at[head, blk], v_ring.at[slot, p],
                              v_barriers.at[slot * num_pages + p])

  for s in range(num_stages):  # prologue: fill the ring
    @pl.when(s < num_steps)
    def _():
      issue_stage(s, s)

  q = q_smem[...].astype(jnp.float32) * sm_scale  # [G, D]
  j = jax.lax.broadcasted_iota(jnp.int32, (block_size,), 0)

  def body(step, carry):
    m_prev, l_prev, acc_prev = carry
    slot = step % num_stages
    masks = []
    for p in range(num_pages):
      idx = step * num_pages + p
      safe = jnp.minimum(idx, num_seg_slots - 1)
      start, length = table_smem[1, safe], table_smem[2, safe]
      masks.append((idx < num_segments) & (j >= start) & (j < start + length))
      plgpu.barrier_wait(k_barriers.at[slot * num_pages + p])
      plgpu.barrier_wait(v_barriers.at[slot * num_pages + p])
    mask = jnp.concatenate(masks)  # [P*bs]
    k = k_ring[slot].astype(jnp.float32).reshape(num_pages * block_size, head_dim)
    v = v_ring[slot].astype(jnp.float32).reshape(num_pages * block_size, head_dim)
    v = jnp.where(mask[:, None], v, 0.0)
    logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [G, P*bs]
    logits = _soft_cap(logits, soft_cap)
    logits = jnp.where(mask[None, :], logits, _NEG_INF)
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1))
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    probs = jnp.exp(logits - m_safe[:, None])
    alpha = jnp.exp(m_prev - m_safe)
    l_new = alpha * l_prev + jnp.sum(probs, axis=1)
    acc_new = alpha[:, None] * acc_prev + jnp.dot(
        probs, v, preferred_element_type=jnp.float32)

    # The slot's contents are in registers now: refill it with a later stage.
    # `commit_smem` (a proxy fence) orders this thread's generic-proxy reads of
    # the slot before the TMA (async-proxy) write that overwrites it.
    @pl.when(step + num_stages < num_steps)
    def _():
      plgpu.commit_smem()
      issue_stage(step + num_stages, slot)

    return m_new, l_new, acc_new

  init = (jnp.full((group,), _NEG_INF, jnp.float32),
          jnp.zeros((group,), jnp.float32),
          jnp.zeros((group, head_dim), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, num_steps, body, init)
  # `l == 0` (not `> 0`): a NaN that slipped in must propagate, not vanish.
  safe_l = jnp.where(l == 0, 1.0, l)
  out = jnp.where(l[:, None] == 0, 0.0, acc / safe_l[:, None])
  out_smem[...] = out.astype(out_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[row, head])
  plgpu.wait_smem_to_gmem(0)


# Wrapper --------------------------------------------------------------------------


def pack_segment_table(seg_block, seg_start, seg_length, num_segments):
  """`i32[B, 4, S_pad]` table (rows block, start, length; `[b, 3, 0]` = count),
  `S_pad` = S rounded up to 16 bytes so each row is one TMA copy."""
  batch, num_seg_slots = seg_block.shape
  padded = pl.cdiv(num_seg_slots, _TABLE_ALIGN) * _TABLE_ALIGN
  pad = lambda a: jnp.pad(a, ((0, 0), (0, padded - num_seg_slots)))
  count = jnp.zeros((batch, padded), jnp.int32).at[:, 0].set(num_segments)
  return jnp.stack([pad(seg_block), pad(seg_start), pad(seg_length), count], axis=1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "pages_per_step"))
def mosaic_paged_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret=None,
    pages_per_step: int = DEFAULT_PAGES_PER_STEP,
) -> jax.Array:  # [B, num_q_heads, head_dim], q.dtype
  """Decode attention with the Mosaic GPU kernel (inputs validated by the caller,
  `paged_attention.static_validate_inputs`).

  Args:
    sm_scale: logits scale (already resolved, not None).
    soft_cap: optional tanh cap applied after scaling.
    interpret: None (compile for Hopper), True (`InterpretGPUParams(
      detect_races=True)`) or a `plgpu.InterpretGPUParams`.
    pages_per_step: segments (pages) per ring stage.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  if interpret is True:
    interpret = plgpu.InterpretGPUParams(detect_races=True)
  elif interpret is False:
    interpret = None
  if not isinstance(pages_per_step, int) or pages_per_step < 1:
    raise ValueError(f"pages_per_step must be an int >= 1, got {pages_per_step!r}")
  table = pack_segment_table(seg_block, seg_start, seg_length, num_segments)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  ring = (_NUM_STAGES, pages_per_step, block_size, head_dim)
  kernel = functools.partial(mosaic_paged_attention_kernel, sm_scale=sm_scale,
                             soft_cap=soft_cap, pages_per_step=pages_per_step)
  out = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(qg.shape, q.dtype),
      grid=(batch, num_kv_heads),
      grid_names=("row", "head"),
      scratch_types=[
          plgpu.SMEM(table.shape[1:], jnp.int32),
          plgpu.SMEM((group, head_dim), q.dtype),
          plgpu.SMEM(ring, k_pages.dtype),
          plgpu.SMEM(ring, v_pages.dtype),
          plgpu.SMEM((group, head_dim), q.dtype),
          plgpu.Barrier(num_arrivals=1, num_barriers=2),
          plgpu.Barrier(num_arrivals=1,
                        num_barriers=_NUM_STAGES * pages_per_step),
          plgpu.Barrier(num_arrivals=1,
                        num_barriers=_NUM_STAGES * pages_per_step),
      ],
      interpret=interpret,
  )(table, qg, k_pages, v_pages)
  return out.reshape(batch, num_q_heads, head_dim)
