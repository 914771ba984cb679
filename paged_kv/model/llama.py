"""A tiny Llama-style decoder in Flax NNX, with a pluggable attention core.

RMSNorm, rotary position embeddings (RoPE) on *logical* token positions, grouped
query attention (GQA), a SwiGLU MLP, tied or untied embeddings. Weights are
seeded random (`TinyLlama(config, rngs=nnx.Rngs(seed))`) unless trained with
`examples/train_tiny.py`; the equivalence tests need no training. With random
weights the output head is untied by default: a tied random embedding makes the
model copy its input token forever, which would hide attention bugs, while an
untied one gives varied, context-dependent greedy text.

The model does not own a cache. `TinyLlama.__call__` takes an *attention
function* `attend(layer, q, k, v, carry) -> (out, carry)`:

  * `dense_attend` (this file) is the reference: full causal attention over the
    contiguous K/V of the chunk itself (the whole sequence, no cache);
  * `examples/model_runner.py` passes a paged one that writes K/V into a
    `paged_kv` pool with `write_kv` and attends over the pool's pages through
    the segment table (the `carry` is the pool's `KVPages`).

Usage (as a library; this file has no `main`):
  sys.path.insert(0, "examples"); import tiny_llama
  model = tiny_llama.TinyLlama(tiny_llama.LlamaConfig(), rngs=nnx.Rngs(0))
  logits = tiny_llama.dense_forward(model, tokens, lengths)   # [B, T, vocab]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

# `attend(layer, q, k, v, carry) -> (out, carry)`: q `[B, T, num_q_heads, head_dim]`,
# k, v `[B, T, num_kv_heads, head_dim]` (RoPE applied), out like q.
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes of the tiny decoder (frozen, hashable: part of the NNX graph definition).

  Attributes:
    vocab_size: tokens; 256 = one token per byte.
    d_model: residual width.
    num_layers: decoder blocks.
    num_q_heads: query heads.
    num_kv_heads: key/value heads; `num_q_heads` is a multiple of it (GQA).
    head_dim: size of one head (even, for RoPE).
    ffn_dim: hidden width of the SwiGLU MLP.
    rope_theta: RoPE base.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the output head is the transposed input embedding.
    dtype: activation and parameter dtype (`"float32"` for the equivalence tests).
  """

  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_q_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  ffn_dim: int = 128
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_q_heads", "num_kv_heads",
                 "head_dim", "ffn_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)


def _dense_init(fan_in: int) -> Callable:
  return jax.nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


class RMSNorm(nnx.Module):
  """`x / rms(x) * weight`, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (xf * inv).astype(x.dtype) * self.weight[...]


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
  """Rotary embedding ("rotate half" layout).

  Args:
    x: `[B, T, heads, head_dim]`.
    positions: `i32[B, T]` logical position of each token in its sequence.
    theta: RoPE base.

  Returns:
    `x` rotated, same shape and dtype.
  """
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
  cos = jnp.cos(angle)[:, :, None, :]
  sin = jnp.sin(angle)[:, :, None, :]
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _linear(config: "LlamaConfig", fan_in: int, fan_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free projection in the model's dtype."""
  return nnx.Linear(fan_in, fan_out, use_bias=False, kernel_init=_dense_init(fan_in),
                    dtype=config.jnp_dtype, param_dtype=config.jnp_dtype, rngs=rngs)


class Attention(nnx.Module):
  """GQA projections and RoPE; the attention core itself is the `attend` function."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c = config
    lin = lambda i, o: _linear(c, i, o, rngs)
    self.config = c
    self.wq = lin(c.d_model, c.num_q_heads * c.head_dim)
    self.wk = lin(c.d_model, c.num_kv_heads * c.head_dim)
    self.wv = lin(c.d_model, c.num_kv_heads * c.head_dim)
    self.wo = lin(c.num_q_heads * c.head_dim, c.d_model)

  def __call__(self, x: jax.Array, positions: jax.Array, layer: int, attend: AttendFn,
               carry: Any) -> tuple[jax.Array, Any]:
    c = self.config
    b, t, _ = x.shape
    q = self.wq(x).reshape(b, t, c.num_q_heads, c.head_dim)
    k = self.wk(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.wv(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    q = apply_rope(q, positions, theta=c.rope_theta)
    k = apply_rope(k, positions, theta=c.rope_theta)
    o, carry = attend(layer, q, k, v, carry)
    return self.wo(o.reshape(b, t, c.num_q_heads * c.head_dim)), carry


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c = config
    lin = lambda i, o: _linear(c, i, o, rngs)
    self.gate = lin(c.d_model, c.ffn_dim)
    self.up = lin(c.d_model, c.ffn_dim)
    self.down = lin(c.ffn_dim, c.d_model)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: attention then SwiGLU."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dt)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dt)
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, layer: int, attend: AttendFn,
               carry: Any) -> tuple[jax.Array, Any]:
    h, carry = self.attn(self.attn_norm(x), positions, layer, attend, carry)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), carry


class TinyLlama(nnx.Module):
  """The decoder. `__call__(tokens, positions, attend, carry) -> (logits, carry)`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dt, param_dtype=dt,
                           embedding_init=jax.nn.initializers.normal(stddev=1.0), rngs=rngs)
    self.layers = nnx.List([DecoderBlock(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dt)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                kernel_init=_dense_init(config.d_model), dtype=dt,
                                param_dtype=dt, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn,
               carry: Any = None) -> tuple[jax.Array, Any]:
    """Runs the decoder on a chunk of tokens.

    Args:
      tokens: `i32[B, T]` token ids (any value in `[0, vocab)` for padding).
      positions: `i32[B, T]` logical position of each token in its sequence.
      attend: the attention core, called once per layer in order.
      carry: threaded through `attend` (the paged path's `KVPages`).

    Returns:
      `(logits f32[B, T, vocab], carry)`.
    """
    x = self.embed(jnp.clip(tokens, 0, self.config.vocab_size - 1))
    for layer, block in enumerate(self.layers):
      x, carry = block(x, positions, layer, attend, carry)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), carry


# Dense reference ------------------------------------------------------------------


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                     k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
  """Masked GQA softmax attention over explicit K/V, in float32.

  Args:
    q: `[B, T, num_q_heads, D]`.
    k, v: `[B, L, num_kv_heads, D]`.
    q_pos: `i32[B, T]` logical positions of the queries.
    k_pos: `i32[B, L]` logical positions of the keys.
    k_valid: `bool[B, L]` keys that exist.

  Returns:
    `[B, T, num_q_heads, D]` in `q.dtype`; a query that sees no key gets 0.
    Key `j` is visible to query `i` iff `k_valid[j] and k_pos[j] <= q_pos[i]`.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
  logits = jnp.einsum("bthgd,blhd->bhgtl", qg, k.astype(jnp.float32)) / math.sqrt(d)
  mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, L]
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  o = jnp.einsum("bhgtl,blhd->bthgd", p, v.astype(jnp.float32))
  return o.reshape(b, t, hq, d).astype(q.dtype)


def dense_attend(positions: jax.Array, valid: jax.Array) -> AttendFn:
  """The reference attention core: causal attention within the chunk (no cache)."""

  def attend(layer, q, k, v, carry):
    del layer
    return causal_attention(q, k, v, positions, positions, valid), carry

  return attend


@nnx.jit
def dense_forward(model: TinyLlama, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """Reference logits of whole sequences, no cache.

  Args:
    model: the decoder.
    tokens: `i32[B, T]`, each row a sequence from position 0, padded at the end.
    lengths: `i32[B]` valid tokens per row.

  Returns:
    `f32[B, T, vocab]`; row b's entries `t < lengths[b]` are the model's logits
    after token t (later entries are meaningless).
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid = positions < lengths[:, None]
  logits, _ = model(tokens, positions, dense_attend(positions, valid))
  return logits
