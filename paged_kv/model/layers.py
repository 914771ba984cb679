"""Flax NNX layers a model author builds on: `PagedAttention`, RoPE, the dense reference.

    attn = PagedAttention(d_model, num_q_heads, num_kv_heads, head_dim, layer=i, rngs=rngs)
    pages, y = attn(x, pages, meta)          # x: [T, d_model] ragged tokens of the step
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from paged_kv.model.nnx_import import nnx

from paged_kv.core.errors import InvalidArgument
from paged_kv.core.state import KVPages
from paged_kv.model.attention import paged_attention
from paged_kv.model.metadata import StepMetadata
from paged_kv.model.rope import RopeScaling, inverse_frequencies


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float,
               scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding of `x [..., heads, head_dim]` at `positions` ("rotate half"), in float32.

  `scaling` is an optional `RopeScaling`; its frequencies are a constant of the
  program. Returns `x` rotated, same shape and dtype.
  """
  half = x.shape[-1] // 2
  if scaling is None:
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  else:
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1], theta=theta, scaling=scaling))
  angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., half]
  cos = jnp.cos(angle)[..., None, :]
  sin = jnp.sin(angle)[..., None, :]
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                     k_pos: jax.Array, k_valid: jax.Array, *, sm_scale: float | None = None,
                     soft_cap: float | None = None) -> jax.Array:
  """Masked GQA softmax attention over explicit K/V, in float32 (the dense reference).

  `q: [B, T, Hq, D]`, `k, v: [B, L, Hkv, D]`; key `j` is visible to query `i` iff
  `k_valid[j] and k_pos[j] <= q_pos[i]`. Returns `[B, T, Hq, D]` in `q.dtype`, 0
  for a query that sees no key.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  logits = jnp.einsum("bthgd,blhd->bhgtl", qg, k.astype(jnp.float32)) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, L]
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  o = jnp.einsum("bhgtl,blhd->bthgd", p, v.astype(jnp.float32))
  return o.reshape(b, t, hq, d).astype(q.dtype)


def fan_in_init(fan_in: int) -> Callable:
  """Normal initialiser with standard deviation `1/sqrt(fan_in)`."""
  return jax.nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


class PagedAttention(nnx.Module):
  """GQA self-attention over a paged pool: project, RoPE, write K/V + attend, project out.

  `layer` is this layer's pool index, or None when each call names it (a scanned
  decoder). `activation_sharding`: on a head-sharded pool, a replicated sharding
  keeps the projections whole on every device (bit-equal to one device); None
  lets the compiler split them (~1 ulp apart).
  """

  def __init__(self, d_model: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
               layer: int | None, rngs: nnx.Rngs, rope_theta: float = 10000.0,
               rope_scaling: RopeScaling | None = None,
               dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype | None = None,
               sm_scale: float | None = None, soft_cap: float | None = None,
               qkv_bias: bool = False, out_bias: bool = False):
    """Builds the projections; `num_q_heads` a multiple of `num_kv_heads`, `head_dim` even (RoPE).

    `layer` in `[0, num_layers)`, or None: each call names it. `param_dtype`
    defaults to `dtype`; `sm_scale`, `soft_cap` as in `paged_attention`.
    """
    if num_q_heads % num_kv_heads:
      raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                       f"num_kv_heads={num_kv_heads}")
    if head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if layer is not None and (not isinstance(layer, int) or layer < 0):
      raise ValueError(f"layer must be an int >= 0 or None, got {layer!r}")
    if rope_scaling is not None and not isinstance(rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling must be a RopeScaling or None, got {rope_scaling!r}")
    param_dtype = dtype if param_dtype is None else param_dtype
    lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, kernel_init=fan_in_init(i),
                                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
    self.layer = layer
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling
    self.sm_scale, self.soft_cap = sm_scale, soft_cap
    self.wq = lin(d_model, num_q_heads * head_dim, qkv_bias)
    self.wk = lin(d_model, num_kv_heads * head_dim, qkv_bias)
    self.wv = lin(d_model, num_kv_heads * head_dim, qkv_bias)
    self.wo = lin(num_q_heads * head_dim, d_model, out_bias)
    self.activation_sharding = None

  def project(self, x: jax.Array,
              positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x [..., d_model]` to `q [..., Hq, D]`, `k, v [..., Hkv, D]`, RoPE at `positions`."""
    lead = x.shape[:-1]
    q = self.wq(x).reshape(lead + (self.num_q_heads, self.head_dim))
    k = self.wk(x).reshape(lead + (self.num_kv_heads, self.head_dim))
    v = self.wv(x).reshape(lead + (self.num_kv_heads, self.head_dim))
    q = apply_rope(q, positions, theta=self.rope_theta, scaling=self.rope_scaling)
    k = apply_rope(k, positions, theta=self.rope_theta, scaling=self.rope_scaling)
    return q, k, v

  def __call__(self, x: jax.Array, pages: KVPages, meta: StepMetadata, *,
               layer: int | jax.Array | None = None, impl: str | None = None,
               interpret=None) -> tuple[KVPages, jax.Array]:
    """Attention of the step's ragged tokens `x [T, d_model]`: `(pages, y [T, d_model])`.

    `layer` (an int or traced scalar, e.g. a scan index) overrides `self.layer`;
    `impl`, `interpret` as in `paged_attention`. Raises `InvalidArgument` when no
    layer is given here or in the constructor.
    """
    layer = self.layer if layer is None else layer
    if layer is None:
      raise InvalidArgument("PagedAttention(layer=None) needs layer= at each call")
    q, k, v = self.project(x, meta.positions)
    if self.activation_sharding is not None:
      q, k, v = (jax.lax.with_sharding_constraint(t, self.activation_sharding) for t in (q, k, v))
    pages, o = paged_attention(q, k, v, pages, layer, meta, impl=impl, interpret=interpret,
                               sm_scale=self.sm_scale, soft_cap=self.soft_cap)
    if self.activation_sharding is not None:
      o = jax.lax.with_sharding_constraint(o, self.activation_sharding)
    return pages, self.wo(o.reshape(x.shape[0], -1))

  def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Reference without a cache: causal attention within each row of `x [B, T, d_model]`."""
    q, k, v = self.project(x, positions)
    o = causal_attention(q, k, v, positions, positions, valid, sm_scale=self.sm_scale,
                         soft_cap=self.soft_cap)
    return self.wo(o.reshape(x.shape[:2] + (-1,)))
