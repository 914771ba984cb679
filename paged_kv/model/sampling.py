"""Sampling the next token of each row inside the jitted step, and its logprobs.

Adjustments and penalties first (each skipped by a batch without them), then
argmax at temperature 0, else top-k (ties kept), top-p, min-p and a draw keyed
by `fold_in(key(seed), index)`. Logprobs are raw, as vLLM's default.
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
  """Sampling parameters of each of `B` rows, as arrays (one program serves every mix).

  `temperature` 0 = greedy; `top_k` 0, `top_p` 1, `min_p` 0 and penalties
  `presence`/`frequency` 0, `repetition` 1 are off. `index` is the output index
  being sampled; `adjust_ids`/`adjust_vals` (`[B, ADJUST_WIDTH]`, id -1 = none)
  add a finite bias always and `-inf` only while `index < min_tokens`;
  `prompt_len` splits a row's token history (penalties only).
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
    """Fills host row `row` in place from a request's `SamplingParams` and its sampling state."""
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
  """`sample`'s result: `tokens i32[B]`, and with `n` logprobs the sampled and top ones.

  `logprob f32[B]`, `top_ids i32[B, n]`, `top_logprobs f32[B, n]` (`[B, 0]` if none).
  """

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
  """`logits f32[B, V]` plus each row's active adjustments; ids outside `[0, V)` change nothing."""
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
  """vLLM's penalties on `logits f32[B, V]`: repetition, then frequency and presence (pure).

  With `seen = prompt_mask | (output_counts > 0)`, a seen token's logit `x`
  becomes `x / repetition` if `x > 0` else `x * repetition`; then `frequency *
  output_counts` and `presence * (output_counts > 0)` are subtracted.
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
  """The next token of each row from `logits f32[B, V]` (module docstring): a `SampleOutput`.

  `num_logprobs` is static; `penalize` (`penalties.penalizer`) applies the rows'
  penalties after the adjustments, None: none.
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
