"""Decode attention over segment tables (one query token per sequence).

A sequence's KV lives in *segments* `(block, start, length)`: logical token t of
batch row b is at slot `seg_start[b, s] + (t - sum(seg_length[b, :s]))` of block
`seg_block[b, s]`, for the segment s whose cumulative length covers t. Entries at
`s >= num_segments[b]` are padding and may hold garbage; they are never read.
Several segments (of one or several sequences) may share a block ("slotted blocks",
shared prefixes), so every kernel masks slots outside `[start, start + length)`.

Implementations (`impl=`):
  * "xla":    gathers whole blocks and runs a masked softmax (the CPU default).
  * "pallas": grid (batch, kv_head, split); one program holds the GQA group of one
              kv head, walks its split's segments `pages_per_step` blocks at a time
              with an online softmax; a jnp pass merges the splits (flash
              decoding). Lowers through Triton on GPUs; `interpret=True` on CPU.
  * "mosaic": the Mosaic GPU (Hopper) kernel of `decode_attention_mosaic.py`; on
              CPU it needs `interpret=`.

On a GPU target the wrapper refuses at trace time (ValueError naming the impls
that build) a shape whose kernel cannot lower; `lowerable_decode_impls` asks ahead.

Pages: one layer's `[num_kv_heads, num_blocks, block_size, head_dim]`, or the pool's
stacked `[num_layers, ...]` with `layer=` (an int or a traced i32 scalar, clipped
into range). Pass the stack: `pages[layer]` would be materialised as a copy of the
whole layer, while every path reads only the blocks it needs from the stack ("xla":
one gather `pages[layer, :, blocks]`; "pallas": the layer axis whole in its BlockSpec,
the layer added to its gather indices; "mosaic": the pool viewed as `[num_layers *
num_kv_heads, ...]`).

`ref_decode_attention` rebuilds every sequence's K/V token by token, independently of
the block-level paths, so that it can check them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Constants ------------------------------------------------------------------

DEFAULT_PAGES_PER_STEP = 4  # segments per online-softmax step at block_size 16
KEYS_PER_STEP = 64  # `pages_per_step=None` loads this many slots per step (at least)
# A decode step's K bytes that `default_decode_pages_per_step` aims for: 64 slots
# of head_dim 128 bf16, the step that ran at copy bandwidth on an H200.
DECODE_STEP_BYTES = KEYS_PER_STEP * 128 * 2
# Largest K tile (slots x head_dim elements) of a "pallas" step on a GPU: Triton
# keeps the tile in registers/shared memory, which the lowering tier does not
# check (it stops before Triton's compile), so this bound is conservative.
MAX_TRITON_TILE = 128 * 256
# Shared default of `static_validate_inputs` (prefill_attention validates through it
# and has no Mosaic GPU kernel); decode attention passes `_DECODE_IMPLS`.
_SUPPORTED_IMPLS = ("xla", "pallas")
_DECODE_IMPLS = ("xla", "pallas", "mosaic")
_KNOWN_IMPLS = ("xla", "pallas", "mosaic")
# Preference order on a GPU: Mosaic GPU where it builds, then Triton, then xla, the
# order of their decode-layer times on an H200 (docs/records/gpu_check/).
# `lowerable_decode_impls` filters it by shape; `paged_kv.model.default_impl`
# takes the first that builds (its order is configurable).
GPU_DECODE_PREFERENCE = ("mosaic", "pallas", "xla")
# `num_splits=None`: enough programs for twice the SMs, but a split streams at
# least this many slots (table entries x block_size) and there are at most
# `MAX_SPLITS` splits.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 256
DEFAULT_NUM_CORES = 132  # H100/H200 SMs, when the target does not say
_NEG_INF = float("-inf")


# Reference --------------------------------------------------------------------


def logical_token_slots(
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    max_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Physical (block, slot) of logical tokens 0..max_tokens-1 of every row.

  Returns `(block i32[B, max_tokens], slot i32[B, max_tokens], seq_lens i32[B])`;
  tokens at `t >= seq_lens[b]` point at block 0, slot 0 and must be masked.
  """
  num_seg_slots = seg_block.shape[1]
  seg_idx = jnp.arange(num_seg_slots)[None, :]
  valid = seg_idx < num_segments[:, None]
  lengths = jnp.where(valid, seg_length, 0)
  cum_end = jnp.cumsum(lengths, axis=1)  # [B, S]
  seq_lens = cum_end[:, -1]
  t = jnp.arange(max_tokens)[None, :]
  # Segment covering t: number of segments that end at or before t.
  s_of_t = jnp.sum(cum_end[:, None, :] <= t[:, :, None], axis=-1)  # [B, T]
  s_of_t = jnp.minimum(s_of_t, num_seg_slots - 1)
  in_seq = t < seq_lens[:, None]
  take = lambda a: jnp.take_along_axis(a, s_of_t, axis=1)
  cum_before = take(cum_end) - take(lengths)
  block = jnp.where(in_seq, take(seg_block), 0)
  slot = jnp.where(in_seq, take(seg_start) + (t - cum_before), 0)
  return block, slot, seq_lens


def stacked_pages(k_pages, v_pages, layer):
  """`(k, v, layer)`: the pages as a `[num_layers, num_kv_heads, num_blocks,
  block_size, head_dim]` stack and the layer to read, an i32 scalar in range.

  4-D pages become a one-layer stack (no copy; `layer` None or 0). Stacked pages
  need `layer`: an int (range-checked) or a traced scalar (negative counts from the
  end; clipped so that no kernel reads outside the pool).
  """
  if k_pages.ndim == 4:
    if layer is not None and not (isinstance(layer, int) and layer == 0):
      raise ValueError("layer= is for stacked [num_layers, num_kv_heads, num_blocks,"
                       f" block_size, head_dim] pages; got one layer's {k_pages.shape}")
    return k_pages[None], v_pages[None], jnp.zeros((), jnp.int32)
  num_layers = k_pages.shape[0]
  if layer is None:
    raise ValueError(f"stacked pages {k_pages.shape} need layer= (which layer to read)")
  if isinstance(layer, (int, np.integer)):
    if not -num_layers <= layer < num_layers:
      raise ValueError(f"layer {layer} outside [0, {num_layers})")
    return k_pages, v_pages, jnp.asarray(int(layer) % num_layers, jnp.int32)
  layer = jnp.asarray(layer)
  if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise ValueError(f"layer must be an integer scalar, got {layer.dtype}{list(layer.shape)}")
  layer = layer.astype(jnp.int32)
  layer = jnp.clip(jnp.where(layer < 0, layer + num_layers, layer), 0, num_layers - 1)
  return k_pages, v_pages, layer


def compute_dtype(q_dtype, kv_dtype):
  """Dtype of the Q K^T operands: q and the pages promoted, or q's dtype for fp8
  pages (upcast; nothing is rounded to 8 bits)."""
  if jnp.dtype(kv_dtype).itemsize == 1:
    return jnp.dtype(q_dtype)
  return jnp.promote_types(q_dtype, kv_dtype)


def _apply_soft_cap(logits, soft_cap):
  if soft_cap is None:
    return logits
  return soft_cap * jnp.tanh(logits / soft_cap)


def ref_decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:  # [B, num_q_heads, head_dim], q.dtype
  """Plain reference: gather logical K/V per token, then a masked softmax.

  Computes in the promoted dtype of the inputs (pass float64 for a float64 ref).
  Stacked pages (`[num_layers, ...]`) are read at `layer` (sliced: a reference).
  """
  if layer is not None:
    k_pages, v_pages = k_pages[layer], v_pages[layer]
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  max_tokens = seg_block.shape[1] * block_size
  block, slot, seq_lens = logical_token_slots(
      seg_block, seg_start, seg_length, num_segments, max_tokens=max_tokens)
  k = k_pages[:, block, slot]  # [KVH, B, T, D]
  v = v_pages[:, block, slot]
  mask = jnp.arange(max_tokens)[None, :] < seq_lens[:, None]  # [B, T]
  out = masked_attention(q.reshape(batch, num_kv_heads, group, head_dim), k, v, mask,
                         sm_scale=sm_scale, soft_cap=soft_cap)
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def masked_attention(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                     sm_scale: float, soft_cap: float | None) -> jax.Array:
  """Softmax attention of query rows over gathered keys, masked (shared by the references).

  Args:
    qg: `[R, num_kv_heads, group, head_dim]` query rows grouped by kv head.
    k, v: `[num_kv_heads, R, L, head_dim]` the keys/values each row may see.
    mask: `bool[R, L]` which of them it attends to.
    sm_scale: logit scale; soft_cap: optional tanh cap after scaling.

  Returns:
    `[R, num_kv_heads, group, head_dim]`; rows with nothing to attend to are 0.
  """
  k = jnp.where(mask[None, :, :, None], k, 0)
  v = jnp.where(mask[None, :, :, None], v, 0)
  logits = jnp.einsum("rhgd,hrld->rhgl", qg, k) * sm_scale
  logits = _apply_soft_cap(logits, soft_cap)
  logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0)
  p = jnp.exp(logits - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("rhgl,hrld->rhgd", p, v)
  # `denom == 0` (not `> 0`) so that a NaN that slipped in still propagates.
  return jnp.where(denom == 0, 0, out / jnp.where(denom == 0, 1, denom))


# Validators --------------------------------------------------------------------


def static_validate_inputs(q, k_pages, v_pages, seg_block, seg_start, seg_length,
                           num_segments, *, sm_scale, soft_cap, num_splits, impl,
                           pages_per_step, interpret=False,
                           supported_impls=_SUPPORTED_IMPLS):
  """Checks shapes, dtypes and static arguments against `supported_impls`; raises
  ValueError."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, num_q_heads, head_dim], got {q.shape}")
  if k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
    raise ValueError(
        "k_pages and v_pages must both be [num_kv_heads, num_blocks, block_size,"
        " head_dim] (one layer) or [num_layers, num_kv_heads, num_blocks, block_size,"
        f" head_dim] (stacked, with layer=), got {k_pages.shape} and {v_pages.shape}")
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, page_head_dim = k_pages.shape[-4:]
  if page_head_dim != head_dim:
    raise ValueError(f"head_dim mismatch: q {head_dim}, pages {page_head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                     f"num_kv_heads={num_kv_heads}")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k/v dtype mismatch: {k_pages.dtype} vs {v_pages.dtype}")
  for name, a in (("seg_block", seg_block), ("seg_start", seg_start),
                  ("seg_length", seg_length)):
    if a.ndim != 2 or a.shape[0] != batch:
      raise ValueError(f"{name} must be i32[{batch}, S], got {a.shape}")
    if a.shape != seg_block.shape:
      raise ValueError(f"{name} shape {a.shape} != seg_block {seg_block.shape}")
    if a.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {a.dtype}")
  if num_segments.shape != (batch,) or num_segments.dtype != jnp.int32:
    raise ValueError(f"num_segments must be i32[{batch}], got "
                     f"{num_segments.dtype}{list(num_segments.shape)}")
  if impl not in _KNOWN_IMPLS:
    raise ValueError(f"impl must be one of {_KNOWN_IMPLS}, got {impl!r}")
  if impl not in supported_impls:
    raise ValueError(
        f"impl={impl!r} is not implemented for this attention op; use one of "
        f"{supported_impls} (decode attention also has \"mosaic\")")
  from pallas_kernels import lowering

  platform = lowering.target_platform()
  if impl == "mosaic" and not interpret and platform not in ("cuda", "rocm"):
    raise ValueError(
        f"impl='mosaic' is not implemented on the {platform!r} backend"
        " (Mosaic GPU needs a GPU); pass interpret=True or a"
        " plgpu.InterpretGPUParams to run it in the GPU interpreter")
  if num_splits is not None and (not isinstance(num_splits, int) or
                                 num_splits < 1):
    raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
  if pages_per_step is not None and (not isinstance(pages_per_step, int) or
                                     pages_per_step < 1):
    raise ValueError(
        f"pages_per_step must be None or an int >= 1, got {pages_per_step!r}")
  if not interpret and platform in ("cuda", "rocm"):
    problem = decode_impl_problem(
        impl, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=k_pages.dtype,
        pages_per_step=pages_per_step, platform=platform)
    if problem is not None:
      ok = lowerable_decode_impls(
          num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
          block_size=block_size, dtype=k_pages.dtype,
          pages_per_step=pages_per_step, platform=platform)
      raise ValueError(f"cannot build on {platform}: {problem}; impls that build "
                       f"for this shape: {ok}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be None or > 0, got {soft_cap!r}")
  if sm_scale is not None and not sm_scale > 0:
    raise ValueError(f"sm_scale must be None or > 0, got {sm_scale!r}")


def dynamic_validate_inputs(
    seg_block, seg_start, seg_length, num_segments, *, num_blocks: int,
    block_size: int):
  """Host-side check of a concrete segment table (debug/tests); raises ValueError.

  Entries `s < num_segments[b]` need `0 <= block < num_blocks`, `length >= 1`,
  `start >= 0`, `start + length <= block_size`; padding is not inspected.
  """
  blk, st, ln, ns = (np.asarray(a) for a in (seg_block, seg_start, seg_length,
                                             num_segments))
  num_seg_slots = blk.shape[1]
  if np.any(ns < 0) or np.any(ns > num_seg_slots):
    raise ValueError(f"num_segments must lie in [0, {num_seg_slots}], got {ns}")
  valid = np.arange(num_seg_slots)[None, :] < ns[:, None]
  bad = valid & ((blk < 0) | (blk >= num_blocks) | (ln < 1) | (st < 0) |
                 (st + ln > block_size))
  if np.any(bad):
    b, s = np.argwhere(bad)[0]
    raise ValueError(
        f"invalid segment (row {b}, entry {s}): block={blk[b, s]} start={st[b, s]}"
        f" length={ln[b, s]} (num_blocks={num_blocks}, block_size={block_size})")


# Which impl builds where (asked by the wrappers and the model layer) ----------


def default_pages_per_step(block_size: int) -> int:
  """Pages per step for `pages_per_step=None`: `KEYS_PER_STEP` slots, >= 1 page."""
  return max(1, KEYS_PER_STEP // block_size)


def default_decode_pages_per_step(*, block_size: int, head_dim: int, dtype) -> int:
  """Pages per step of the "pallas" decode kernel for `pages_per_step=None`:
  `KEYS_PER_STEP` slots, doubled while a step's K bytes stay within
  `DECODE_STEP_BYTES` and its K tile within `MAX_TRITON_TILE` (a step costs about
  one load latency whatever its bytes, so narrow rows take more slots)."""
  keys = KEYS_PER_STEP
  row_bytes = head_dim * jnp.dtype(dtype).itemsize
  while (2 * keys * row_bytes <= DECODE_STEP_BYTES
         and 2 * keys * head_dim <= MAX_TRITON_TILE):
    keys *= 2
  return max(1, keys // block_size)


def target_num_cores() -> int:
  """SMs of the GPU being built for (abstract mesh, else first GPU, else
  `DEFAULT_NUM_CORES`)."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  cores = getattr(device, "num_cores", None) if device is not None else None
  if not cores and jax.default_backend() == "gpu":
    cores = getattr(jax.devices()[0], "core_count", None)
  return int(cores) if cores else DEFAULT_NUM_CORES


def default_num_splits(*, batch: int, num_kv_heads: int, num_seg_slots: int,
                       pages_per_step: int, block_size: int | None = None,
                       num_cores: int | None = None) -> int:
  """Split-K factor for `num_splits=None`, from static shapes only: enough programs
  to fill `num_cores` SMs twice, each split at least `pages_per_step` entries and
  `MIN_KEYS_PER_SPLIT` slots (merging costs more than a short split saves), at most
  `MAX_SPLITS`."""
  num_cores = target_num_cores() if num_cores is None else num_cores
  programs = max(1, batch * num_kv_heads)
  want = max(1, -(-2 * num_cores // programs))
  min_entries = pages_per_step
  if block_size:
    min_entries = max(min_entries, -(-MIN_KEYS_PER_SPLIT // block_size))
  return max(1, min(want, -(-num_seg_slots // min_entries), MAX_SPLITS))


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def default_path_problem(impl: str, *, num_q_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, dtype,
                         pages_per_step: int | None = None,
                         platform: str | None = None, q_dtype=None) -> str | None:
  """`decode_impl_problem`, plus why the default (`impl=None`) avoids an impl that
  builds but is bad at this shape (`mosaic_default_caveat`); None: it may pick it."""
  problem = decode_impl_problem(
      impl, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, dtype=dtype, pages_per_step=pages_per_step,
      platform=platform, q_dtype=q_dtype)
  if problem is None and impl == "mosaic":
    from pallas_kernels import lowering
    if (platform or lowering.target_platform()) == "cuda":
      from pallas_kernels import decode_attention_mosaic as pm
      problem = pm.mosaic_default_caveat(head_dim=head_dim, dtype=dtype)
  return problem


def decode_impl_problem(impl: str, *, num_q_heads: int, num_kv_heads: int,
                        head_dim: int, block_size: int, dtype,
                        pages_per_step: int | None = None,
                        platform: str | None = None,
                        q_dtype=None) -> str | None:
  """Why `decode_attention(impl=impl)` cannot be built for this shape on `platform`
  (default: the trace's target), or None. Every shape it accepts lowers for an
  abstract H100/H200 (the lowering tier checks); on CPU every impl is accepted.
  "mosaic" needs queries in the pages' dtype (`q_dtype`).
  """
  from pallas_kernels import lowering

  platform = platform or lowering.target_platform()
  if impl not in _DECODE_IMPLS:
    return f"impl must be one of {_DECODE_IMPLS}, got {impl!r}"
  if platform not in ("cuda", "rocm") or impl == "xla":
    return None
  pps = pages_per_step
  if pps is None:
    pps = default_decode_pages_per_step(block_size=block_size, head_dim=head_dim,
                                        dtype=dtype)
  shape = (f"{num_q_heads}/{num_kv_heads} heads, head_dim {head_dim}, block "
           f"{block_size}, {jnp.dtype(dtype).name}, pages_per_step {pps}")
  if impl == "pallas":
    for name, n in (("head_dim", head_dim), ("block_size", block_size),
                    ("pages_per_step", pps)):
      if not _is_pow2(n):
        return (f"impl='pallas' (Triton) needs a power-of-two {name}, got {n} "
                f"({shape})")
    if head_dim < 16:
      return f"impl='pallas' (Triton) needs head_dim >= 16 ({shape})"
    if pps * block_size * head_dim > MAX_TRITON_TILE:
      return (f"impl='pallas' (Triton): a step's K tile of {pps * block_size} "
              f"slots x {head_dim} exceeds {MAX_TRITON_TILE} elements; lower "
              f"pages_per_step ({shape})")
    return None
  if platform != "cuda":
    return "impl='mosaic' needs an NVIDIA (cuda) GPU"
  from pallas_kernels import decode_attention_mosaic as pm
  problem = pm.mosaic_problem(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=block_size, dtype=dtype,
                              pages_per_step=pages_per_step)
  if problem is None and q_dtype is not None:
    if jnp.dtype(dtype).itemsize == 1:  # fp8 pages: staged to f16 in the kernel
      if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        problem = (f"impl='mosaic' with fp8 pages needs bf16/f16 q, got q "
                   f"{jnp.dtype(q_dtype).name} ({shape})")
    elif jnp.dtype(q_dtype) != jnp.dtype(dtype):
      problem = (f"impl='mosaic' needs q in the pages' dtype, got q "
                 f"{jnp.dtype(q_dtype).name} ({shape})")
  return problem


def lowerable_decode_impls(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           block_size: int, dtype,
                           pages_per_step: int | None = None,
                           platform: str | None = None,
                           preference: tuple[str, ...] | None = None,
                           q_dtype=None) -> tuple[str, ...]:
  """The decode impls that build for this shape on `platform`, in `preference`
  order on a GPU, "xla" first elsewhere; `[0]` is the one to use."""
  from pallas_kernels import lowering

  return lowering.lowerable_impls(
      GPU_DECODE_PREFERENCE if preference is None else tuple(preference),
      decode_impl_problem, platform=platform,
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, dtype=dtype, pages_per_step=pages_per_step,
      q_dtype=q_dtype)


# XLA gather path ---------------------------------------------------------------


def _xla_decode_attention(q, k_pages, v_pages, layer, seg_block, seg_start,
                         seg_length, num_segments, *, sm_scale, soft_cap):
  """One gather per operand reads the rows' blocks of `layer`, never the whole layer."""
  batch, num_q_heads, head_dim = q.shape
  _, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  num_seg_slots = seg_block.shape[1]
  valid = jnp.arange(num_seg_slots)[None, :] < num_segments[:, None]  # [B, S]
  blocks = jnp.clip(jnp.where(valid, seg_block, 0), 0, num_blocks - 1)
  j = jnp.arange(block_size)[None, None, :]
  mask = (valid[:, :, None] & (j >= seg_start[:, :, None]) &
          (j < (seg_start + seg_length)[:, :, None]))  # [B, S, bs]
  k = k_pages[layer, :, blocks]  # [B, S, KVH, bs, D]
  v = v_pages[layer, :, blocks]
  v = jnp.where(mask[:, :, None, :, None], v, jnp.zeros((), v.dtype))
  ct = compute_dtype(q.dtype, k.dtype)
  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(ct)
  logits = jnp.einsum("bhgd,bshjd->bhgsj", qg, k.astype(ct),
                      preferred_element_type=jnp.float32) * sm_scale
  logits = _apply_soft_cap(logits, soft_cap)
  logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
  logits = logits.reshape(batch, num_kv_heads, group, num_seg_slots * block_size)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(m == _NEG_INF, 0.0, m)
  p = jnp.exp(logits - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p.reshape(batch, num_kv_heads, group, num_seg_slots, block_size)
  out = jnp.einsum("bhgsj,bshjd->bhgd", p, v.astype(jnp.float32))
  out = jnp.where(denom == 0, 0.0, out / jnp.where(denom == 0, 1.0, denom))
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# Pallas kernel -------------------------------------------------------------------


def load_segment_pages(k_ref, v_ref, seg_block_ref, seg_start_ref, seg_length_ref,
                       *, row, first, end, pages_per_step, cum_before_ref=None,
                       layer=None):
  """Loads segments `first .. first+pages_per_step-1` (entries < `end` valid).

  `k_ref`, `v_ref`: one kv head's pages `[num_blocks, bs, D]`, or with `layer` (i32
  scalar) `[num_layers, num_blocks, bs, D]`. The table refs need at least `first +
  pages_per_step` entries per row (the wrappers pad them). One gather load each for
  K and V.

  Returns `(k [P*bs, D], v [P*bs, D] with masked slots zeroed, both in the pages'
  dtype, mask bool[P*bs], key_pos i32[P*bs])`; `key_pos` is the logical position
  when `cum_before_ref` (i32[B, S]) is given, else the slot index. Padding entries
  read block 0 and are masked.
  """
  num_blocks, block_size, head_dim = k_ref.shape[-3:]
  num_pages = pages_per_step
  sl = pl.ds(first, num_pages)
  valid = (first + jax.lax.broadcasted_iota(jnp.int32, (num_pages,), 0)) < end
  blk = jnp.clip(jnp.where(valid, seg_block_ref[row, sl], 0), 0, num_blocks - 1)
  start = seg_start_ref[row, sl][:, None]  # [P, 1]
  length = seg_length_ref[row, sl][:, None]
  j = jax.lax.broadcasted_iota(jnp.int32, (num_pages, block_size), 1)
  mask = valid[:, None] & (j >= start) & (j < start + length)  # [P, bs]
  if layer is None:
    k = k_ref[blk]  # [P, bs, D]
    v = v_ref[blk]
  else:
    k = k_ref[layer, blk]  # [P, bs, D]
    v = v_ref[layer, blk]
  v = jnp.where(mask[:, :, None], v, jnp.zeros((), v.dtype))
  if cum_before_ref is None:
    key_pos = j
  else:
    key_pos = cum_before_ref[row, sl][:, None] + (j - start)
  flat = num_pages * block_size
  return (k.reshape(flat, head_dim), v.reshape(flat, head_dim),
          mask.reshape(flat), key_pos.reshape(flat))


def pv_dtype(q_dtype, v_dtype):
  """Dtype of the P V operands: the pages' dtype, or q's for fp8 pages."""
  return jnp.dtype(q_dtype) if jnp.dtype(v_dtype).itemsize == 1 else jnp.dtype(v_dtype)


def online_softmax_update(carry, logits, v, p_dtype=None):
  """One flash step. carry = (m f32[R], l f32[R], acc f32[R, D]); logits f32[R, N]
  masked with -inf; v [N, D] with masked rows zero; P V in `p_dtype` (default v's),
  accumulated in f32."""
  m_prev, l_prev, acc_prev = carry
  p_dtype = v.dtype if p_dtype is None else p_dtype
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1))
  m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
  p = jnp.exp(logits - m_safe[:, None])
  alpha = jnp.exp(m_prev - m_safe)
  l_new = alpha * l_prev + jnp.sum(p, axis=1)
  acc_new = alpha[:, None] * acc_prev + jnp.dot(
      p.astype(p_dtype), v.astype(p_dtype), preferred_element_type=jnp.float32)
  return m_new, l_new, acc_new


def decode_attention_kernel(
    layer_ref,  # i32[1] the layer to read
    num_segments_ref,  # i32[B]
    seg_block_ref,  # i32[B, S_pad]
    seg_start_ref,  # i32[B, S_pad]
    seg_length_ref,  # i32[B, S_pad]
    q_ref,  # [G_pad, D] (this row, this kv head; rows >= G are zero padding)
    k_ref,  # [num_layers, num_blocks, bs, D] (this kv head, every layer)
    v_ref,  # [num_layers, num_blocks, bs, D]
    acc_ref,  # f32[G_pad, D] unnormalised output of this split
    m_ref,  # f32[G_pad] running max of this split
    l_ref,  # f32[G_pad] softmax denominator of this split
    *, sm_scale, soft_cap, segments_per_split, pages_per_step):
  """Program (b, h, s): segments [s*per, min((s+1)*per, num_segments[b])) of
  layer `layer_ref[0]`."""
  row, split = pl.program_id(0), pl.program_id(2)
  group, head_dim = q_ref.shape
  layer = layer_ref[0]
  first = split * segments_per_split
  end = jnp.minimum(first + segments_per_split, num_segments_ref[row])
  num_steps = jnp.maximum(0, pl.cdiv(end - first, pages_per_step))
  q = q_ref[...]
  p_dtype = pv_dtype(q.dtype, v_ref.dtype)

  def body(step, carry):
    k, v, mask, _ = load_segment_pages(
        k_ref, v_ref, seg_block_ref, seg_start_ref, seg_length_ref, row=row,
        first=first + step * pages_per_step, end=end,
        pages_per_step=pages_per_step, layer=layer)
    logits = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * sm_scale
    logits = _apply_soft_cap(logits, soft_cap)
    logits = jnp.where(mask[None, :], logits, _NEG_INF)
    return online_softmax_update(carry, logits, v, p_dtype)

  init = (jnp.full((group,), _NEG_INF, jnp.float32),
          jnp.zeros((group,), jnp.float32),
          jnp.zeros((group, head_dim), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, num_steps, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def merge_splits(acc, m, l, axis):
  """Stable merge of split partials: acc [..., NS, R, D], m/l [..., NS, R]; empty
  splits (m = -inf, l = 0) weigh 0, rows with no token return 0."""
  m_max = jnp.max(m, axis=axis, keepdims=True)
  m_max = jnp.where(m_max == _NEG_INF, 0.0, m_max)
  w = jnp.exp(m - m_max)  # exp(-inf) = 0 for empty splits
  l_tot = jnp.sum(w * l, axis=axis)
  o = jnp.sum(w[..., None] * acc, axis=axis)
  # Test `== 0` rather than `> 0`: a NaN (a stray read) must propagate, not vanish.
  safe = jnp.where(l_tot == 0, 1.0, l_tot)
  return jnp.where(l_tot[..., None] == 0, 0.0, o / safe[..., None])


def pad_segment_table(*tables, multiple):
  """Pads the entry axis of `i32[B, S]` tables to a multiple of `multiple` (the
  padding lies past `num_segments`, so it is masked)."""
  num_seg_slots = tables[0].shape[1]
  padded = pl.cdiv(num_seg_slots, multiple) * multiple
  pad = lambda a: jnp.pad(a, ((0, 0), (0, padded - num_seg_slots)))
  return tuple(pad(a) for a in tables)


def padded_group(group: int) -> int:
  """GQA group padded to a power of two (Triton needs power-of-two shapes)."""
  return 1 << max(0, (group - 1).bit_length())


def split_entries(num_seg_slots: int, num_splits: int, multiple: int) -> tuple[int, int]:
  """`(splits, entries per split)`: `num_seg_slots` entries cut into at most
  `num_splits` splits of a multiple of `multiple` entries, none of them empty."""
  per = pl.cdiv(pl.cdiv(num_seg_slots, max(1, num_splits)), multiple) * multiple
  return pl.cdiv(num_seg_slots, per), per


def pages_spec(num_layers, num_blocks, block_size, head_dim, head_of):
  """BlockSpec of one kv head's pages, every layer whole (the kernel indexes the
  layer), so the pool is read in place: no slice, no copy."""
  return pl.BlockSpec((num_layers, None, num_blocks, block_size, head_dim),
                      lambda *ids: (0, head_of(*ids), 0, 0, 0))


def _pallas_decode_attention(q, k_pages, v_pages, layer, seg_block, seg_start,
                            seg_length, num_segments, *, sm_scale, soft_cap,
                            num_splits, pages_per_step, interpret):
  batch, num_q_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  group_pad = padded_group(group)
  num_seg_slots = seg_block.shape[1]
  num_splits, per_split = split_entries(num_seg_slots, num_splits, pages_per_step)
  seg_block, seg_start, seg_length = pad_segment_table(
      seg_block, seg_start, seg_length, multiple=per_split * num_splits)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
  kernel = functools.partial(
      decode_attention_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
      segments_per_split=per_split, pages_per_step=pages_per_step)
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  head_pages = pages_spec(num_layers, num_blocks, block_size, head_dim,
                          lambda b, h, s: h)
  layer = jnp.reshape(layer, (1,))
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_splits),
      in_specs=[
          whole(layer), whole(num_segments), whole(seg_block), whole(seg_start),
          whole(seg_length),
          pl.BlockSpec((None, None, group_pad, head_dim),
                       lambda b, h, s: (b, h, 0, 0)),
          head_pages, head_pages,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, group_pad, head_dim),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, group_pad),
                       lambda b, h, s: (b, h, s, 0)),
          pl.BlockSpec((None, None, None, group_pad),
                       lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(
              (batch, num_kv_heads, num_splits, group_pad, head_dim),
              jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group_pad),
                               jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group_pad),
                               jnp.float32),
      ],
      interpret=interpret,
      name="decode_attention",
  )(layer, num_segments, seg_block, seg_start, seg_length, qg, k_pages, v_pages)
  out = merge_splits(acc, m, l, axis=2)[:, :, :group]  # [B, KVH, G, D]
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# Public wrapper -----------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "num_splits", "impl", "interpret",
                     "pages_per_step"))
def decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim] or [L, ...]
    v_pages: jax.Array,  # same shape as k_pages
    seg_block: jax.Array,  # i32[B, S]
    seg_start: jax.Array,  # i32[B, S]
    seg_length: jax.Array,  # i32[B, S]
    num_segments: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    impl: str = "xla",
    interpret=False,
    pages_per_step: int | None = None,
    layer: jax.Array | int | None = None,  # i32[] with stacked pages
) -> jax.Array:  # [B, num_q_heads, head_dim], q.dtype
  """Decode attention of one query token per row over its segment table.

  Args:
    q: queries, `num_q_heads` a multiple of `num_kv_heads` (GQA).
    k_pages, v_pages: one layer's pages `[num_kv_heads, num_blocks, block_size,
      head_dim]`, or the pool's stacked pages `[num_layers, ...]` with `layer`
      (preferred: `pages[layer]` copies the whole layer).
    seg_block, seg_start, seg_length: segment table padded to S entries per row;
      only entries `s < num_segments[b]` are read.
    num_segments: number of valid segments per row; 0 gives a zero output row.
    sm_scale: logits scale, default `1/sqrt(head_dim)`.
    soft_cap: if set, logits become `soft_cap * tanh(logits / soft_cap)` (after
      scaling).
    num_splits: split-K factor over segment entries ("pallas", "mosaic"); None:
      `default_num_splits`. "mosaic" raises it so no split holds more than 1,024
      entries; "xla" ignores it.
    impl: "xla" (CPU default), "pallas" or "mosaic" (Mosaic GPU, Hopper); a shape
      the impl cannot build on a GPU target raises ValueError at trace time.
    interpret: run the kernel in interpret mode (CPU): a bool for "pallas"; for
      "mosaic", True (= `plgpu.InterpretGPUParams(detect_races=True)`) or a
      `plgpu.InterpretGPUParams`.
    pages_per_step: segments per online-softmax step ("pallas") or SMEM ring stage
      ("mosaic"); None: `default_decode_pages_per_step` /
      `decode_attention_mosaic.default_pages_per_stage`.
    layer: which layer of stacked pages to read (an int or a traced i32 scalar;
      negative counts from the end; clipped); None with one layer's pages.

  Accumulation is float32 for every input dtype; fp8 pages are upcast to q's
  dtype before both products (the probabilities are never rounded to fp8).
  """
  static_validate_inputs(q, k_pages, v_pages, seg_block, seg_start, seg_length,
                         num_segments, sm_scale=sm_scale, soft_cap=soft_cap,
                         num_splits=num_splits, impl=impl,
                         pages_per_step=pages_per_step, interpret=interpret,
                         supported_impls=_DECODE_IMPLS)
  k_pages, v_pages, layer = stacked_pages(k_pages, v_pages, layer)
  sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
  block_size = k_pages.shape[3]
  if pages_per_step is None and impl == "mosaic":
    from pallas_kernels import decode_attention_mosaic as pm
    pages_per_step = pm.default_pages_per_stage(
        head_dim=q.shape[-1], block_size=block_size, dtype=k_pages.dtype)
  elif pages_per_step is None:
    pages_per_step = default_decode_pages_per_step(
        block_size=block_size, head_dim=q.shape[-1], dtype=k_pages.dtype)
  if num_splits is None:
    num_splits = default_num_splits(
        batch=q.shape[0], num_kv_heads=k_pages.shape[1],
        num_seg_slots=seg_block.shape[1], pages_per_step=pages_per_step,
        block_size=block_size)
  if impl == "xla":
    return _xla_decode_attention(q, k_pages, v_pages, layer, seg_block, seg_start,
                                seg_length, num_segments, sm_scale=sm_scale,
                                soft_cap=soft_cap)
  if impl == "mosaic":
    # Imported here so that CPU users never import Mosaic GPU.
    from pallas_kernels.decode_attention_mosaic import mosaic_decode_attention
    return mosaic_decode_attention(q, k_pages, v_pages, seg_block, seg_start,
                                  seg_length, num_segments, sm_scale=sm_scale,
                                  soft_cap=soft_cap, interpret=interpret or None,
                                  pages_per_step=pages_per_step,
                                  num_splits=num_splits, layer=layer)
  return _pallas_decode_attention(q, k_pages, v_pages, layer, seg_block, seg_start,
                                 seg_length, num_segments, sm_scale=sm_scale,
                                 soft_cap=soft_cap, num_splits=num_splits,
                                 pages_per_step=pages_per_step,
                                 interpret=interpret)
