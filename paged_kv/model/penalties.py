"""Token histories on the device, for vLLM's presence, frequency and repetition penalties.

The step records every token it caches into `i32[R, L]` at its row and position,
so a row's positions `[0, seq_len)` are its prompt and output so far: no reset,
no upload. A penalized request is admitted without a shared prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv.model import ragged, sampling

__all__ = ["empty_history", "penalizer", "record"]


def empty_history(num_rows: int, length: int, *, sharding=None) -> jax.Array:
  """A zero history of `num_rows` x `length`, committed to the default device or to `sharding`."""
  if sharding is not None:
    return jax.jit(lambda: jnp.zeros((num_rows, length), jnp.int32), out_shardings=sharding)()
  return jax.device_put(jnp.zeros((num_rows, length), jnp.int32), jax.devices()[0])


def record(history: jax.Array, meta, tokens: jax.Array) -> jax.Array:
  """`history` with each token the step caches written at its row and position (pure).

  `tokens: i32[T]` are the step's tokens with carried ones resolved; writes
  outside `[0, R) x [0, L)` are dropped.
  """
  b = meta.seq_ids.shape[0]
  tok_row = ragged.token_rows(meta.cu_q_lens, tokens.shape[0])  # B for padding tokens
  seq = meta.seq_ids[jnp.minimum(tok_row, b - 1)]
  ok = (tok_row < b) & (seq >= 0) & (meta.slot_mapping >= 0) & (meta.positions >= 0)
  r, l = history.shape
  rows = jnp.where(ok, seq, r)  # out of range: dropped
  cols = jnp.where(ok, meta.positions, l)
  return history.at[rows, cols].set(jnp.asarray(tokens, jnp.int32), mode="drop")


def counts_and_prompt(history: jax.Array, seq_ids: jax.Array, seq_lens: jax.Array,
                      prompt_len: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """Each row's output token counts `i32[B, V]` and prompt mask `bool[B, V]` (padding: zeros)."""
  b, length = seq_ids.shape[0], history.shape[1]
  toks = history[jnp.clip(seq_ids, 0, history.shape[0] - 1)]  # [B, L]
  pos = jnp.arange(length, dtype=jnp.int32)[None, :]
  live = (seq_ids >= 0)[:, None] & (pos < seq_lens[:, None])
  in_prompt = live & (pos < prompt_len[:, None])
  in_output = live & ~in_prompt
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], toks.shape)
  cols = jnp.clip(toks, 0, vocab - 1)
  counts = jnp.zeros((b, vocab), jnp.int32).at[rows, cols].add(in_output.astype(jnp.int32))
  prompt = jnp.zeros((b, vocab), bool).at[rows, jnp.where(in_prompt, cols, vocab)].set(
      True, mode="drop")
  return counts, prompt


def penalizer(history: jax.Array, seq_ids: jax.Array, seq_lens: jax.Array,
              batch: sampling.SamplingBatch):
  """`fn(logits f32[B, V]) -> f32[B, V]` applying the rows' penalties (others bit for bit)."""

  def penalize(logits):
    counts, prompt = counts_and_prompt(history, seq_ids, seq_lens,
                                       jnp.asarray(batch.prompt_len, jnp.int32),
                                       logits.shape[-1])
    out = sampling.apply_penalties(logits, counts, prompt, presence=batch.presence,
                                   frequency=batch.frequency, repetition=batch.repetition)
    return jnp.where(batch.penalized[:, None], out, logits)

  return penalize
