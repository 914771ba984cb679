"""A Llama-family decoder in Flax NNX over a `paged_kv` pool: the reference model.

RMSNorm, rotary position embeddings (RoPE) on *logical* token positions, grouped
query attention (GQA) through `paged_kv.model.PagedAttention`, a SwiGLU MLP, tied
or untied embeddings. Weights are seeded random (`TinyLlama(config,
rngs=nnx.Rngs(seed))`) unless trained (`examples/train_tiny.py`); the equivalence
tests need no training. With random weights the output head is untied by default:
a tied random embedding makes the model copy its input token forever, which would
hide attention bugs, while an untied one gives varied, context-dependent greedy text.

The layers are scanned by default (`LlamaConfig.scan_layers`): one `DecoderBlock`
whose parameters are stacked on a leading layer axis (`[num_layers, ...]` each,
built by `nnx.vmap` over split rngs), run by `lax.scan`. Every program then
holds one layer's body, so compile time stays flat in depth; the pages ride in
the scan's carry and layer l writes and reads its slice in place (the kernels
take the stacked pages and the scan index, never `pages.k[l]`). With
`scan_layers=False` the layers are `num_layers` modules unrolled in Python, the
same weights in another layout (`convert_layers` moves between the two) and the
same outputs.

Two ways to run the same weights:

  * `model(tokens, pages, meta)`: a step's ragged tokens `i32[T]` (prefill chunks
    and decode tokens together) through the pool; every layer writes its K/V and
    attends through `paged_attention`. The jitted steps are in `paged_kv.model.steps`.
  * `model.dense(tokens, positions, valid)` / `dense_forward(model, tokens, lengths)`:
    the no-cache reference over padded `[B, T]` rows (tests, training).

Usage:
  from paged_kv.model import llama
  model = llama.TinyLlama(llama.LlamaConfig(), rngs=nnx.Rngs(0))
  logits = llama.dense_forward(model, tokens, lengths)   # [B, T, vocab]
  pool_config = llama.pool_config_for(model.config, num_blocks=256)
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
    rope_scaling: optional `paged_kv.model.rope.RopeScaling` ("linear", "llama3").
    attention_bias: q, k and v projections have a bias (Qwen2; Llama's
      `attention_bias` sets this and `attention_out_bias`).
    attention_out_bias: the output projection has a bias.
    scan_layers: the layers are one module with stacked parameters run by
      `lax.scan` (compile time flat in depth); False: `num_layers` modules
      unrolled into every program.

  The defaults are the tiny model of the tests; `paged_kv.model.hf_checkpoint`
  builds one from a Hugging Face `config.json`.
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
  """Pre-norm residual block: `PagedAttention` then SwiGLU.

  `layer` is the block's pool layer, or None for the stacked block of a scanned
  decoder (each call then passes `layer=`).
  """

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
  """`config.num_layers` blocks as one `DecoderBlock` (`layer=None`) whose every
  parameter has a leading layer axis, each layer initialised from its own split
  of `rngs`."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> DecoderBlock:
    return DecoderBlock(config, layer=None, rngs=rngs)

  return make(rngs)


class TinyLlama(nnx.Module):
  """The decoder: `model(tokens, pages, meta) -> (pages, logits)`, or `model.dense(...)`.

  Attributes:
    layers: with `config.scan_layers`, one `DecoderBlock` of stacked parameters
      (`stacked_blocks`); else an `nnx.List` of `num_layers` blocks. `block(i)`
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
    """One forward pass of a step's ragged tokens through the pool.

    Args:
      tokens: `i32[T]` the step's new tokens, ragged per `meta.cu_q_lens` (any
        value in `[0, vocab)` for padding).
      pages: the pool's pages; every layer writes its new K/V into them.
      meta: the step's `StepMetadata`.
      impl, interpret: attention kernel choice (see `paged_attention`).
      logits_indices: optional `i32[R]` token indices in `[0, T)`: the final norm
        and the output head run on those tokens' hidden states only (the steps
        pass each row's last token, `R = B`). None: every token's.

    Returns:
      `(pages, logits f32[T, vocab])`, or `f32[R, vocab]` with `logits_indices`.
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
    """The no-cache reference: causal attention within each row.

    Args:
      tokens: `i32[B, T]` token ids.
      positions: `i32[B, T]` logical position of each token.
      valid: `bool[B, T]` tokens that exist (keys beyond are masked).

    Returns:
      `logits f32[B, T, vocab]`.
    """
    x = self._embed(tokens)
    if self.config.scan_layers:
      return self._logits(self._scan(lambda block, _, x: block.dense(x, positions, valid), x))
    for block in self.layers:
      x = block.dense(x, positions, valid)
    return self._logits(x)

  def block(self, i: int) -> DecoderBlock:
    """Layer `i` as a `DecoderBlock` of its own (pool layer `i`).

    Unrolled: the model's own block. Scanned: a new block holding layer `i`'s
    slice of the stacked parameters (copies; for references and tests).
    """
    if not isinstance(i, int) or not 0 <= i < self.config.num_layers:
      raise IndexError(f"layer {i!r} outside [0, {self.config.num_layers})")
    if not self.config.scan_layers:
      return self.layers[i]
    graphdef, params = nnx.split(self.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params))
    block.attn.layer = i
    return block

  def _scan(self, layer_step, carry):
    """`carry = layer_step(block, layer, carry)` for every layer in order, as one
    `lax.scan` over the stacked parameters (`layer`: the traced index)."""
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
  return model.dense(tokens, positions, positions < lengths[:, None])


def convert_layers(model: TinyLlama, *, scan_layers: bool) -> TinyLlama:
  """`model`'s weights in the scanned (`scan_layers`) or unrolled layout.

  A new model (stacked or unstacked copies of the layer weights, the others
  shared), or `model` itself when it already has that layout. Attributes set
  after construction (e.g. `PagedAttention.activation_sharding`) are not carried.
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
