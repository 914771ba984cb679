"""`StepPlan`: what one forward pass computes, as the host (scheduler) decides it.

A plan names the rows of the batch and the new tokens of each, in the ragged layout
(`paged_kv.model.ragged`): prefill chunks and decode tokens side by side. It is a
registered pytree, so it is passed to the jitted step as it is; `max_query_len` is
static (part of the tree structure), every other field is an array.

Rows may come in any order; by convention (tpu-inference's request distribution)
`StepPlan.build` callers put decode rows first. Blocks are granted to rows in
batch order when the pool runs short.
"""

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
  """Tokens a step takes from an earlier step's output, without a trip to the host.

  The overlapped serving loop dispatches step t+1 before it reads step t's sampled
  tokens: a decode row's input token is then still on the device.

  Attributes:
    prev: `i32[P]` the earlier step's last sampled token per row (a device array).
    src: `i32[T]` for each position of `StepPlan.tokens`: the index into `prev`
      whose token goes there, or `-1` to keep the plan's own token.
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
  """A step's reservation, decided by the host and already in the pool's table.

  The serving loop reserves a step's slots on the pool's host mirror
  (`paged_kv.pool.block_pool.BlockPool.reserve_step`), whose commit puts the rows' new
  segments and lengths on the device before the step runs; the step then only
  reads them (`paged_kv.model.metadata.StepMetadata.from_reserved`) instead of
  reserving again inside its program. Build it with
  `paged_kv.model.metadata.reserved_slots`.

  Attributes:
    slot_mapping: `i32[T]` the flat slot (`block * block_size + offset`) each
      token of the plan's layout is written to; `-1` = not written (padding,
      padding rows, rows whose reservation failed).
    status: `i32[B]` each row's reservation status (`paged_kv.core.errors.Status`);
      a failed row attends to nothing and samples nothing.
    grow: optional `TailGrowth`: what the step itself applies before it reads the
      table (`paged_kv.core.growth.grow_tails`): the rows the host left out of the
      commit. None: the commit holds the whole reservation.
  """

  slot_mapping: jax.Array | np.ndarray
  status: jax.Array | np.ndarray
  grow: "TailGrowth | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TailGrowth:
  """In-place tail growth a step applies on the device (`ReservedSlots.grow`).

  Attributes:
    tokens: `i32[B]` tokens row b grows by after its tail, in its own tail block.
    clock: `i32[]` the pool's logical clock after the reservation (the device's
      `PoolState.step` becomes it, as the commit would have set it).
  """

  tokens: jax.Array | np.ndarray
  clock: jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptPositions:
  """The prompt tokens whose logprobs a step computes (`SamplingParams.prompt_logprobs`).

  `W` fixed entries (the scheduler's `prefill_token_budget`: every prompt token a step
  holds); entry w asks for the log-probability of token `target[w]` after position
  `index[w]` of the step's token layout (the token before it in the prompt), and of
  the most likely tokens there (`paged_kv.model.prompt_logprobs`).

  Attributes:
    index: `i32[W]` a position of `StepPlan.tokens`; -1 = unused entry.
    target: `i32[W]` the prompt token that follows it.
    row: `i32[W]` its batch row (-1: unused), echoed back with the result.
    position: `i32[W]` the target's position in its prompt, echoed back.
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
    seq_ids: `i32[B]` the pool rows in the batch; `-1` = padding row.
    num_new: `i32[B]` new tokens of each row: 1 for a decode, the chunk length
      for a prefill chunk, 0 for a padding row. A padding row with tokens keeps
      its place in the layout and is ignored (nothing written, output 0).
    tokens: `i32[T]` the new tokens, ragged: row b's at `cu_q_lens[b] :
      cu_q_lens[b+1]` with `cu_q_lens = [0, cumsum(num_new)]`; then padding.
    max_query_len: static upper bound of `num_new` (the width of the step's
      `reserve_tokens` call); 1 marks a decode-only batch, for which
      `paged_attention` runs only the decode kernel.
    sampling: optional per-row `paged_kv.model.sampling.SamplingBatch` (None:
      greedy, the executor's plain step).
    num_logprobs: static; top logprobs to return per row with `sampling` (0: none).
    carried: optional `CarriedTokens`: positions of `tokens` that come from an
      earlier step's device output (the overlapped loop's decode tokens); `tokens`
      holds placeholders there. An executor with `carries_tokens = True` resolves
      them inside its step; for any other the scheduler resolves them first.
    reserved: optional `ReservedSlots`: the host already reserved the rows' slots
      and committed them to the pool (`BlockPool.reserve_step`); the step reads
      them instead of reserving (None: the step reserves `num_new` per row with
      `reserve_tokens` inside its program). Only an executor with
      `takes_reserved_slots = True` is handed such a plan.
    prompt: optional `PromptPositions`: prompt tokens whose logprobs the step
      computes too (with `sampling`; `num_logprobs` top ones each). None (the
      usual plan): none, and the step's program is the one without them.
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
    """Host: a plan from `(seq_id, new tokens)` pairs, in batch order.

    Args:
      rows: one `(seq_id, tokens)` per row (decode rows first, by convention);
        each has `1 <= len(tokens) <= max_query_len`.
      num_rows: static batch size B (`len(rows) <= num_rows`); the rest is padding.
      max_query_len: static bound of tokens per row.
      num_tokens: static T; default: the total rounded up to a power of two, so
        that a serving loop compiles O(log) step variants.

    Raises:
      InvalidArgument: too many rows or tokens, a row id < 0, or a row with no
        tokens or more than `max_query_len`.
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
