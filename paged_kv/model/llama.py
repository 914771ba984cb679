"""A Llama-family decoder in Flax NNX over a `paged_kv` pool: the reference model.

RMSNorm, RoPE on logical positions, GQA through `PagedAttention`, SwiGLU. A
random model's head is untied by default: a tied random embedding copies its
input forever and would hide attention bugs. Layers are scanned by default
(compile time flat in depth); `model.dense` / `dense_forward` are the no-cache
reference. The layouts: `docs/model.md`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from paged_kv.model.nnx_import import nnx

from paged_kv.core.config import PoolConfig
from paged_kv.core.state import KVPages
from paged_kv.model.layers import PagedAttention, fan_in_init
from paged_kv.model.metadata import StepMetadata
from paged_kv.model.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes of the decoder (frozen, hashable: part of the graph definition).

  The defaults are the tests' tiny model. `vocab_size` 256 is one token per byte;
  `num_q_heads` is a multiple of `num_kv_heads`; `head_dim` is even;
  `attention_bias` gives q/k/v biases (Qwen2), `attention_out_bias` the output's;
  `scan_layers` False unrolls the layers.
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
  rope_scaling: RopeScaling | None = None
  attention_bias: bool = False
  attention_out_bias: bool = False
  scan_layers: bool = True

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
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)


def pool_config_for(model_config: LlamaConfig, **pool_kwargs) -> PoolConfig:
  """A `PoolConfig` whose layers, kv heads, head_dim and dtype match the model."""
  return PoolConfig(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                    head_dim=model_config.head_dim, dtype=model_config.dtype, **pool_kwargs)


def check_pool_matches_model(pool_config: PoolConfig, model_config: LlamaConfig) -> None:
  """Raises ValueError unless the pool holds this model's layers, kv heads and head_dim."""
  if (pool_config.num_layers, pool_config.num_kv_heads, pool_config.head_dim) != (
      model_config.num_layers, model_config.num_kv_heads, model_config.head_dim):
    raise ValueError(f"pool config {pool_config} does not match model config {model_config}")


class RMSNorm(nnx.Module):
  """`x / rms(x) * weight`, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (xf * inv).astype(x.dtype) * self.weight[...]


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    c, dt = config, config.jnp_dtype
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, kernel_init=fan_in_init(i), dtype=dt,
                                  param_dtype=dt, rngs=rngs)
    self.gate = lin(c.d_model, c.ffn_dim)
    self.up = lin(c.d_model, c.ffn_dim)
    self.down = lin(c.ffn_dim, c.d_model)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: `PagedAttention` then SwiGLU (`layer` None when stacked)."""

  def __init__(self, config: LlamaConfig, *, layer: int | None, rngs: nnx.Rngs):
    c, dt = config, config.jnp_dtype
    self.attn_norm = RMSNorm(c.d_model, eps=c.norm_eps, dtype=dt)
    self.attn = PagedAttention(c.d_model, c.num_q_heads, c.num_kv_heads, c.head_dim, layer=layer,
                               rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, dtype=dt,
                               qkv_bias=c.attention_bias, out_bias=c.attention_out_bias,
                               rngs=rngs)
    self.mlp_norm = RMSNorm(c.d_model, eps=c.norm_eps, dtype=dt)
    self.mlp = SwiGLU(c, rngs=rngs)

  def __call__(self, x: jax.Array, pages: KVPages, meta: StepMetadata, *,
               layer: int | jax.Array | None = None, impl: str | None = None,
               interpret=None) -> tuple[KVPages, jax.Array]:
    pages, h = self.attn(self.attn_norm(x), pages, meta, layer=layer, impl=impl,
                         interpret=interpret)
    return pages, self._mlp(x + h)

  def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    return self._mlp(x + self.attn.dense(self.attn_norm(x), positions, valid))

  def _mlp(self, x: jax.Array) -> jax.Array:
    return x + self.mlp(self.mlp_norm(x))


def stacked_blocks(config: LlamaConfig, *, rngs: nnx.Rngs) -> DecoderBlock:
  """`config.num_layers` blocks as one `DecoderBlock` of stacked parameters, split `rngs` each."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> DecoderBlock:
    return DecoderBlock(config, layer=None, rngs=rngs)

  return make(rngs)


class TinyLlama(nnx.Module):
  """The decoder: `model(tokens, pages, meta) -> (pages, logits)`, or `model.dense(...)`.

  `layers` is one stacked `DecoderBlock` (scanned) or an `nnx.List`; `block(i)`
  gives layer i in either layout.
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dt, param_dtype=dt,
                           embedding_init=jax.nn.initializers.normal(stddev=1.0), rngs=rngs)
    if config.scan_layers:
      self.layers = stacked_blocks(config, rngs=rngs)
    else:
      self.layers = nnx.List([DecoderBlock(config, layer=i, rngs=rngs)
                              for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dt)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                kernel_init=fan_in_init(config.d_model), dtype=dt,
                                param_dtype=dt, rngs=rngs)

  def __call__(self, tokens: jax.Array, pages: KVPages, meta: StepMetadata, *,
               impl: str | None = None, interpret=None,
               logits_indices: jax.Array | None = None) -> tuple[KVPages, jax.Array]:
    """One forward pass of a step's ragged tokens `i32[T]`: `(pages, logits f32[T, vocab])`.

    With `logits_indices: i32[R]` the final norm and head run on those tokens only
    and logits are `f32[R, vocab]`. `impl`, `interpret` as in `paged_attention`.
    """
    x = self._embed(tokens)
    if self.config.scan_layers:

      def layer_step(block, layer, carry):
        x, pages = carry
        pages, x = block(x, pages, meta, layer=layer, impl=impl, interpret=interpret)
        return x, pages

      x, pages = self._scan(layer_step, (x, pages))
    else:
      for block in self.layers:
        pages, x = block(x, pages, meta, impl=impl, interpret=interpret)
    if logits_indices is not None:
      x = x[logits_indices]  # [R, d_model]: gathered before the norm and the head
    return pages, self._logits(x)

  def dense(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """The no-cache reference: `logits f32[B, T, vocab]`, causal within each row."""
    x = self._embed(tokens)
    if self.config.scan_layers:
      return self._logits(self._scan(lambda block, _, x: block.dense(x, positions, valid), x))
    for block in self.layers:
      x = block.dense(x, positions, valid)
    return self._logits(x)

  def block(self, i: int) -> DecoderBlock:
    """Layer `i` as a `DecoderBlock` of its own (a copy of its slice when scanned)."""
    if not isinstance(i, int) or not 0 <= i < self.config.num_layers:
      raise IndexError(f"layer {i!r} outside [0, {self.config.num_layers})")
    if not self.config.scan_layers:
      return self.layers[i]
    graphdef, params = nnx.split(self.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params))
    block.attn.layer = i
    return block

  def _scan(self, layer_step, carry):
    """`carry = layer_step(block, layer, carry)` for every layer in order, as one `lax.scan`."""
    graphdef, params = nnx.split(self.layers)

    def body(carry, xs):
      layer_params, layer = xs
      return layer_step(nnx.merge(graphdef, layer_params), layer, carry), None

    layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(body, carry, (params, layers))
    return carry

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return self.embed(jnp.clip(tokens, 0, self.config.vocab_size - 1))

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32)


@nnx.jit
def dense_forward(model: TinyLlama, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """Reference logits `f32[B, T, vocab]` of whole sequences from position 0, no cache.

  Entries at `t >= lengths[b]` are meaningless.
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return model.dense(tokens, positions, positions < lengths[:, None])


def convert_layers(model: TinyLlama, *, scan_layers: bool) -> TinyLlama:
  """`model`'s weights in the scanned or unrolled layout (a new model, or `model` if already so).

  Attributes set after construction (e.g. `activation_sharding`) are not carried.
  """
  if model.config.scan_layers == scan_layers:
    return model
  config = dataclasses.replace(model.config, scan_layers=scan_layers)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TinyLlama(config, rngs=nnx.Rngs(0))))
  source = dict(nnx.to_flat_state(nnx.state(model)))
  values = []
  for path, var in nnx.to_flat_state(abstract):
    if path[0] != "layers":
      value = source[path].get_value()
    elif scan_layers:  # ("layers", *rest) <- ("layers", i, *rest)
      value = jnp.stack([source[("layers", i) + path[1:]].get_value()
                         for i in range(config.num_layers)])
    else:  # ("layers", i, *rest) <- ("layers", *rest)[i]
      value = source[("layers",) + path[2:]].get_value()[path[1]]
    values.append((path, var.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(values))
