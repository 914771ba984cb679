"""`paged_attention`: write a step's new K/V into the pool and attend, mixed batch.

One-token rows run the decode kernel, the others the prefill kernel over their
cached prefix. Both take the stacked pages and the layer index, never
`pages.k[layer]` (XLA would copy the layer's pool). `mixed_launches=1` runs a
mixed step in one Mosaic prefill launch instead of two (not yet timed).
"""

from __future__ import annotations

import contextvars
import functools
import os
import warnings

import jax
import jax.numpy as jnp

from paged_kv.core.errors import InvalidArgument
from paged_kv.core.kv import write_kv
from paged_kv.core.state import KVPages
from paged_kv.model.metadata import StepMetadata
from pallas_kernels import lowering
from pallas_kernels import decode_attention as decode_kernels
from pallas_kernels import prefill_attention as prefill_kernels

IMPLS = ("xla", "pallas", "mosaic")
# The order `impl=None` tries on a GPU, first that builds for the shape wins:
# Mosaic GPU (the Hopper path; the Triton-based Pallas ops are deprecated upstream),
# then the Triton-lowered "pallas" kernels, then "xla". On an H200 the Mosaic decode
# kernel matched Triton at batch 64 x 8k and beat it at 1 x 128k (docs/benchmarks.md,
# gpu_check); the order stays configurable: `default_impl(preference=...)` or
# `PAGED_KV_GPU_IMPLS` (comma-separated, e.g. "pallas,mosaic,xla").
GPU_PREFERENCE = decode_kernels.GPU_DECODE_PREFERENCE  # ("mosaic", "pallas", "xla")
PREFERENCE_ENV = "PAGED_KV_GPU_IMPLS"
_GPU_BACKENDS = ("cuda", "rocm", "gpu")
_DEFAULTS = {"cpu": "xla"}
_warned: set[str] = set()


def gpu_preference(preference: tuple[str, ...] | None = None) -> tuple[str, ...]:
  """The GPU order `impl=None` tries: `preference`, `$PAGED_KV_GPU_IMPLS` or `GPU_PREFERENCE`.

  "xla" is appended if missing (it always builds).
  """
  if preference is None:
    env = os.environ.get(PREFERENCE_ENV, "").strip()
    preference = tuple(x.strip() for x in env.split(",") if x.strip()) or GPU_PREFERENCE
  preference = tuple(preference)
  bad = [i for i in preference if i not in IMPLS]
  if bad or len(set(preference)) != len(preference):
    raise InvalidArgument(f"impl preference must be distinct names from {IMPLS}, got "
                          f"{preference!r}")
  return preference if "xla" in preference else preference + ("xla",)


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def _first_that_builds(kernel: str, order, problem) -> str:
  """The first impl of `order` with no `problem(impl)`; warns once per reason it skipped."""
  skipped = []
  for impl in order:
    why = problem(impl)
    if why is None:
      if skipped:
        _warn_once(f"paged_attention: the {kernel} kernel falls back to impl={impl!r} "
                   f"for this shape: " + "; ".join(skipped))
      return impl
    skipped.append(why)
  raise AssertionError(f"no {kernel} impl builds (xla always does): {skipped}")


def default_impl(backend: str | None = None, *, num_q_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 block_size: int | None = None, dtype=None, q_dtype=None,
                 preference: tuple[str, ...] | None = None) -> str:
  """The decode attention path `impl=None` takes on `backend` (default: the traced platform).

  `"cpu"`: `"xla"`. A GPU: the first of `gpu_preference(preference)` (Mosaic GPU,
  Triton `"pallas"`, `"xla"`) that builds for the shape and is not known bad or
  untimed there (`default_path_problem`), warning once per fallback, so a valid
  shape never raises; without a shape, the first of the order. Any other backend:
  `InvalidArgument`. The prefill default uses the order without `"mosaic"`.
  """
  backend = lowering.target_platform() if backend is None else backend
  if backend not in _DEFAULTS and backend not in _GPU_BACKENDS:
    raise InvalidArgument(f"no verified attention path for the {backend!r} backend; pass "
                          f"impl= explicitly (one of {IMPLS}; 'xla' is portable but slow)")
  if backend in _DEFAULTS:
    return _DEFAULTS[backend]
  order = gpu_preference(preference)
  shape = (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
  if any(x is None for x in shape):
    return order[0]
  platform = "cuda" if backend == "gpu" else backend
  problem = functools.partial(
      decode_kernels.default_path_problem, num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
      dtype=dtype, q_dtype=q_dtype, platform=platform)
  return _first_that_builds("decode", order, problem)


def _default_prefill_impl(backend: str, *, num_q_heads, num_kv_heads, head_dim,
                          block_size, dtype, preference=None) -> str:
  """`default_impl` for the prefill kernel: the order without "mosaic", the decode Triton rules."""
  if backend in _DEFAULTS:
    return _DEFAULTS[backend]
  order = tuple(i for i in gpu_preference(preference) if i != "mosaic")
  platform = "cuda" if backend == "gpu" else backend
  problem = functools.partial(
      decode_kernels.decode_impl_problem, num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
      dtype=dtype, platform=platform)
  return _first_that_builds("prefill", order, problem)


def resolve_impl(impl: str | None, interpret=None):
  """`(impl, interpret)` with defaults: `default_impl()` (no shape), interpret for Pallas on CPU."""
  impl = default_impl() if impl is None else impl
  if impl not in IMPLS:
    raise InvalidArgument(f"impl must be one of {IMPLS} or None, got {impl!r}")
  if interpret is None:
    interpret = impl != "xla" and lowering.target_platform() == "cpu"
  return impl, interpret


def _mosaic_prefill_or_pallas(q: jax.Array, pages: KVPages, num_seg_slots: int) -> str:
  """"mosaic" if the Mosaic prefill kernel builds for this shape, else "pallas" (warned once)."""
  from pallas_kernels import prefill_attention_mosaic

  _, num_kv_heads, _, block_size, head_dim = pages.k.shape
  why = prefill_attention_mosaic.mosaic_prefill_problem(
      num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, dtype=pages.k.dtype, num_seg_slots=num_seg_slots,
      q_dtype=q.dtype)
  if why is None:
    return "mosaic"
  _warn_once(f"paged_attention(impl='mosaic'): prefill rows run impl='pallas': {why}")
  return "pallas"


def _kernel_impls(impl: str | None, interpret, q: jax.Array, pages: KVPages,
                  num_seg_slots: int, prefill_impl: str | None = None):
  """`((decode impl, interpret), (prefill impl, interpret))` for this call."""
  for name, value in (("impl", impl), ("prefill_impl", prefill_impl)):
    if value is not None and value not in IMPLS:
      raise InvalidArgument(f"{name} must be one of {IMPLS} or None, got {value!r}")
  backend = lowering.target_platform()
  if impl is None:
    _, num_kv_heads, _, block_size, head_dim = pages.k.shape
    shape = dict(num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
                 block_size=block_size, dtype=pages.k.dtype)
    decode = default_impl(backend, q_dtype=q.dtype, **shape)
    prefill = _default_prefill_impl(backend, **shape) if backend not in _DEFAULTS else decode
  else:
    decode = prefill = impl
    if impl == "mosaic":
      prefill = _mosaic_prefill_or_pallas(q, pages, num_seg_slots)
  if prefill_impl is not None:
    prefill = prefill_impl
  resolved = []
  for kernel_impl in (decode, prefill):
    kernel_interpret = interpret
    if kernel_interpret is None:
      kernel_interpret = kernel_impl != "xla" and backend == "cpu"
    if kernel_impl == "pallas":  # Mosaic's may be a plgpu.InterpretGPUParams
      kernel_interpret = bool(kernel_interpret)
    resolved.append((kernel_impl, kernel_interpret))
  return tuple(resolved)


# Set only while `paged_kv.model.contract.check_model` traces a model: each call then
# hands its `layer` to the probe, which leaves a marker in the traced program.
LAYER_PROBE: contextvars.ContextVar = contextvars.ContextVar("paged_kv_layer_probe",
                                                            default=None)


def paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    pages: KVPages,
    layer: int | jax.Array,
    meta: StepMetadata,
    *,
    impl: str | None = None,
    interpret=None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    mixed_launches: int = 2,
    prefill_impl: str | None = None,
) -> tuple[KVPages, jax.Array]:  # (pages, [T, num_q_heads, head_dim] in q.dtype)
  """Writes the step's new K/V of one layer, then attends, for a mixed ragged batch.

  Token t of row b at position p attends causally to its row's tokens `0..p`;
  padding and failed rows give 0, and a decode-only step never traces the prefill
  kernel. Call it inside the jitted step with the pool donated and put the
  returned pages back. `q: [T, Hq, D]` (RoPE applied), `k, v: [T, Hkv, D]` (cast
  to the pages' dtype); `layer` an int (range-checked), a traced scalar or a scan
  index (clipped by the kernels). `impl` as given, or None: `default_impl` per
  kernel and shape; `prefill_impl` overrides it for the prefill kernel;
  `num_splits` None: from the shapes; `mixed_launches` 2 or 1 (module docstring).

  Returns `(pages, out [T, Hq, D])` in `q.dtype`. Raises `InvalidArgument` for
  mismatched shapes, an unknown `impl` or a layer out of range.
  """
  num_layers, num_kv_heads, _, _, head_dim = pages.k.shape
  q = jnp.asarray(q)  # a numpy q cannot be indexed by a traced array (scan bodies)
  t = meta.num_tokens
  if q.ndim != 3 or q.shape[0] != t or q.shape[2] != head_dim:
    raise InvalidArgument(f"q must be [T={t}, num_q_heads, head_dim={head_dim}], got {q.shape}")
  want = (t, num_kv_heads, head_dim)
  if k.shape != want or v.shape != want:
    raise InvalidArgument(f"k and v must be {list(want)} [T, num_kv_heads, head_dim], got "
                          f"{list(k.shape)} and {list(v.shape)}")
  if q.shape[1] % num_kv_heads:
    raise InvalidArgument(f"num_q_heads={q.shape[1]} is not a multiple of "
                          f"num_kv_heads={num_kv_heads}")
  if isinstance(layer, int) and not 0 <= layer < num_layers:
    raise InvalidArgument(f"layer {layer} outside [0, {num_layers})")
  if mixed_launches not in (1, 2):
    raise InvalidArgument(f"mixed_launches must be 1 or 2, got {mixed_launches!r}")
  (decode_impl, decode_interpret), (prefill_impl, prefill_interpret) = _kernel_impls(
      impl, interpret, q, pages, meta.seg_block.shape[1], prefill_impl)
  kernel_args = dict(sm_scale=sm_scale, soft_cap=soft_cap, layer=layer)
  probe = LAYER_PROBE.get()
  if probe is not None:
    probe(layer)

  pages = write_kv(pages, layer, meta.slot_mapping, k.astype(pages.k.dtype),
                   v.astype(pages.v.dtype))
  q_lens = meta.q_lens
  is_decode = q_lens == 1
  first = jnp.clip(meta.cu_q_lens[:-1], 0, t - 1)  # each row's first token
  tables = (meta.seg_block, meta.seg_start, meta.seg_length)
  if meta.max_query_len > 1 and mixed_launches == 1:  # every row, one launch
    out = prefill_kernels.prefill_attention(
        q, pages.k, pages.v, meta.cu_q_lens, *tables, meta.num_segments,
        impl=prefill_impl, interpret=prefill_interpret, **kernel_args)
    return pages, out
  # The stacked pages and the layer, never `pages.k[layer]` (a copy of the layer).
  out_decode = decode_kernels.decode_attention(
      q[first], pages.k, pages.v, *tables, jnp.where(is_decode, meta.num_segments, 0),
      impl=decode_impl, interpret=decode_interpret, num_splits=num_splits,
      **kernel_args)  # [B, num_q_heads, head_dim]
  if meta.max_query_len == 1:
    out = jnp.zeros(q.shape, q.dtype)
  else:
    out = prefill_kernels.prefill_attention(
        q, pages.k, pages.v, meta.cu_q_lens, *tables,
        jnp.where(q_lens > 1, meta.num_segments, 0), impl=prefill_impl,
        interpret=prefill_interpret, **kernel_args)
  out = out.at[jnp.where(is_decode, first, t)].set(out_decode.astype(q.dtype), mode="drop")
  return pages, out
