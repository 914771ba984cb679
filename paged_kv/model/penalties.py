"""Token histories on the device, for vLLM's presence, frequency and repetition penalties.

The penalties need, per row, how often each token is in the output so far and
whether it is in the prompt. The step keeps a **token history**: `i32[R, L]`, the
token at each position of each pool row (`R = max_seqs` rows, `L` positions), written
by the step itself for every token it caches (`record`: the same positions its K/V
go to). When a row samples, the tokens at positions `[0, seq_len)` are exactly its
prompt and its output so far (`seq_len` counts this step's tokens), the prompt being
positions `< prompt_len` (`SamplingBatch.prompt_len`). So the history needs no reset
between requests (positions past `seq_len` are never read), no upload from the host
(the step writes what it caches; a sampled token is cached, and so recorded, by the
next step, before the sample that needs it), and it follows the overlapped loop and
the k-step decodes (their tokens stay on the device).

What the host must guarantee: every position `< seq_len` of a penalized row was
cached by this request's own steps. A cached prefix shared from the radix cache is
not (another request computed it), so the scheduler admits a penalized request
without one (`paged_kv.scheduler.admission`).

Memory: `R * L * 4` bytes (4 bytes per token of row capacity; at 256 rows of 8192
positions, 8 MiB), where per-row vocabulary histograms would take `R * vocab * 4`
(128 MiB at 256 rows and a 128k vocabulary). Compute, only in a batch with a
penalized row (`sample`'s `lax.cond`): a gather of `B * L` tokens and a scatter-add
of as many ones into `f32[B, vocab]` counts, the size of the logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv.model import ragged, sampling

__all__ = ["empty_history", "penalizer", "record"]


def empty_history(num_rows: int, length: int, *, sharding=None) -> jax.Array:
  """A history of `num_rows` pool rows of `length` positions (`i32`, zeros), committed
  to the default device as the steps' outputs are (an uncommitted first argument
  would give each step program a second cache entry), or created with `sharding`
  (a mesh's: each process makes its own shards, no transfer between hosts)."""
  if sharding is not None:
    return jax.jit(lambda: jnp.zeros((num_rows, length), jnp.int32), out_shardings=sharding)()
  return jax.device_put(jnp.zeros((num_rows, length), jnp.int32), jax.devices()[0])


def record(history: jax.Array, meta, tokens: jax.Array) -> jax.Array:
  """`history` with each token a step caches written at its row and position (pure).

  Args:
    history: `i32[R, L]`.
    meta: the step's `paged_kv.model.metadata.StepMetadata` (a token is cached where
      its `slot_mapping >= 0`; its row is `seq_ids[row of the token]`).
    tokens: `i32[T]` the step's tokens (carried ones resolved).

  Returns:
    The history; writes outside `[0, R) x [0, L)` are dropped.
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
  """Each row's output token counts `i32[B, V]` and prompt mask `bool[B, V]`.

  Row b's tokens are `history[seq_ids[b], :seq_lens[b]]`; the first `prompt_len[b]`
  of them are its prompt. Padding rows (`seq_ids < 0`) get zeros.
  """
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
  """`fn(logits f32[B, V]) -> f32[B, V]`: the rows' penalties from their histories
  (`sampling.apply_penalties`), for `sampling.sample(..., penalize=)`. Rows without
  a penalty keep their logits bit for bit."""

  def penalize(logits):
    counts, prompt = counts_and_prompt(history, seq_ids, seq_lens,
                                       jnp.asarray(batch.prompt_len, jnp.int32),
                                       logits.shape[-1])
    out = sampling.apply_penalties(logits, counts, prompt, presence=batch.presence,
                                   frequency=batch.frequency, repetition=batch.repetition)
    return jnp.where(batch.penalized[:, None], out, logits)

  return penalize
