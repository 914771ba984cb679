"""`StepMetadata`: everything attention needs about one forward pass, built once per step.

The shape of tpu-inference's `AttentionMetadata` (positions, block tables, seq lens,
query start locations, request distribution), over segment tables: one registered
pytree handed to every layer's `paged_attention(q, k, v, pages, layer, meta)`.

Three constructors, one computation:

  * `StepMetadata.from_plan(plan, table, slot_idx)` on the host (numpy), after the
    host reserved the slots (e.g. `BlockPool.reserve_tokens`): FlashInfer's
    plan/run split, the metadata then goes into a jitted forward as an argument;
  * `StepMetadata.from_reservation(plan, table, slot_idx, status)` inside jit,
    from `reserve_tokens`' output, so allocation, the K/V write and attention run
    in one jitted step with no host round trip (`paged_kv.model.steps.forward`);
  * `StepMetadata.from_reserved(plan, table)` inside jit, when the host reserved
    the slots and committed them before the step (`plan.reserved`: each token's
    slot and each row's status, `reserved_slots`): the serving loop's step, with
    no allocation in its program.

All three give equal arrays for equal inputs (tested).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.core.state import SegmentTable
from paged_kv.model import ragged
from paged_kv.model.plan import ReservedSlots, StepPlan, TailGrowth


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """Per-step attention metadata of a ragged, mixed prefill/decode batch.

  `B` rows, `T` tokens (the plan's shapes), `S = max_segments`. Rows whose
  reservation failed and padding rows keep their place in the token layout but get
  `num_segments = seq_lens = 0` and `slot_mapping = -1`: nothing of theirs is
  written, their queries attend to nothing (output 0).

  Attributes:
    seq_ids: `i32[B]` pool rows in the batch; `-1` = padding.
    positions: `i32[T]` logical position of each new token in its sequence (for
      RoPE); `-1` for padding tokens and tokens of padding rows.
    slot_mapping: `i32[T]` flat physical slot (`block * block_size + offset`) each
      token's K/V goes to; `-1` = not written (padding, failed rows).
    cu_q_lens: `i32[B+1]` row b's tokens are `cu_q_lens[b] : cu_q_lens[b+1]`.
    seg_block: `i32[B, S]` the rows' segment tables after this step's reservation
      (prefix plus new tokens); entries at `s >= num_segments[b]` are 0.
    seg_start: `i32[B, S]` first slot of each segment in its block.
    seg_length: `i32[B, S]` tokens of each segment.
    num_segments: `i32[B]` valid segments per row (0: padding or failed row).
    seq_lens: `i32[B]` tokens per row including this step's (0: padding, failed).
    num_decodes: `i32[]` live rows with exactly one new token (decode rows; a
      one-token prefill chunk counts here too: its attention is the same).
    num_prefills: `i32[]` live rows with more than one new token.
    max_query_len: static bound of tokens per row (the plan's); 1 = decode-only.
  """

  seq_ids: jax.Array
  positions: jax.Array
  slot_mapping: jax.Array
  cu_q_lens: jax.Array
  seg_block: jax.Array
  seg_start: jax.Array
  seg_length: jax.Array
  num_segments: jax.Array
  seq_lens: jax.Array
  num_decodes: jax.Array
  num_prefills: jax.Array
  max_query_len: int = dataclasses.field(metadata=dict(static=True), default=1)

  @property
  def num_rows(self) -> int:
    return self.seq_ids.shape[0]

  @property
  def num_tokens(self) -> int:
    return self.slot_mapping.shape[0]

  @property
  def q_lens(self) -> jax.Array:
    """`i32[B]` tokens of each row in the layout."""
    return self.cu_q_lens[1:] - self.cu_q_lens[:-1]

  def page_table(self, block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rows' segment tables as classic page tables, for other paged kernels.

    A row's table is a page table when every segment starts at slot 0 of its block
    and all but the last hold `block_size` tokens: then its token `t` is in block
    `block_tables[b, t // block_size]` at slot `t % block_size` (what JAX's
    built-in paged attention, vLLM's and FlashInfer's kernels read). Rows that
    share a slotted block, or hold a short middle segment (a prefix cache hit split
    mid-block), are not; they get `whole = False`, a zero table and length 0: run
    them through `paged_attention` instead (or copy their tails whole first).

    Args:
      block_size: the pool's tokens per block.

    Returns:
      `(block_tables i32[B, S], seq_lens i32[B], whole bool[B])`; works on the host
      and inside jit.
    """
    seg = jnp.arange(self.seg_block.shape[1], dtype=jnp.int32)[None, :]
    n = self.num_segments[:, None]
    valid = seg < n
    fits = (self.seg_start == 0) & ((seg == n - 1) | (self.seg_length == block_size))
    whole = jnp.all(jnp.where(valid, fits, True), axis=-1) & (self.num_segments > 0)
    tables = jnp.where(valid & whole[:, None], self.seg_block, 0).astype(jnp.int32)
    return tables, jnp.where(whole, self.seq_lens, 0).astype(jnp.int32), whole

  @classmethod
  def from_reservation(cls, plan: StepPlan, table: SegmentTable, slot_idx: jax.Array,
                       status: jax.Array) -> "StepMetadata":
    """Inside jit: the metadata of `plan` right after `reserve_tokens`.

    Args:
      plan: the step's rows and tokens.
      table: the pool's segment table after the reservation.
      slot_idx: `i32[B, W]` `reserve_tokens`' slots (`W >= max num_new`).
      status: `i32[B]` `reserve_tokens`' status; failed rows attend to nothing.
    """
    fields = _build(jnp, plan, table, status, token_slots(jnp, plan, slot_idx, status))
    return cls(**fields, max_query_len=plan.max_query_len)

  @classmethod
  def from_reserved(cls, plan: StepPlan, table: SegmentTable) -> "StepMetadata":
    """Inside jit: the metadata of a plan whose slots the host reserved
    (`plan.reserved`, `ReservedSlots`), from the pool's table, which already holds
    the reservation (its commit ran before the step). Equal to `from_reservation`'s
    for the same reservation, with no allocation in the program."""
    reserved = plan.reserved
    return cls(**_build(jnp, plan, table, reserved.status, reserved.slot_mapping),
               max_query_len=plan.max_query_len)

  @classmethod
  def from_plan(cls, plan: StepPlan, table: SegmentTable, slot_idx,
                status=None) -> "StepMetadata":
    """On the host (numpy): the metadata of `plan` after the host reserved its slots.

    Args:
      plan: the step's rows and tokens.
      table: the pool's segment table after the reservation (device or numpy).
      slot_idx: `i32[B, W]` each row's reserved slots in order (row b for
        `plan.seq_ids[b]`; rows of padding are not read), `W >= num_new[b]`.
      status: `i32[B]` per-row reservation status; default all OK.

    Raises:
      InvalidArgument: shapes disagree, a live row is not active in `table`, or
        a row's slots are fewer than its tokens.
    """
    tab = jax.tree.map(np.asarray, table)
    ids = np.asarray(plan.seq_ids, np.int32)
    num_new = np.asarray(plan.num_new, np.int32)
    slots = np.asarray(slot_idx, np.int32)
    b = ids.shape[0]
    status = np.zeros((b,), np.int32) if status is None else np.asarray(status, np.int32)
    if num_new.shape != (b,) or status.shape != (b,) or slots.ndim != 2 or slots.shape[0] != b:
      raise InvalidArgument(f"plan rows {ids.shape}, num_new {num_new.shape}, status "
                            f"{status.shape} and slot_idx {slots.shape} must agree on B={b}")
    live = (ids >= 0) & (status == Status.OK)
    if ids.max(initial=-1) >= tab.active.shape[0] or not tab.active[ids[live]].all():
      raise InvalidArgument(f"rows {ids[live].tolist()} are not all active in the table")
    if (num_new[live] > slots.shape[1]).any() or (num_new[live] < 0).any():
      raise InvalidArgument(f"num_new {num_new.tolist()} outside [0, {slots.shape[1]}] "
                            "(the width of slot_idx)")
    if int(num_new.sum()) > plan.tokens.shape[0]:
      raise InvalidArgument(f"{int(num_new.sum())} tokens > the plan's T={plan.tokens.shape[0]}")
    fields = _build(np, plan, tab, status, token_slots(np, plan, slots, status))
    return cls(**fields, max_query_len=plan.max_query_len)


def token_slots(xp, plan: StepPlan, slot_idx, status):
  """`i32[T]` the slot each token of `plan`'s layout is written to, from the rows'
  reserved slots `slot_idx i32[B, W]` (row b's `num_new[b]` first entries); `-1`
  for padding, padding rows and rows whose `status` is not OK. With numpy
  (`xp=np`) or inside jit (`xp=jnp`)."""
  i32 = xp.int32
  seq_ids = xp.asarray(plan.seq_ids, i32)
  num_tokens = plan.tokens.shape[0]
  b = seq_ids.shape[0]
  real = seq_ids >= 0
  ok = real & (xp.asarray(status, i32) == int(Status.OK))
  cu = ragged.cu_lens(xp.asarray(plan.num_new, i32), xp=xp)
  tok_row = ragged.token_rows(cu, num_tokens, xp=xp)  # B for padding tokens
  safe = xp.minimum(tok_row, b - 1)
  j = xp.arange(num_tokens, dtype=i32) - cu[safe]  # index of the token in its row
  width = slot_idx.shape[1]
  slot = slot_idx[safe, xp.clip(j, 0, width - 1)]
  written = (tok_row < b) & real[safe] & ok[safe] & (j < width)
  return xp.where(written, slot, -1).astype(i32)


def reserved_slots(plan: StepPlan, slot_idx, status, grow=None, clock: int = 0
                   ) -> ReservedSlots:
  """Host: the `ReservedSlots` of `plan` from the host's reservation (`slot_idx
  i32[B, W]`, `status i32[B]`, e.g. a `BlockPool.reserve_step`'s), numpy arrays
  (uploaded with the step: `T + B` integers, not `B * W`); `grow i32[B]`: the
  in-place growth the step applies itself, with the pool's `clock` after the
  reservation (`StepPrediction.grow`, `.clock`), or None.

  Raises:
    InvalidArgument: `slot_idx` is not `[B, W]` or `status` not `[B]` for the
      plan's B rows.
  """
  slots = np.asarray(slot_idx, np.int32)
  status = np.asarray(status, np.int32)
  b = plan.num_rows
  if slots.ndim != 2 or slots.shape[0] != b or status.shape != (b,):
    raise InvalidArgument(f"slot_idx {slots.shape} and status {status.shape} must be "
                          f"[{b}, W] and [{b}] for the plan's rows")
  if grow is not None:
    grow = TailGrowth(tokens=np.asarray(grow, np.int32), clock=np.int32(clock))
  mapping = _token_slots_host(plan, slots, status)
  if mapping is None:
    mapping = token_slots(np, plan, slots, status)
  return ReservedSlots(slot_mapping=mapping, status=status, grow=grow)


def _token_slots_host(plan: StepPlan, slot_idx: np.ndarray,
                      status: np.ndarray) -> np.ndarray | None:
  """`token_slots(np, ...)` in a few numpy calls over the rows and their tokens (not
  `B x W` nor a search per token): row b's first `num_new[b]` slots, laid out row
  after row. The leading one-token rows (a step's decode rows) in one pass, the rows
  after them one at a time when they are few (a step's prompt chunks and padding),
  else in a repeat form. None when a row asks for more tokens than `slot_idx` is
  wide, for a negative count, or when the tokens exceed `T` (the general form
  decides those)."""
  num_new = np.asarray(plan.num_new)
  b, width = slot_idx.shape
  t = plan.tokens.shape[0]
  out = np.full(t, -1, np.int32)
  ok = (np.asarray(plan.seq_ids) >= 0) & (status == int(Status.OK))
  other = num_new != 1
  nd = int(other.argmax())  # rows before the first that is not one token
  if not other[nd]:
    nd = b
  if nd > t:
    return None
  out[:nd] = np.where(ok[:nd], slot_idx[:nd, 0], -1)
  if nd == b:
    return out
  rest = num_new[nd:]
  live = np.flatnonzero(rest)
  if live.size <= _FEW_WIDE_ROWS:  # decode rows, then a few prompt chunks (and padding)
    pos = nd
    for i, n in zip((live + nd).tolist(), rest[live].tolist()):
      if n < 0 or n > width or pos + n > t:
        return None
      if ok[i]:
        out[pos:pos + n] = slot_idx[i, :n]
      pos += n
    return out
  if num_new.min() < 0 or num_new.max() > width or b > _ARANGE.size:
    return None
  ends = np.cumsum(num_new)
  total = int(ends[-1])
  if total > t or total > _ARANGE.size:
    return None
  rows = np.repeat(_ARANGE[:b], num_new)
  j = _ARANGE[:total] - np.repeat(ends - num_new, num_new)
  out[:total] = np.where(ok[rows], slot_idx[rows, j], -1)
  return out


_ARANGE = np.arange(1 << 16)
_FEW_WIDE_ROWS = 16  # rows after the leading one-token ones that `_token_slots_host` copies one by one


def _build(xp, plan: StepPlan, table: SegmentTable, status, slot_mapping) -> dict:
  """The array fields, with numpy (`xp=np`) or inside jit (`xp=jnp`), from the
  table after the reservation and the tokens' slots (`token_slots`)."""
  i32 = xp.int32
  seq_ids = xp.asarray(plan.seq_ids, i32)
  num_new = xp.asarray(plan.num_new, i32)
  num_tokens = plan.tokens.shape[0]
  b = seq_ids.shape[0]
  real = seq_ids >= 0
  ok = real & (xp.asarray(status, i32) == int(Status.OK))
  row = xp.clip(seq_ids, 0, table.seq_len.shape[0] - 1)
  cu = ragged.cu_lens(num_new, xp=xp)
  tok_row = ragged.token_rows(cu, num_tokens, xp=xp)  # B for padding tokens
  safe = xp.minimum(tok_row, b - 1)
  in_row = (tok_row < b) & real[safe]
  j = xp.arange(num_tokens, dtype=i32) - cu[safe]  # index of the token in its row
  seq_len = xp.where(ok, table.seq_len[row], 0)
  pos0 = table.seq_len[row] - xp.where(ok, num_new, 0)  # tokens before the step
  seg = lambda a: xp.where(ok[:, None], a[row], 0).astype(i32)
  return dict(
      seq_ids=xp.where(real, seq_ids, -1).astype(i32),
      positions=xp.where(in_row, pos0[safe] + j, -1).astype(i32),
      slot_mapping=xp.asarray(slot_mapping, i32),
      cu_q_lens=cu,
      seg_block=seg(table.block),
      seg_start=seg(table.start),
      seg_length=seg(table.length),
      num_segments=xp.where(ok, table.num_segments[row], 0).astype(i32),
      seq_lens=seq_len.astype(i32),
      num_decodes=xp.sum(ok & (num_new == 1)).astype(i32),
      num_prefills=xp.sum(ok & (num_new > 1)).astype(i32),
  )
