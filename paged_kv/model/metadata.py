"""`StepMetadata`: everything attention needs about one forward pass, built once per step.

One registered pytree for every layer (after tpu-inference's
`AttentionMetadata`). `from_plan` (host), `from_reservation` (in jit, after
`reserve_tokens`) and `from_reserved` (in jit, host-committed slots) give equal
arrays for equal inputs.
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

  `B` rows, `T` tokens, `S` segments. Failed and padding rows get no segments and
  `slot_mapping = -1` (output 0). `positions`, `slot_mapping`: `i32[T]`, -1 for
  padding; `cu_q_lens`: `i32[B+1]`; `seg_*`: `i32[B, S]` tables after the
  reservation; `num_segments`, `seq_lens`: `i32[B]`; `num_decodes`,
  `num_prefills`: `i32[]`; `max_query_len`: static, 1 = decode-only.
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
    """The rows as classic page tables: `(block_tables i32[B, S], seq_lens i32[B], whole bool[B])`.

    A row is a page table when every segment starts at slot 0 and all but the last
    are full; rows sharing a slotted block or split mid-block get `whole = False`,
    a zero table and length 0 (run them through `paged_attention`).
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
    """Inside jit: the metadata of `plan` right after `reserve_tokens` (`slot_idx`, `status`)."""
    fields = _build(jnp, plan, table, status, token_slots(jnp, plan, slot_idx, status))
    return cls(**fields, max_query_len=plan.max_query_len)

  @classmethod
  def from_reserved(cls, plan: StepPlan, table: SegmentTable) -> "StepMetadata":
    """Inside jit: the metadata of a plan whose slots the host reserved and committed."""
    reserved = plan.reserved
    return cls(**_build(jnp, plan, table, reserved.status, reserved.slot_mapping),
               max_query_len=plan.max_query_len)

  @classmethod
  def from_plan(cls, plan: StepPlan, table: SegmentTable, slot_idx,
                status=None) -> "StepMetadata":
    """On the host (numpy): the metadata of `plan` after a host reservation `slot_idx i32[B, W]`.

    Raises `InvalidArgument` when shapes disagree, a live row is not active in
    `table`, or a row has fewer slots than tokens.
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
  """`i32[T]`: each token's slot from the rows' `slot_idx i32[B, W]`; `-1` for padding, failures."""
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
  """Host: the `ReservedSlots` of `plan` (`T + B` integers to upload, not `B * W`).

  `grow` and `clock` are the in-place growth the step applies itself and the pool's
  clock after it. Raises `InvalidArgument` for `slot_idx` not `[B, W]` or `status`
  not `[B]`.
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
  """`token_slots(np, ...)` in a few numpy calls; None for the cases the general form decides."""
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
  """The array fields, numpy or in jit, from the table after the reservation and the slots."""
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
