"""Sampling the next token of each row inside the jitted step, and its logprobs.

`SamplingBatch` carries one set of parameters per batch row (arrays: one program
serves every mix of requests); `sample(logits, batch, num_logprobs=n)` returns the
tokens and, with `n > 0`, the sampled token's logprob and the top-`n` logprobs.

Per row, with `temperature == 0` the token is the argmax of the logits (the greedy
path, bit-equal to `argmax` alone); else the logits are divided by the temperature,
then filtered in this order: top-k (`top_k > 0`: the `k` largest; ties at the k-th
value are all kept), top-p (`top_p < 1`: the smallest set of most likely tokens whose
probability reaches `top_p`), min-p (`min_p > 0`: tokens at least `min_p` times as
likely as the most likely), and one token is drawn from what is left. The draw's key
is `fold_in(key(seed), index)`: the same seed and output index give the same token
whatever else is in the batch, so a request is reproducible under its seed.

Before that, each row's logit adjustments (`adjust_ids`, `adjust_vals`: a request's
`logit_bias`, and `-inf` on its stop tokens while its output is shorter than
`min_tokens`) are added to its logits, greedy rows included, inside a `lax.cond`
that a batch without any skips (the default path's tokens and cost stay as they
were). Then, when the step hands `sample` a `penalize` function (it holds the
rows' token histories: `paged_kv.model.penalties`), vLLM's repetition, frequency
and presence penalties (`apply_penalties`), in a `lax.cond` that a batch without a
penalized row skips.

Logprobs are of the model's raw distribution (`log_softmax(logits)`, before the
adjustments, the temperature and the filters: vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ADJUST_WIDTH", "SampleOutput", "SamplingBatch", "apply_adjustments",
           "apply_penalties", "sample"]

# Logit adjustments per row (the width of `adjust_ids`; `SamplingParams`
# allows as many per request: `MAX_LOGIT_ADJUSTMENTS`).
ADJUST_WIDTH = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
  """Sampling parameters of each row of a batch (`B` rows).

  Attributes:
    temperature: `f32[B]`; 0 = greedy.
    top_k: `i32[B]`; 0 = off.
    top_p: `f32[B]` in (0, 1]; 1 = off.
    min_p: `f32[B]` in [0, 1]; 0 = off.
    seed: `u32[B]` the row's request seed.
    index: `i32[B]` the index, in its request's output, of the token being sampled.
    adjust_ids: `i32[B, ADJUST_WIDTH]` token ids whose logits are adjusted; -1 = none.
    adjust_vals: `f32[B, ADJUST_WIDTH]` what is added to each: a finite bias
      always, `-inf` (a stop token held back) only while `index < min_tokens`.
    min_tokens: `i32[B]` the output length before which the `-inf` entries apply.
    presence: `f32[B]` presence penalty (0 = off).
    frequency: `f32[B]` frequency penalty (0 = off).
    repetition: `f32[B]` repetition penalty (1 = off).
    prompt_len: `i32[B]` the row's prompt length: in its token history
      (`paged_kv.model.penalties`), positions before it are the prompt, the rest
      the output (read only for a penalized row).
  """

  temperature: jax.Array | np.ndarray
  top_k: jax.Array | np.ndarray
  top_p: jax.Array | np.ndarray
  min_p: jax.Array | np.ndarray
  seed: jax.Array | np.ndarray
  index: jax.Array | np.ndarray
  adjust_ids: jax.Array | np.ndarray
  adjust_vals: jax.Array | np.ndarray
  min_tokens: jax.Array | np.ndarray
  presence: jax.Array | np.ndarray
  frequency: jax.Array | np.ndarray
  repetition: jax.Array | np.ndarray
  prompt_len: jax.Array | np.ndarray

  @classmethod
  def greedy(cls, num_rows: int) -> "SamplingBatch":
    """Every row greedy, no adjustment (host arrays)."""
    return cls(temperature=np.zeros((num_rows,), np.float32),
               top_k=np.zeros((num_rows,), np.int32), top_p=np.ones((num_rows,), np.float32),
               min_p=np.zeros((num_rows,), np.float32), seed=np.zeros((num_rows,), np.uint32),
               index=np.zeros((num_rows,), np.int32),
               adjust_ids=np.full((num_rows, ADJUST_WIDTH), -1, np.int32),
               adjust_vals=np.zeros((num_rows, ADJUST_WIDTH), np.float32),
               min_tokens=np.zeros((num_rows,), np.int32),
               presence=np.zeros((num_rows,), np.float32),
               frequency=np.zeros((num_rows,), np.float32),
               repetition=np.ones((num_rows,), np.float32),
               prompt_len=np.zeros((num_rows,), np.int32))

  @property
  def penalized(self) -> jax.Array:
    """`bool[B]`: the rows with a presence, frequency or repetition penalty."""
    return ((jnp.asarray(self.presence) != 0) | (jnp.asarray(self.frequency) != 0)
            | (jnp.asarray(self.repetition) != 1))

  def set_row(self, row: int, params, *, seed: int, index: int, stop_ids,
              prompt_len: int = 0) -> None:
    """Fills host row `row` from a request's `SamplingParams` (arrays written in place).

    Args:
      row: the batch row.
      params: the request's `paged_kv.scheduler.SamplingParams`.
      seed: its sampling seed; index: the output index of the token sampled.
      stop_ids: its stop tokens (what `min_tokens` holds back).
      prompt_len: its prompt's length (read with penalties only).
    """
    if params.penalized:
      self.presence[row], self.frequency[row] = params.presence_penalty, params.frequency_penalty
      self.repetition[row], self.prompt_len[row] = params.repetition_penalty, prompt_len
    if not params.greedy:
      self.temperature[row], self.top_k[row] = params.temperature, params.top_k
      self.top_p[row], self.min_p[row] = params.top_p, params.min_p
      self.seed[row], self.index[row] = seed, index
    if params.logit_bias is None and params.min_tokens == 0:
      return
    ids, vals = params.adjustments(stop_ids)
    if ids:
      if len(ids) > ADJUST_WIDTH:
        raise ValueError(f"{len(ids)} logit adjustments > ADJUST_WIDTH={ADJUST_WIDTH}")
      self.adjust_ids[row, :len(ids)] = ids
      self.adjust_vals[row, :len(ids)] = vals
      self.index[row], self.min_tokens[row] = index, params.min_tokens


class SampleOutput(NamedTuple):
  """`sample`'s result: `tokens i32[B]`; with `num_logprobs = n > 0` also
  `logprob f32[B]` (of the sampled token), `top_ids i32[B, n]` and
  `top_logprobs f32[B, n]` (most likely first); else those are `[B, 0]`-shaped zeros."""

  tokens: jax.Array
  logprob: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def _filtered(logits: jax.Array, b: SamplingBatch) -> jax.Array:
  """The tempered logits with top-k, top-p and min-p applied (`-inf` outside)."""
  v = logits.shape[-1]
  t = jnp.where(b.temperature > 0, b.temperature, 1.0).astype(jnp.float32)
  z = logits / t[:, None]
  desc = -jnp.sort(-z, axis=-1)  # most likely first
  k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, v), v)
  kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
  desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, -jnp.inf)
  p = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(p, axis=-1) - p  # probability of the more likely tokens
  keep = (before < b.top_p[:, None]) & jnp.isfinite(desc)
  cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  z = jnp.where((z >= kth) & (z >= cutoff), z, -jnp.inf)
  probs = jax.nn.softmax(z, axis=-1)
  floor = b.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
  return jnp.where(probs >= floor, z, -jnp.inf)


def apply_adjustments(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
  """`logits f32[B, V]` plus each row's active adjustments (`SamplingBatch.adjust_*`).

  A finite entry is a `logit_bias` and always applies; a `-inf` one holds a stop
  token back and applies while the row's `index < min_tokens`. Ids outside
  `[0, V)` (the -1 padding) change nothing.
  """
  logits = jnp.asarray(logits, jnp.float32)
  ids = jnp.asarray(batch.adjust_ids, jnp.int32)
  vals = jnp.asarray(batch.adjust_vals, jnp.float32)
  early = (jnp.asarray(batch.index, jnp.int32)
           < jnp.asarray(batch.min_tokens, jnp.int32))[:, None]
  active = (ids >= 0) & (jnp.isfinite(vals) | early)
  rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
  cols = jnp.where(active, ids, logits.shape[-1])  # out of range: dropped
  return logits.at[rows, cols].add(jnp.where(active, vals, 0.0), mode="drop")


def apply_penalties(logits: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array, *,
                    presence: jax.Array, frequency: jax.Array,
                    repetition: jax.Array) -> jax.Array:
  """vLLM's penalties: repetition, then frequency and presence (pure; jit it).

  With `seen = prompt_mask | (output_counts > 0)`, a logit `x` of a seen token
  becomes `x / repetition` if `x > 0` else `x * repetition`; then
  `frequency * output_counts` and `presence * (output_counts > 0)` are subtracted.

  Args:
    logits: `f32[B, V]`.
    output_counts: `i32[B, V]` how often each token is in the row's output so far.
    prompt_mask: `bool[B, V]` whether each token is in the row's prompt.
    presence, frequency, repetition: `f32[B]` (0, 0 and 1: off).

  Returns:
    `f32[B, V]`: the penalized logits.
  """
  logits = jnp.asarray(logits, jnp.float32)
  counts = jnp.asarray(output_counts)
  in_output = counts > 0
  seen = jnp.asarray(prompt_mask, bool) | in_output
  rep = jnp.asarray(repetition, jnp.float32)[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  logits = logits - jnp.asarray(frequency, jnp.float32)[:, None] * counts.astype(jnp.float32)
  return logits - jnp.asarray(presence, jnp.float32)[:, None] * in_output.astype(jnp.float32)


def sample(logits: jax.Array, batch: SamplingBatch, *, num_logprobs: int = 0,
           penalize=None) -> SampleOutput:
  """The next token of each row (see the module docstring).

  Args:
    logits: `f32[B, V]` each row's logits after its last token.
    batch: the rows' parameters.
    num_logprobs: static; how many top logprobs to return per row (0: none).
    penalize: optional `fn(logits f32[B, V]) -> f32[B, V]` applying the rows'
      presence, frequency and repetition penalties (it knows their token counts:
      `paged_kv.model.penalties.penalizer`); run after the adjustments, inside a
      `lax.cond` that a batch without a penalized row skips. None: no penalties.

  Returns:
    A `SampleOutput`.
  """
  raw = logits = jnp.asarray(logits, jnp.float32)
  adjusted = jnp.any(jnp.asarray(batch.adjust_ids) >= 0)
  logits = jax.lax.cond(adjusted, lambda: apply_adjustments(raw, batch), lambda: raw)
  if penalize is not None:
    logits = jax.lax.cond(jnp.any(batch.penalized), penalize, lambda x: x, logits)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  hot = batch.temperature > 0

  def drawn():
    z = _filtered(logits, batch)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        jnp.asarray(batch.seed, jnp.uint32), jnp.asarray(batch.index, jnp.int32))
    picks = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    return jnp.where(hot, picks, greedy)

  tokens = jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)
  b = logits.shape[0]
  if num_logprobs <= 0:
    empty_f = jnp.zeros((b, 0), jnp.float32)
    return SampleOutput(tokens, jnp.zeros((b,), jnp.float32), jnp.zeros((b, 0), jnp.int32),
                        empty_f)
  lp = jax.nn.log_softmax(raw, axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
  chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
  return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
