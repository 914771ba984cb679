"""`paged_attention`: write a step's new K/V into the pool and attend, mixed batch.

One call per layer serves a ragged batch of prefill chunks and decode tokens
(`StepMetadata`): rows with one new token go to the decode kernel
(`pallas_kernels.paged_attention`), rows with more to the prefill kernel with a
cached prefix (`pallas_kernels.prefill_attention`); both read the rows' segment
tables, which already hold this step's tokens (written first, by `write_kv`).

Kernel choice (`impl=`): `None` resolves through `default_impl()`, the one place
that maps a backend to its attention path.
"""

from __future__ import annotations

import functools
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
_DEFAULTS = {"cpu": "xla", "gpu": "pallas", "cuda": "pallas", "rocm": "pallas"}


def default_impl(backend: str | None = None) -> str:
  """The attention path used when `impl=None`, for `backend` (default: the platform
  being traced for, `pallas_kernels.lowering.target_platform()`: JAX's default
  backend, or the device of an entered abstract mesh, as in the lowering tier).

  * `"cpu"`: `"xla"`, the gather + masked-softmax path (verified by the
    equivalence tests; the Pallas kernels would only run in interpret mode).
  * a GPU (`"cuda"`, `"rocm"`, `"gpu"`): `"pallas"`, the generic (Triton-lowered)
    Pallas kernels, the one path that exists for both decode and prefill.
    **Unmeasured**: no attention path has been timed or verified on a GPU yet
    (the Mosaic GPU kernel exists for decode only). The slow `"xla"` path is never
    picked silently on a GPU; pass `impl="xla"` to ask for it.
  * any other backend: `InvalidArgument` (pass `impl=` explicitly).
  """
  backend = lowering.target_platform() if backend is None else backend
  if backend not in _DEFAULTS:
    raise InvalidArgument(f"no verified attention path for the {backend!r} backend; pass "
                          f"impl= explicitly (one of {IMPLS}; 'xla' is portable but slow)")
  return _DEFAULTS[backend]


def resolve_impl(impl: str | None, interpret=None):
  """`(impl, interpret)` with defaults filled: `default_impl()`, and interpret mode for
  a Pallas path on CPU (the only way it runs there)."""
  impl = default_impl() if impl is None else impl
  if impl not in IMPLS:
    raise InvalidArgument(f"impl must be one of {IMPLS} or None, got {impl!r}")
  if interpret is None:
    interpret = impl != "xla" and lowering.target_platform() == "cpu"
  return impl, interpret


@functools.lru_cache(maxsize=None)
def _warn_mosaic_prefill() -> None:
  warnings.warn("paged_attention(impl='mosaic'): there is no Mosaic GPU prefill kernel; "
                "prefill rows run the generic Pallas kernel", stacklevel=3)


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

  Args:
    q: queries of the new tokens (RoPE applied), ragged per `meta.cu_q_lens`.
    k, v: their keys and values; cast to the pages' dtype for the write.
    pages: the pool's pages (all layers).
    layer: which layer's pages (a Python int is range-checked).
    meta: the step's `StepMetadata`.
    impl: `"xla"`, `"pallas"` or `"mosaic"` (decode only; prefill rows then run
      `"pallas"`, with a warning); `None`: `default_impl()`.
    interpret: run Pallas kernels in interpret mode; `None`: on CPU only.
    sm_scale: logit scale, default `1/sqrt(head_dim)`.
    soft_cap: optional tanh cap of the logits.

  Returns:
    `(pages, out)`: the updated pages and the attention output of every token.

  Raises:
    InvalidArgument: shapes that do not match each other, the pages or `meta`,
      an unknown `impl`, a layer out of range.
  """
  num_layers, num_kv_heads, _, _, head_dim = pages.k.shape
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
  impl, interpret = resolve_impl(impl, interpret)
  kernel_args = dict(sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)

  pages = write_kv(pages, layer, meta.slot_mapping, k.astype(pages.k.dtype),
                   v.astype(pages.v.dtype))
  k_pages, v_pages = pages.k[layer], pages.v[layer]
  q_lens = meta.q_lens
  is_decode = q_lens == 1
  first = jnp.clip(meta.cu_q_lens[:-1], 0, t - 1)  # each row's first token
  tables = (meta.seg_block, meta.seg_start, meta.seg_length)
  out_decode = decode_kernels.paged_attention(
      q[first], k_pages, v_pages, *tables, jnp.where(is_decode, meta.num_segments, 0),
      impl=impl, **kernel_args)  # [B, num_q_heads, head_dim]
  if meta.max_query_len == 1:
    out = jnp.zeros(q.shape, q.dtype)
  else:
    prefill_impl, prefill_args = impl, kernel_args
    if impl == "mosaic":
      _warn_mosaic_prefill()
      # The generic kernel's interpret mode is a bool (Mosaic's may be InterpretGPUParams).
      prefill_impl, prefill_args = "pallas", dict(kernel_args, interpret=bool(interpret))
    out = prefill_kernels.prefill_attention(
        q, k_pages, v_pages, meta.cu_q_lens, *tables,
        jnp.where(q_lens > 1, meta.num_segments, 0), impl=prefill_impl, **prefill_args)
  out = out.at[jnp.where(is_decode, first, t)].set(out_decode.astype(q.dtype), mode="drop")
  return pages, out
