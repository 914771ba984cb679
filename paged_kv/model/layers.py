"""Flax NNX layers a model author builds on: `PagedAttention`, RoPE, the dense reference.

`PagedAttention` is a Llama-style self-attention layer (q/k/v/o projections,
bias-free unless asked (Qwen2 has q/k/v biases), grouped-query attention, rotary
embeddings on the logical positions of `StepMetadata`, optionally scaled as in
`paged_kv.model.rope`) whose K/V live in a `paged_kv` pool:

    attn = PagedAttention(d_model, num_q_heads, num_kv_heads, head_dim, layer=i, rngs=rngs)
    pages, y = attn(x, pages, meta)          # x: [T, d_model] ragged tokens of the step

`attn.dense(x, positions, valid)` runs the same weights without a cache (full
causal attention within `[B, T]` rows): the reference for tests, and training.
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
  """Rotary embedding ("rotate half" layout: Hugging Face Llama's), in float32.

  Args:
    x: `[..., heads, head_dim]`.
    positions: `i32[...]` logical position of each token (the leading shape of `x`).
    theta: RoPE base.
    scaling: optional RoPE scaling ("linear", "llama3"); its frequencies come from
      `paged_kv.model.rope.inverse_frequencies` (a constant of the program).

  Returns:
    `x` rotated, same shape and dtype.
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

  Args:
    q: `[B, T, num_q_heads, D]`.
    k, v: `[B, L, num_kv_heads, D]`.
    q_pos: `i32[B, T]` logical positions of the queries.
    k_pos: `i32[B, L]` logical positions of the keys.
    k_valid: `bool[B, L]` keys that exist.
    sm_scale: logit scale, default `1/sqrt(D)`; soft_cap: optional tanh cap.

  Returns:
    `[B, T, num_q_heads, D]` in `q.dtype`; a query that sees no key gets 0.
    Key `j` is visible to query `i` iff `k_valid[j] and k_pos[j] <= q_pos[i]`.
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

  Attributes:
    wq, wk, wv, wo: `nnx.Linear` projections (`d_model -> heads * head_dim` and
      back); bias-free unless `qkv_bias` (wq, wk, wv) or `out_bias` (wo).
    layer: index of this layer's K/V in the pool (static), or None when each
      call names it (`layer=`: the layers of a scanned decoder share one module
      and take the scan's index).
    activation_sharding: None (default), or a sharding (static) the activations
      around the attention are constrained to: `q, k, v` after their projections
      and RoPE, and the attention output before `wo`. On a pool whose pages are
      split over kv heads (`paged_kv.parallel`), None lets the compiler split the
      projections by heads too (column-parallel q/k/v, row-parallel `wo` with an
      all-reduce), whose smaller matmuls and all-reduce round differently from
      one device (~1 ulp). A replicated `NamedSharding` computes them whole on
      every device and gathers the attention output: only the attention over
      the pages runs per shard, bit-equal to one device
      (`paged_kv.parallel.executor.ShardedModelExecutor(exact=True)`).
  """

  def __init__(self, d_model: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
               layer: int | None, rngs: nnx.Rngs, rope_theta: float = 10000.0,
               rope_scaling: RopeScaling | None = None,
               dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype | None = None,
               sm_scale: float | None = None, soft_cap: float | None = None,
               qkv_bias: bool = False, out_bias: bool = False):
    """Builds the projections.

    Args:
      d_model: residual width.
      num_q_heads: query heads, a multiple of `num_kv_heads` (GQA).
      num_kv_heads: key/value heads (the pool's `num_kv_heads`).
      head_dim: size of one head (even, for RoPE; the pool's `head_dim`).
      layer: this layer's index in the pool, `[0, num_layers)`; None: given by
        each call (`layer=`).
      rngs: parameter initialisation.
      rope_theta: RoPE base.
      rope_scaling: optional `RopeScaling` of the frequencies (`paged_kv.model.rope`).
      dtype: computation dtype; param_dtype: parameter dtype (default `dtype`).
      sm_scale, soft_cap: as in `paged_attention`.
      qkv_bias: wq, wk and wv have a bias (Qwen2); out_bias: wo has one.
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
    """Attention of the step's ragged tokens through the pool.

    Args:
      x: `[T, d_model]` the step's tokens, ragged per `meta.cu_q_lens`.
      pages: the pool's pages; this layer's new K/V are written into them.
      meta: the step's `StepMetadata` (positions for RoPE, slots, segment tables).
      layer: the pool layer to write and read (an int or a traced i32 scalar,
        e.g. a `lax.scan` index); None: `self.layer`.
      impl, interpret: kernel choice, as in `paged_attention`.

    Returns:
      `(pages, y [T, d_model])`: the pages first, as every paged_kv call returns
      its state.

    Raises:
      InvalidArgument: no layer, neither here nor in the constructor.
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
    """Reference without a cache: causal attention within each row of `x [B, T, d_model]`.

    `positions i32[B, T]` are the tokens' logical positions, `valid bool[B, T]` the
    tokens that exist.
    """
    q, k, v = self.project(x, positions)
    o = causal_attention(q, k, v, positions, positions, valid, sm_scale=self.sm_scale,
                         soft_cap=self.soft_cap)
    return self.wo(o.reshape(x.shape[:2] + (-1,)))
