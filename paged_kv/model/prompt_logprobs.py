"""Prompt logprobs inside the jitted step (`SamplingParams.prompt_logprobs`).

vLLM's `prompt_logprobs`: for each prompt token after the first, its log-probability
given the tokens before it, and the most likely tokens at that position. A step
whose plan names such positions (`paged_kv.model.plan.PromptPositions`: a fixed
width `W`, so one program serves every mix) computes the model's output head at
them besides each row's last token (a model that takes `logits_indices` gets both
sets in one index array; any other's full logits are gathered), then
`log_softmax`, the target's logprob and rank, and the top `k` (`prompt_logprobs`).
Raw logprobs (the model's distribution, before any sampling parameter), as vLLM's
default. A plan without positions runs the program it always ran.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PromptLogprobs", "prompt_logprobs"]


class PromptLogprobs(NamedTuple):
  """The step's prompt logprobs, one entry per `PromptPositions` entry (`W`).

  Attributes:
    row: `i32[W]` the entry's batch row (-1: unused), as given.
    position: `i32[W]` the target's position in its prompt, as given.
    logprob: `f32[W]` the target token's log-probability.
    rank: `i32[W]` its rank there (1: the most likely).
    top_ids: `i32[W, k]`, top_logprobs: `f32[W, k]`: the `k` most likely tokens
      and their logprobs, most likely first (`[W, 0]` when `k == 0`).
  """

  row: jax.Array
  position: jax.Array
  logprob: jax.Array
  rank: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def prompt_logprobs(logits: jax.Array, positions, *, num_top: int) -> PromptLogprobs:
  """The logprobs of `positions`' targets under `logits` (pure; traced in the step).

  Args:
    logits: `f32[W, V]` the output head at each entry's `index`.
    positions: the plan's `PromptPositions`.
    num_top: static; the top logprobs per entry.

  Returns:
    A `PromptLogprobs`; unused entries' values are meaningless.
  """
  lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  w, v = lp.shape
  target = jnp.clip(jnp.asarray(positions.target, jnp.int32), 0, v - 1)
  chosen = jnp.take_along_axis(lp, target[:, None], axis=-1)[:, 0]
  rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1, dtype=jnp.int32)
  if num_top > 0:
    top_lp, top_ids = jax.lax.top_k(lp, num_top)
  else:
    top_lp, top_ids = jnp.zeros((w, 0), jnp.float32), jnp.zeros((w, 0), jnp.int32)
  return PromptLogprobs(jnp.asarray(positions.row, jnp.int32),
                        jnp.asarray(positions.position, jnp.int32), chosen, rank,
                        top_ids.astype(jnp.int32), top_lp)
