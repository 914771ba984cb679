"""`StepPlan`: what one forward pass computes, as the host (scheduler) decides it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from paged_kv.core.errors import InvalidArgument
from paged_kv.model import ragged
from paged_kv.model.sampling import SamplingBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CarriedTokens:
  """Tokens a step takes from an earlier step's device output (the overlapped loop).

  `prev: i32[P]` the earlier step's last token per row; `src: i32[T]` per position
  of `StepPlan.tokens` the index into `prev`, or `-1` to keep the plan's token.
  """

  prev: jax.Array | np.ndarray
  src: jax.Array | np.ndarray

  def resolve(self, tokens):
    """`tokens` with the carried positions filled from `prev` (traced or eager)."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    src = jnp.asarray(self.src, jnp.int32)
    prev = jnp.asarray(self.prev, jnp.int32)
    taken = prev[jnp.clip(src, 0, prev.shape[0] - 1)]
    return jnp.where(src >= 0, taken, jnp.asarray(tokens, jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReservedSlots:
  """A step's reservation, decided by the host and already committed to the pool's table.

  `slot_mapping: i32[T]` (-1: not written) and `status: i32[B]` per row; `grow`:
  an optional `TailGrowth` the step applies itself before reading the table.
  """

  slot_mapping: jax.Array | np.ndarray
  status: jax.Array | np.ndarray
  grow: "TailGrowth | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TailGrowth:
  """In-place tail growth a step applies: `tokens i32[B]` and the pool's `clock` after it."""

  tokens: jax.Array | np.ndarray
  clock: jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptPositions:
  """The prompt tokens whose logprobs a step computes, `W` fixed entries (`prefill_token_budget`).

  Entry w asks for the logprob of `target[w]` after position `index[w]` of the
  step's token layout (-1: unused), and the top tokens there; `row` and
  `position` (in its prompt) are echoed back.
  """

  index: jax.Array | np.ndarray
  target: jax.Array | np.ndarray
  row: jax.Array | np.ndarray
  position: jax.Array | np.ndarray

  @classmethod
  def empty(cls, width: int) -> "PromptPositions":
    """`width` unused entries (host arrays)."""
    neg = np.full((width,), -1, np.int32)
    return cls(index=neg, target=np.zeros((width,), np.int32), row=neg.copy(),
               position=np.zeros((width,), np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The rows and new tokens of one forward pass.

  Attributes:
    seq_ids: `i32[B]` pool rows; `-1` = padding row (ignored, output 0).
    num_new: `i32[B]` new tokens per row.
    tokens: `i32[T]` ragged: row b's at `cu_q_lens[b] : cu_q_lens[b+1]`, then padding.
    max_query_len: static bound of `num_new`; 1 marks a decode-only batch.
    sampling, num_logprobs: optional `SamplingBatch` (None: greedy), static top logprobs.
    carried: optional `CarriedTokens` (placeholders in `tokens`).
    reserved: the host's `ReservedSlots` (the scheduler's steps); None: the step reserves.
    prompt: optional `PromptPositions` whose logprobs the step computes too.
  """

  seq_ids: jax.Array | np.ndarray
  num_new: jax.Array | np.ndarray
  tokens: jax.Array | np.ndarray
  max_query_len: int = dataclasses.field(metadata=dict(static=True), default=1)
  sampling: SamplingBatch | None = None
  num_logprobs: int = dataclasses.field(metadata=dict(static=True), default=0)
  carried: CarriedTokens | None = None
  reserved: ReservedSlots | None = None
  prompt: PromptPositions | None = None

  @property
  def num_rows(self) -> int:
    return self.seq_ids.shape[0]

  @property
  def num_tokens(self) -> int:
    return self.tokens.shape[0]

  @classmethod
  def build(cls, rows: Sequence[tuple[int, Sequence[int]]], *, num_rows: int,
            max_query_len: int, num_tokens: int | None = None) -> "StepPlan":
    """Host: a plan from `(seq_id, new tokens)` pairs in batch order, padded to `num_rows`.

    `num_tokens` defaults to the total rounded up to a power of two (O(log)
    compiled variants). Raises `InvalidArgument` for too many rows or tokens, a row
    id < 0, or a row with no tokens or more than `max_query_len`.
    """
    if not isinstance(max_query_len, int) or max_query_len < 1:
      raise InvalidArgument(f"max_query_len must be an int >= 1, got {max_query_len!r}")
    if len(rows) > num_rows:
      raise InvalidArgument(f"{len(rows)} rows > num_rows={num_rows}")
    ids = np.full((num_rows,), -1, np.int32)
    lists = []
    for i, (seq_id, toks) in enumerate(rows):
      n = len(toks)
      if seq_id < 0 or not 1 <= n <= max_query_len:
        raise InvalidArgument(f"row {i}: seq_id={seq_id} with {n} tokens (need seq_id >= 0 "
                              f"and 1 <= tokens <= max_query_len={max_query_len})")
      ids[i] = seq_id
      lists.append(toks)
    lists += [[]] * (num_rows - len(rows))
    try:
      tokens, num_new = ragged.pack_rows(lists, num_tokens=num_tokens)
    except ValueError as e:
      raise InvalidArgument(str(e)) from None
    return cls(seq_ids=ids, num_new=num_new, tokens=tokens, max_query_len=max_query_len)
