"""Mosaic GPU (Hopper) decode attention over segment tables (`impl="mosaic"`).

Same contract as `decode_attention.decode_attention`; tested against
`decode_attention.ref_decode_attention`. Written in the idioms of JAX's
`ops/gpu/attention_mgpu.py`:

  * grid (row, kv head, split): split-K over the row's segment entries so one long
    row keeps every SM busy; a jnp pass merges the splits by log2-sum-exp2;
  * the GQA group's queries (1-64 rows) are padded to the 64-row wgmma tile
    (`BLOCK_ROWS`): decode stays memory-bound with the padding;
  * a ring stage holds 64 or 128 keys (`STAGE_KEYS`; one TMA copy and barrier per
    page); 2-4 stages in flight, as many as fit shared memory;
  * fp8 pages (e4m3fn, e5m2; head_dim <= 128) are upcast per stage into f16 stage
    buffers in shared memory and both wgmmas run in f16 (exact for bf16 queries of
    magnitude 6.1e-5 to 65,504; larger ones overflow). The pool stores fp8 without
    scales, so none are applied;
  * S = Q K^T and P V are wgmmas on SMEM operands (P goes registers -> SMEM: the GPU
    interpreter runs only SMEM operands); softmax in exp2 with log2(e) in the scale;
  * masked slots of V may hold anything (NaN): a stage not made of whole valid pages
    has its masked V rows zeroed in SMEM before P V, since 0 * NaN would leak;
  * a split's segment table is one TMA copy of `i32[4, chunks, 128]` (block, start,
    length, and a row with the count and the layer); at most `MAX_TABLE_CHUNKS * 128`
    entries per split (the wrapper raises the split count to fit);
  * pages are the stacked pool viewed as `[num_layers * num_kv_heads, num_blocks,
    block_size, head_dim]` (a bitcast, no copy), read at row `layer * num_kv_heads +
    head`;
  * head_dim <= 128: warp specialized (a producer warpgroup issues the copies, the
    consumer does the math); head_dim 256: two consumer warpgroups split the head dim
    so no thread holds more than a 64 x 128 f32 accumulator (one spilled).

Shapes it builds for (`mosaic_problem`): bf16/f16, head_dim a multiple of 64 up to
256 (fp8: 64 and 128), block_size 8-64 dividing 64, GQA group <= 64. Checked in the
GPU interpreter with race detection against the float64 reference with NaN in every
unused slot (tests/kernels/test_mosaic_attention.py) and compiled for sm_90a without
spills in the compile tier; H200 timings in docs/records/gpu_check/.

Interpreter (CPU): `pl.program_id` is always 0 there, so programs read
`lax.axis_index`; each warpgroup's barrier waits block an XLA:CPU thread, so call
`lowering.reserve_cpu_threads_for_gpu_interpreter()` before JAX's CPU client exists.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Constants ------------------------------------------------------------------

BLOCK_ROWS = 64  # wgmma M tile: the GQA group's queries padded to 64 rows
BLOCK_KV = 64  # keys per ring stage, fewest (the S tile's N)
MAX_BLOCK_KV = 128  # keys per ring stage, most (S: 64 f32 registers a thread)
STAGE_KEYS = (BLOCK_KV, MAX_BLOCK_KV)  # the stage widths it builds
# A stage's K bytes that `default_pages_per_stage` aims for: what one 64-key
# stage of head_dim 128 bf16 moves (the shape that ran at copy bandwidth).
TARGET_STAGE_BYTES = BLOCK_KV * 128 * 2
# TMA copies (and barriers) per operand and stage: with `MAX_STAGES` stages,
# 32 barriers, the most Mosaic GPU allocates in one group.
MAX_PAGES_PER_STAGE = 8
# f32 columns a consumer warpgroup holds, S tile (keys) plus accumulator
# (its head-dim columns): 64 + 128 and 128 + 64 compile without spills for
# sm_90a (232 registers), 128 + 128 spills 320 B (compile tier).
MAX_F32_COLUMNS = 192
TABLE_LANES = 128  # segment-table entries per TMA row (box dims <= 256)
MAX_TABLE_CHUNKS = 8  # table rows per split: <= 1,024 segment entries
MAX_STAGES = 4
SMEM_BUDGET = 220 * 1024  # of Hopper's 227 KiB per block (barriers, slack)
DEFAULT_PAGES_PER_STEP = 4  # = BLOCK_KV / 16
_DTYPES = (jnp.bfloat16, jnp.float16)
# 8-bit pages, staged: each ring stage is upcast in shared memory to
# `FP8_COMPUTE_DTYPE` (exact for both formats) before the wgmma reads it.
# f16, not bf16: the ptxas of CUDA 12.9 (PTX ISA 8.8) converts e4m3/e5m2 pairs
# to f16 only (`cvt.rn.f16x2.e4m3x2`); bf16 needs ISA 9.2.
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FP8_COMPUTE_DTYPE = jnp.float16
_LOG2E = math.log2(math.e)
_NEG_INF = float("-inf")


def _smem_bytes(head_dim, itemsize, num_stages, *, warp_specialized,
                block_kv=BLOCK_KV):
  """Shared memory of the kernel for pages of `itemsize` bytes (1: fp8 pages,
  whose K and V stage buffers of 16-bit values come on top of the ring)."""
  table = 4 * MAX_TABLE_CHUNKS * TABLE_LANES * 4
  q = BLOCK_ROWS * head_dim * 2
  ring = 2 * num_stages * block_kv * head_dim * itemsize
  if itemsize == 1:
    ring += 2 * block_kv * head_dim * 2
  probs = BLOCK_ROWS * block_kv * 2
  out = BLOCK_ROWS * head_dim * 4
  if warp_specialized:  # one collective scope: nothing shares memory
    return table + q + BLOCK_ROWS * 4 + ring + probs + out
  # Two column halves: a P buffer each; ring + P share memory with the output.
  return table + q + BLOCK_ROWS * 4 + max(ring + 2 * probs, out)


def kernel_config(head_dim: int, dtype, block_kv: int = BLOCK_KV) -> tuple[bool, int]:
  """(warp specialized, ring stages) for this head_dim and `block_kv`-key stages: a
  producer warpgroup with the deepest ring (2..`MAX_STAGES`) within `SMEM_BUDGET`
  when one fits, else two warpgroups splitting the head dim; (False, 0) if none."""
  itemsize = jnp.dtype(dtype).itemsize
  for ws in (True, False):
    if not ws and (head_dim % 128 or itemsize == 1):
      continue  # halves of whole 64-column swizzled tiles; fp8: one consumer
    # fp8 too: at most `MAX_STAGES` (7 and 6 stages of fp8 at head_dim 128
    # spilled 212 and 124 B for sm_90a at any register budget, 4 did not).
    for stages in range(MAX_STAGES, 1, -1):
      if _smem_bytes(head_dim, itemsize, stages, warp_specialized=ws,
                     block_kv=block_kv) <= SMEM_BUDGET:
        return ws, stages
  return False, 0


def _fits_registers(head_dim, dtype, block_kv) -> bool:
  """Whether a consumer warpgroup's S tile and accumulator columns stay within
  `MAX_F32_COLUMNS` (the head dim split in halves where it is not warp
  specialized)."""
  warp_specialized, _ = kernel_config(head_dim, dtype, block_kv)
  cols = head_dim if warp_specialized else head_dim // 2
  return block_kv + cols <= MAX_F32_COLUMNS


def default_pages_per_stage(*, head_dim: int, block_size: int, dtype) -> int:
  """Pages per ring stage for `pages_per_step=None`: the widest stage in
  `STAGE_KEYS` whose K bytes stay within `TARGET_STAGE_BYTES`, within
  `MAX_PAGES_PER_STAGE` pages, keeping a warp-specialized ring of >= 2 stages
  (128 keys at head_dim 64, else 64: a stage's fixed costs do not shrink with the
  head dim, so narrow rows take wider stages)."""
  row_bytes = head_dim * jnp.dtype(dtype).itemsize
  keys = BLOCK_KV
  for wide in STAGE_KEYS[1:]:
    warp_specialized, stages = kernel_config(head_dim, dtype, wide)
    if (wide * row_bytes <= TARGET_STAGE_BYTES and warp_specialized and stages
        and wide // block_size <= MAX_PAGES_PER_STAGE
        and _fits_registers(head_dim, dtype, wide)):
      keys = wide
  return max(1, keys // block_size)


def mosaic_problem(*, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                   pages_per_step=None) -> str | None:
  """Why this kernel cannot be built for Hopper at this shape, or None; the wrapper
  raises it on every platform (interpret mode runs only what lowers)."""
  shape = (f"{num_q_heads}/{num_kv_heads} heads, head_dim {head_dim}, block "
           f"{block_size}, {jnp.dtype(dtype).name}")
  fp8 = jnp.dtype(dtype) in [jnp.dtype(d) for d in _FP8_DTYPES]
  if not fp8 and jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
    return (f"impl='mosaic' takes bf16/f16 or fp8 (e4m3fn, e5m2) pages only "
            f"(wgmma), got {jnp.dtype(dtype).name}; use impl='pallas' or 'xla' "
            f"({shape})")
  if fp8 and head_dim > 128:
    return (f"impl='mosaic' stages fp8 pages for head_dim <= 128 only (one "
            f"consumer warpgroup) ({shape})")
  if head_dim % 64 or head_dim > 256:
    return (f"impl='mosaic' needs head_dim a multiple of 64 up to 256 (128-byte "
            f"swizzled wgmma tiles) ({shape})")
  if block_size > BLOCK_KV or BLOCK_KV % block_size or block_size % 8:
    return (f"impl='mosaic' needs block_size in (8, 16, 32, 64) ({shape})")
  if pages_per_step is not None:
    ok = [keys // block_size for keys in STAGE_KEYS
          if keys // block_size <= MAX_PAGES_PER_STAGE]
    if pages_per_step not in ok:
      return (f"impl='mosaic' stages {' or '.join(map(str, STAGE_KEYS))} keys in "
              f"<= {MAX_PAGES_PER_STAGE} pages: pages_per_step must be None or "
              f"one of {ok}, got {pages_per_step} ({shape})")
    keys = pages_per_step * block_size
    if keys > BLOCK_KV and not _fits_registers(head_dim, dtype, keys):
      return (f"impl='mosaic': {keys}-key stages hold {keys} S columns and the "
              f"accumulator's {head_dim}, more than {MAX_F32_COLUMNS} f32 columns "
              f"a thread group keeps in registers ({shape})")
    if not kernel_config(head_dim, dtype, keys)[1]:
      return (f"impl='mosaic': a ring of {keys}-key stages does not fit shared "
              f"memory ({shape})")
  if num_q_heads // num_kv_heads > BLOCK_ROWS:
    return (f"impl='mosaic' holds a GQA group of <= {BLOCK_ROWS} query heads "
            f"({shape})")
  if not kernel_config(head_dim, dtype)[1]:
    return f"impl='mosaic': the ring does not fit shared memory ({shape})"
  return None


def mosaic_default_caveat(*, head_dim, dtype) -> str | None:
  """Why the default path (`impl=None`) should skip this kernel at a shape it builds
  for, or None (explicit `impl="mosaic"` still runs it): head_dim 192 spills
  registers on sm_90a, and fp8 pages have not been timed against the Triton kernel
  on a GPU."""
  if head_dim == 192:
    return (f"impl='mosaic' at head_dim {head_dim} spills registers when compiled for "
            f"sm_90a (compile tier); the default path skips it")
  if jnp.dtype(dtype).itemsize == 1:
    return (f"impl='mosaic' with fp8 pages ({jnp.dtype(dtype).name}) is untimed on a "
            f"GPU; the default path keeps impl='pallas' for fp8 until the gpu_check "
            f"fp8 rows compare them")
  return None


# Kernel -------------------------------------------------------------------------


def mosaic_decode_attention_kernel(
    table_gmem,  # i32[B, NS, 4, C, 128]: block, start, length; [.., 3, 0, :2] count, layer
    q_gmem,  # [B, KVH, 64, D] (group rows, zero padded)
    k_gmem,  # [L * KVH, num_blocks, bs, D] (layer-major, every layer)
    v_gmem,  # [L * KVH, num_blocks, bs, D]
    o_gmem,  # f32[B, KVH, NS, H, 64, D / H] normalised output of each split (H column halves)
    lse_gmem,  # f32[B, KVH, NS, 64] log2-sum-exp2 of each split (-inf: empty)
    *, sm_scale, soft_cap, pages_per_step, num_stages, chunks,
    warp_specialized, num_kv_heads):
  """Program (row, kv head, split): attention of the padded group over the split's
  segments, written as a normalised tile plus its LSE.

  `warp_specialized`: warpgroup 1 issues every copy, refilling a ring slot once
  warpgroup 0 (the math) arrives on its `k_free` / `v_free` barrier. Otherwise both
  compute S and softmax, each P V for its half of the head dim (`H` = 2), and
  warpgroup 0 issues the copies once both arrived on a slot's `free` barrier.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  row = jax.lax.axis_index("row")
  head = jax.lax.axis_index("head")
  split = jax.lax.axis_index("split")
  wg = jax.lax.axis_index("wg")
  num_blocks, block_size, head_dim = k_gmem.shape[1:]
  num_pages, rows, lanes = pages_per_step, BLOCK_ROWS, TABLE_LANES
  block_kv = num_pages * block_size  # keys per ring stage
  num_halves, cols = o_gmem.shape[3], o_gmem.shape[5]  # cols = head_dim / halves
  dtype = q_gmem.dtype  # of both wgmmas' operands
  staged = k_gmem.dtype != dtype  # fp8 pages: upcast a stage to `dtype` in SMEM
  wgmma = plgpu.Layout.WGMMA
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  # fp8 ring: tiles of 64 columns (64 bytes, swizzled), as the 16-bit stage
  # buffers, so that both are read and written 64 columns at a time.
  ring_tiled = ((plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
                if staged else tiled)

  def upcast(src, dst):
    """dst[...] = src (fp8 -> `dtype`), 64 columns at a time (half the live
    registers of a 128-column tile: the accumulator is live meanwhile)."""
    for c in range(src.shape[-1] // 64):
      part = pl.ds(c * 64, 64)
      dst.at[:, part][...] = plgpu.load(src.at[:, part], layout=wgmma).astype(dtype)
  if warp_specialized:
    as_producer, as_consumer = pl.when(wg == 1), pl.when(wg == 0)
    half = 0  # the consumer owns every column
  else:  # warpgroup 0 issues the copies; both compute
    as_producer, as_consumer = pl.when(wg == 0), lambda f: f()
    half = wg

  def store_output(o_smem, lse_smem, acc, m_i, l_i):
    """Normalised tile (this warpgroup's columns) and its LSE, registers ->
    SMEM -> GMEM (TMA)."""
    empty = l_i == 0  # a split with no segment
    safe_l = jnp.where(empty, 1.0, l_i)
    o_smem.at[half][...] = acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0])

    @pl.when(wg == 0)  # both hold the same LSE
    def _():
      lse_smem[...] = jnp.where(empty, _NEG_INF, m_i + jnp.log2(safe_l))

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[half], o_gmem.at[row, head, split, half])

    @pl.when(wg == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[row, head, split])

    plgpu.wait_smem_to_gmem(0)

  def program(table_smem, q_smem, lse_smem, in_barriers, k_barriers, v_barriers,
              k_free, v_free, k_ring, v_ring, p_smem, o_smem, k_stage=None,
              v_stage=None):
    """The program over its buffers (`o_smem` None: shares memory with the ring;
    `v_free` None: `k_free` frees both; `k_stage`, `v_stage`: an fp8 stage in f16)."""
    @as_producer
    def _():
      plgpu.copy_gmem_to_smem(table_gmem.at[row, split], table_smem,
                              in_barriers.at[0])
      plgpu.copy_gmem_to_smem(q_gmem.at[row, head], q_smem, in_barriers.at[1])

    plgpu.barrier_wait(in_barriers.at[0])
    count = table_smem[3, 0, 0]  # valid entries of this split
    page_row = table_smem[3, 0, 1] * num_kv_heads + head  # layer-major row
    num_steps = (count + num_pages - 1) // num_pages

    def entry(r, idx):
      return table_smem[r, idx // lanes, idx % lanes]

    def page(step, p):
      """Block of page `p` of stage `step` (block 0 for padding entries)."""
      idx = step * num_pages + p
      return jnp.clip(jnp.where(idx < count, entry(0, idx), 0), 0, num_blocks - 1)

    def issue_k(step, slot):
      for p in range(num_pages):
        plgpu.copy_gmem_to_smem(k_gmem.at[page_row, page(step, p)],
                                k_ring.at[slot, pl.ds(p * block_size, block_size)],
                                k_barriers.at[slot * num_pages + p])

    def issue_v(step, slot):
      """Each column half of each page is its own copy and barrier."""
      for h in range(num_halves):
        for p in range(num_pages):
          src = v_gmem.at[page_row, page(step, p)]
          if num_halves > 1:
            src = src.at[:, pl.ds(h * cols, cols)]
          plgpu.copy_gmem_to_smem(
              src, v_ring.at[slot, h, pl.ds(p * block_size, block_size)],
              v_barriers.at[(slot * num_halves + h) * num_pages + p])

    def issue_stage(step, slot):
      issue_k(step, slot)
      issue_v(step, slot)

    def page_mask(step, shape, dim):
      """bool[shape] in the WGMMA layout: is key `iota(dim)` of stage `step` a
      live slot; and whether the stage is made of whole valid pages."""
      key = plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma)
      page_of_key = key // block_size
      slot = key - page_of_key * block_size
      mask, full = None, True
      for p in range(num_pages):
        idx = step * num_pages + p
        live = idx < count
        start = entry(1, idx)
        end = start + entry(2, idx)
        m = (page_of_key == p) & (slot >= start) & (slot < end) & live
        mask = m if mask is None else mask | m
        full = full & live & (start == 0) & (end == block_size)
      return mask, full

    @as_producer
    def _():
      if warp_specialized:
        plgpu.set_max_registers(40, action="decrease")
      for s in range(num_stages):  # prologue: fill the ring
        @pl.when(s < num_steps)
        def _():
          issue_stage(s, s)

      if warp_specialized:
        def refill(step, carry):
          slot = jax.lax.rem(step, num_stages)
          plgpu.barrier_wait(k_free.at[slot])
          issue_k(step, slot)
          plgpu.barrier_wait(v_free.at[slot])
          issue_v(step, slot)
          return carry

        jax.lax.fori_loop(num_stages, jnp.maximum(num_steps, num_stages),
                          refill, 0)

        # Observe every phase of the barriers this warpgroup shares (the GPU
        # interpreter of JAX 0.11.2 checks it when they are deallocated): the
        # query copy, and the last consumptions no refill waited for.
        def drain(step, carry):
          slot = jax.lax.rem(step, num_stages)
          plgpu.barrier_wait(k_free.at[slot])
          plgpu.barrier_wait(v_free.at[slot])
          return carry

        plgpu.barrier_wait(in_barriers.at[1])
        jax.lax.fori_loop(jnp.maximum(num_steps - num_stages, 0), num_steps,
                          drain, 0)

    def body(step, carry):
      acc, m_i, l_i = carry
      slot = jax.lax.rem(step, num_stages)
      for p in range(num_pages):
        plgpu.barrier_wait(k_barriers.at[slot * num_pages + p])

      k_slot = k_ring.at[slot]
      if staged:
        # Upcast the stage (exact) and fence. The fp8 slot is freed after the
        # wgmma, as a 16-bit one is: freeing it here, before the V waits, trips
        # the GPU interpreter's barrier-phase check (JAX 0.12).
        upcast(k_slot, k_stage)
        plgpu.commit_smem()
        k_slot = k_stage

      def compute_qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_slot.T)
        return acc_ref[...]

      s = pl.run_scoped(compute_qk, plgpu.ACC((rows, block_kv), jnp.float32))
      if warp_specialized:
        plgpu.barrier_arrive(k_free.at[slot])
      if soft_cap is None:
        s = s * (sm_scale * _LOG2E)
      else:
        s = (soft_cap * _LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
      mask, full = page_mask(step, (rows, block_kv), 1)
      s = jnp.where(mask, s, _NEG_INF)
      # Every stage has a live key (entries < count have length >= 1), so
      # m_new is finite and exp2(-inf - m_new) = 0.
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      probs = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_new = l_i * alpha + probs.sum(axis=1)
      acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
      p_smem.at[half][...] = probs.astype(dtype)
      v_slot = v_ring.at[slot, half]
      for p in range(num_pages):
        plgpu.barrier_wait(
            v_barriers.at[(slot * num_halves + half) * num_pages + p])
      if staged:
        upcast(v_slot, v_stage)
        v_slot = v_stage

      @pl.when(jnp.logical_not(full))
      def _():
        # Masked V rows may hold NaN; 0 * NaN would leak through P V.
        vmask, _ = page_mask(step, (block_kv, cols), 0)
        v = plgpu.load(v_slot, layout=wgmma)
        v_slot[...] = jnp.where(vmask, v, jnp.zeros((), v.dtype))

      plgpu.commit_smem()  # generic-proxy SMEM writes before the wgmma reads

      def compute_pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem.at[half], v_slot)
        return acc_ref[...]

      acc = acc + pl.run_scoped(compute_pv, plgpu.ACC((rows, cols), jnp.float32))
      if warp_specialized:
        plgpu.barrier_arrive(v_free.at[slot])
      else:
        # Both warpgroups are done with the slot (each fenced its generic-proxy
        # accesses above); warpgroup 0 refills it with a later stage, after a
        # fence of its own accesses before the TMA write.
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(k_free.at[slot])

        @pl.when((wg == 0) & (step + num_stages < num_steps))
        def _():
          plgpu.commit_smem()
          issue_stage(step + num_stages, slot)

      return acc, m_new, l_new

    def consume():
      if warp_specialized:
        plgpu.set_max_registers(232, action="increase")
      plgpu.barrier_wait(in_barriers.at[1])
      init = (
          plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), wgmma),
          plgpu.layout_cast(jnp.full((rows,), _NEG_INF, jnp.float32),
                            wgmma.reduce(1)),
          plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), wgmma.reduce(1)))
      return jax.lax.fori_loop(0, num_steps, body, init)

    if warp_specialized:
      @as_consumer
      def _():
        store_output(o_smem, lse_smem, *consume())
      return None
    return consume()

  smem = lambda shape, dt=dtype, **kw: plgpu.SMEM(shape, dt, **kw)
  fixed = [smem((4, chunks, lanes), jnp.int32),
           smem((rows, head_dim), transforms=tiled),
           smem((rows,), jnp.float32),
           plgpu.Barrier(num_arrivals=1, num_barriers=2),
           plgpu.Barrier(num_arrivals=1, num_barriers=num_stages * num_pages),
           plgpu.Barrier(num_arrivals=1,
                         num_barriers=num_stages * num_halves * num_pages)]
  page_dtype = k_gmem.dtype
  ring = [smem((num_stages, block_kv, head_dim), page_dtype, transforms=ring_tiled),
          smem((num_stages, num_halves, block_kv, cols), page_dtype,
               transforms=ring_tiled),
          smem((num_halves, rows, block_kv), transforms=tiled)]
  out = smem((num_halves, rows, cols), jnp.float32)
  if warp_specialized:
    stage = ([smem((block_kv, head_dim), transforms=tiled)] * 2 if staged else [])
    pl.run_scoped(
        program, *fixed,
        plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
        *ring, out, *stage, collective_axes="wg")
    return

  def halves(table_smem, q_smem, lse_smem, in_barriers, k_barriers, v_barriers,
             free):
    acc, m_i, l_i = pl.run_scoped(
        lambda *r: program(table_smem, q_smem, lse_smem, in_barriers,
                           k_barriers, v_barriers, free, None, *r, None),
        *ring, collective_axes="wg")
    # The output tile shares memory with the ring, released above (both
    # warpgroups waited on the last stage's `free` barrier).
    pl.run_scoped(lambda o_smem: store_output(o_smem, lse_smem, acc, m_i, l_i),
                  out, collective_axes="wg")

  pl.run_scoped(halves, *fixed,
                plgpu.Barrier(num_arrivals=num_halves, num_barriers=num_stages),
                collective_axes="wg")


# Wrapper --------------------------------------------------------------------------


def pack_segment_table(seg_block, seg_start, seg_length, num_segments, *,
                       num_splits, layer=None):
  """`i32[B, NS, 4, C, 128]`: split s holds entries `[s*per, (s+1)*per)`, `per =
  ceil(S / NS)`, as rows block, start, length; row 3 holds the split's count of
  valid entries at `[3, 0, 0]` and the layer at `[3, 0, 1]`."""
  batch, num_seg_slots = seg_block.shape
  per = pl.cdiv(num_seg_slots, num_splits)
  chunks = pl.cdiv(per, TABLE_LANES)
  shape = (batch, num_splits, 1, chunks, TABLE_LANES)

  def pad(a):
    a = jnp.pad(a, ((0, 0), (0, per * num_splits - num_seg_slots)))
    a = a.reshape(batch, num_splits, per)
    return jnp.pad(a, ((0, 0), (0, 0), (0, chunks * TABLE_LANES - per))).reshape(shape)

  count = jnp.clip(num_segments[:, None] - jnp.arange(num_splits)[None] * per,
                   0, per)
  layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
  meta = jnp.zeros(shape, jnp.int32).at[:, :, 0, 0, 0].set(count)
  meta = meta.at[:, :, 0, 0, 1].set(layer)
  return jnp.concatenate([pad(seg_block), pad(seg_start), pad(seg_length), meta],
                         axis=2)


def merge_splits_log2(o, lse, axis):
  """Merges normalised split tiles `o [..., NS, R, D]` by their log2-sum-exp2
  `lse [..., NS, R]` (-inf = empty split; all empty gives 0)."""
  mx = jnp.max(lse, axis=axis, keepdims=True)
  mx = jnp.where(mx == _NEG_INF, 0.0, mx)
  w = jnp.exp2(lse - mx)
  den = jnp.sum(w, axis=axis)
  out = jnp.sum(w[..., None] * o, axis=axis)
  # `den == 0` (not `> 0`): a NaN that slipped in must propagate, not vanish.
  return jnp.where(den[..., None] == 0, 0.0,
                   out / jnp.where(den == 0, 1.0, den)[..., None])


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "pages_per_step", "num_splits"))
def mosaic_decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim] or [L, ...]
    v_pages: jax.Array,  # same shape as k_pages
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    soft_cap: float | None,
    interpret=None,
    pages_per_step: int | None = None,
    num_splits: int = 1,
    layer: jax.Array | int | None = None,  # i32[] with stacked pages
) -> jax.Array:  # [B, num_q_heads, head_dim], q.dtype
  """Decode attention with the Mosaic GPU kernel (inputs validated by the caller,
  `decode_attention.static_validate_inputs`; shape limits by `mosaic_problem`).

  Args:
    sm_scale: logits scale (already resolved, not None).
    interpret: None (compile for Hopper), True (`InterpretGPUParams(
      detect_races=True)`) or a `plgpu.InterpretGPUParams`.
    pages_per_step: pages per ring stage of `STAGE_KEYS` keys; None:
      `default_pages_per_stage`.
    num_splits: split-K factor; raised so that no split has more than
      `MAX_TABLE_CHUNKS * 128` segment entries.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import

  from pallas_kernels import lowering
  from pallas_kernels import decode_attention as pa

  k_pages, v_pages, layer = pa.stacked_pages(k_pages, v_pages, layer)
  batch, num_q_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  problem = mosaic_problem(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, block_size=block_size,
                           dtype=k_pages.dtype, pages_per_step=pages_per_step)
  fp8 = k_pages.dtype.itemsize == 1
  if problem is None and fp8 and q.dtype not in (jnp.bfloat16, jnp.float16):
    problem = f"impl='mosaic' with fp8 pages needs bf16/f16 q, got {q.dtype}"
  elif problem is None and not fp8 and q.dtype != k_pages.dtype:
    problem = f"impl='mosaic' needs q in the pages' dtype, got {q.dtype}"
  if problem is not None:
    raise ValueError(problem)
  if interpret is True:
    interpret = lowering.gpu_interpret_params(detect_races=True)
  elif interpret is False:
    interpret = None
  if pages_per_step is None:
    pages_per_step = default_pages_per_stage(head_dim=head_dim, block_size=block_size,
                                             dtype=k_pages.dtype)
  warp_specialized, num_stages = kernel_config(head_dim, k_pages.dtype,
                                               pages_per_step * block_size)
  num_seg_slots = seg_block.shape[1]
  max_per_split = MAX_TABLE_CHUNKS * TABLE_LANES
  num_splits = max(1, min(num_splits, pl.cdiv(num_seg_slots, pages_per_step)),
                   pl.cdiv(num_seg_slots, max_per_split))
  num_splits, _ = pa.split_entries(num_seg_slots, num_splits, 1)  # none empty
  table = pack_segment_table(seg_block, seg_start, seg_length, num_segments,
                             num_splits=num_splits, layer=layer)
  num_splits, chunks = table.shape[1], table.shape[3]
  # Layer-major rows: a bitcast of the stacked pool (no copy), 4-D like one
  # layer's pages, so the TMA copies keep the rank they were verified with.
  k_rows = k_pages.reshape(num_layers * num_kv_heads, num_blocks, block_size, head_dim)
  v_rows = v_pages.reshape(num_layers * num_kv_heads, num_blocks, block_size, head_dim)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  if fp8:  # both wgmmas in f16 (see `FP8_COMPUTE_DTYPE`)
    qg = qg.astype(FP8_COMPUTE_DTYPE)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, BLOCK_ROWS - group), (0, 0)))
  kernel = functools.partial(mosaic_decode_attention_kernel, sm_scale=sm_scale,
                             soft_cap=soft_cap, pages_per_step=pages_per_step,
                             num_stages=num_stages, chunks=chunks,
                             warp_specialized=warp_specialized,
                             num_kv_heads=num_kv_heads)
  tile = (batch, num_kv_heads, num_splits, BLOCK_ROWS)
  num_halves = 1 if warp_specialized else 2
  o, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(
          (batch, num_kv_heads, num_splits, num_halves, BLOCK_ROWS,
           head_dim // num_halves), jnp.float32),
                jax.ShapeDtypeStruct(tile, jnp.float32)),
      grid=(batch, num_kv_heads, num_splits),
      grid_names=("row", "head", "split"),
      num_threads=2,
      thread_name="wg",
      interpret=interpret,
  )(table, qg, k_rows, v_rows)
  o = jnp.moveaxis(o, 3, 4).reshape(tile + (head_dim,))  # column halves side by side
  out = merge_splits_log2(o, lse, axis=2)[:, :, :group]  # [B, KVH, G, D]
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
