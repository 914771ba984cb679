"""Prompt logprobs inside the jitted step (vLLM's `prompt_logprobs`).

For the positions a plan names (`PromptPositions`, fixed width so one program
serves every mix) the step runs the output head there too, then `log_softmax`,
the target's logprob and rank and the top `k`. Raw logprobs, before any
sampling parameter; a plan without positions runs its usual program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PromptLogprobs", "prompt_logprobs"]


class PromptLogprobs(NamedTuple):
  """The step's prompt logprobs, one per `PromptPositions` entry; `row`, `position` as given.

  `logprob: f32[W]`, `rank: i32[W]` (1 = most likely), and the `k` most likely
  `top_ids: i32[W, k]` with `top_logprobs: f32[W, k]`.
  """

  row: jax.Array
  position: jax.Array
  logprob: jax.Array
  rank: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def prompt_logprobs(logits: jax.Array, positions, *, num_top: int) -> PromptLogprobs:
  """The `PromptLogprobs` of `positions`' targets under `logits f32[W, V]` (traced)."""
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
