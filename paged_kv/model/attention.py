"""`paged_attention`: write a step's new K/V into the pool and attend, mixed batch.

One call per layer serves a ragged batch of prefill chunks and decode tokens
(`StepMetadata`): rows with one new token go to the decode kernel
(`pallas_kernels.paged_attention`), rows with more to the prefill kernel with a
cached prefix (`pallas_kernels.prefill_attention`); both read the rows' segment
tables, which already hold this step's tokens (written first, by `write_kv`).

Never copy the pool: both kernels get the pool's stacked pages
(`[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`) and the layer
index, never `pages.k[layer]`. That slice (static or traced layer, or a scan
over layers) is a dynamic slice of a whole layer, which XLA materialises as a
copy of the layer's K and V pool (`bf16[1, 8, 4096, 16, 128]` each, per layer,
per step) before a custom call can read it. The kernels read only the blocks
the tables name, from the stacked operand in place (how each impl takes the
layer: `pallas_kernels.paged_attention`'s module docstring).

Kernel choice (`impl=`): `None` resolves per kernel and per shape through
`default_impl(...)`, the one place that maps a backend and a shape to an
attention path; an explicit impl is used as given (and raises if it cannot
build for the shape; `"mosaic"` prefill rows fall back to `"pallas"`, with a
warning, at shapes only the decode kernel builds for).

A mixed step (decode and prefill rows) is two launches by default: the decode
kernel (with split-K) for the decode rows, then the prefill kernel for the
others, one after the other on the stream. `mixed_launches=1` runs every row
through the prefill kernel in one launch, a decode row being a one-token tile
(`pallas_kernels.prefill_attention_mosaic`), so that memory-bound decode
programs and compute-bound prefill tiles share the SMs at once; it gives up
the decode kernel's split-K (fine when decode rows x kv heads fill the GPU, as
56 x 8 do). UNMEASURED: which is faster waits on the gpu_check `mixed` rows.
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
from pallas_kernels import paged_attention as decode_kernels
from pallas_kernels import prefill_attention as prefill_kernels

IMPLS = ("xla", "pallas", "mosaic")
# The order `impl=None` tries on a GPU, first that builds for the shape wins.
# Mosaic GPU first, as issue 22 asks (the Hopper path; the Triton-based Pallas
# ops are deprecated upstream), then the Triton-lowered "pallas" kernels, then
# "xla". UNMEASURED: neither Pallas path has been timed on a GPU yet, so the
# order is configurable: `default_impl(preference=...)`, or the environment
# variable `PAGED_KV_GPU_IMPLS` (comma-separated, e.g. "pallas,mosaic,xla").
GPU_PREFERENCE = decode_kernels.GPU_DECODE_PREFERENCE  # ("mosaic", "pallas", "xla")
PREFERENCE_ENV = "PAGED_KV_GPU_IMPLS"
_GPU_BACKENDS = ("cuda", "rocm", "gpu")
_DEFAULTS = {"cpu": "xla"}
_warned: set[str] = set()


def gpu_preference(preference: tuple[str, ...] | None = None) -> tuple[str, ...]:
  """The GPU order `impl=None` tries: `preference`, else `$PAGED_KV_GPU_IMPLS`,
  else `GPU_PREFERENCE`. "xla" is appended if missing (it always builds)."""
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
  """The first impl of `order` for which `problem(impl)` is None; warns once
  (per message) naming why each one before it was skipped."""
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
  """The decode attention path used when `impl=None`, for `backend` (default:
  the platform being traced for, `pallas_kernels.lowering.target_platform()`:
  JAX's default backend, or the device of an entered abstract mesh, as in the
  lowering tier), and, given the shape, for that shape.

  * `"cpu"`: `"xla"`, the gather + masked-softmax path (verified by the
    equivalence tests; the Pallas kernels would only run in interpret mode).
  * a GPU (`"cuda"`, `"rocm"`, `"gpu"`): the first impl of the preference order
    (`gpu_preference(preference)`: by default `GPU_PREFERENCE` = Mosaic GPU,
    then the Triton-lowered `"pallas"`, then `"xla"`) that builds for the shape
    (`pallas_kernels.paged_attention.decode_impl_problem`, which matches the
    lowering tier: e.g. Mosaic needs bf16/f16 pages with q in their dtype, or fp8
    pages with bf16/f16 q, and head_dim a multiple of 64 up to 256; Triton
    power-of-two sizes), skipping an impl that builds but is known bad or
    untimed at the shape (`default_path_problem`: Mosaic at head_dim 192
    spills registers in the compile tier; Gemma's 256, two warpgroups splitting
    the head dim, does not and gets Mosaic; Mosaic with fp8 pages is untimed
    on a GPU, so fp8 gets Triton).
    Every fallback warns once, naming the reason, so a valid model shape
    (Phi-3-mini's head_dim 96 gets `"xla"`) never raises, and a slow path is
    never picked silently.
    Without the shape: the first of the order. **Unmeasured**: whether Mosaic
    beats Triton has not been timed on a GPU yet (hence the configurable order).
  * any other backend: `InvalidArgument` (pass `impl=` explicitly).

  The prefill kernel's default (`impl=None`) is picked the same way from the
  order without `"mosaic"`: the Mosaic prefill kernel runs when asked for
  (`impl="mosaic"`) until the GPU rows have timed it against Triton's.
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
  """`default_impl` for the prefill kernel: the same order without "mosaic"
  (no Mosaic prefill kernel), the Triton rules of the decode kernel (the
  default `block_q` is a power of two)."""
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
  """`(impl, interpret)` with defaults filled: `default_impl()` (without a
  shape: the backend's first choice; `paged_attention` resolves per shape),
  and interpret mode for a Pallas path on CPU (the only way it runs there)."""
  impl = default_impl() if impl is None else impl
  if impl not in IMPLS:
    raise InvalidArgument(f"impl must be one of {IMPLS} or None, got {impl!r}")
  if interpret is None:
    interpret = impl != "xla" and lowering.target_platform() == "cpu"
  return impl, interpret


def _mosaic_prefill_or_pallas(q: jax.Array, pages: KVPages, num_seg_slots: int) -> str:
  """"mosaic" if the Mosaic prefill kernel builds for this shape, else
  "pallas" (warned once, naming why)."""
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

  Token t of row b (`cu_q_lens[b] <= t < cu_q_lens[b+1]`) at logical position p
  attends causally to its row's tokens `0..p`: the cached prefix and the new tokens
  before it. Rows with one new token (decodes) run the decode kernel, the others
  the prefill kernel; when `meta.max_query_len == 1` (a decode-only step) the
  prefill kernel is not traced at all. Padding tokens and failed rows give 0.
  Each kernel takes all B rows, the other kind's with 0 segments (the Pallas
  kernels skip them; the XLA paths compute them masked).

  Meant to be called inside the model's jitted step with the pool state donated,
  so XLA writes the pages in place; hand the returned pages back into the state.
  The kernels read the stacked pages with `layer` as an operand: no copy of the
  layer's pool is made (module docstring), whether `layer` is a Python int, a
  traced scalar or a `lax.scan` index over layers.

  Args:
    q: queries of the new tokens (RoPE applied), ragged per `meta.cu_q_lens`.
    k, v: their keys and values; cast to the pages' dtype for the write.
    pages: the pool's pages (all layers).
    layer: which layer's pages (a Python int is range-checked; a traced one is
      not, and is clipped into range by the kernels).
    meta: the step's `StepMetadata`.
    impl: `"xla"`, `"pallas"` or `"mosaic"`, used as given (`"mosaic"` prefill
      rows run `"pallas"`, with a warning, where only the decode kernel
      builds); `None`: per kernel and shape, `default_impl(...)` (on a GPU the
      first of Mosaic, Triton, xla that builds for the shape, each fallback
      warned once; prefill without Mosaic).
    interpret: run Pallas kernels in interpret mode; `None`: on CPU only.
    sm_scale: logit scale, default `1/sqrt(head_dim)`.
    soft_cap: optional tanh cap of the logits.
    num_splits: the decode kernel's split-K factor; `None`: chosen from the
      static shapes (`pallas_kernels.paged_attention.default_num_splits`).
    mixed_launches: a step with prefill rows (`meta.max_query_len > 1`) runs
      the decode kernel then the prefill kernel (2), or every row through the
      prefill kernel in one launch (1; module docstring). Decode-only steps
      always run the decode kernel.
    prefill_impl: the prefill kernel's impl, used as given, when it should not
      follow `impl` (e.g. `impl="mosaic", prefill_impl="pallas"`); None: as
      `impl` resolves.

  Returns:
    `(pages, out)`: the updated pages and the attention output of every token.

  Raises:
    InvalidArgument: shapes that do not match each other, the pages or `meta`,
      an unknown `impl`, a layer out of range.
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
  out_decode = decode_kernels.paged_attention(
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
