"""A step's reservation, decided on a `BlockPool`'s mirror (bound as its methods).

`reserve_step` decides and commits it before a single step runs (the serving
path: the step only reads it). The k-step decode reserves inside its jitted
program: `predict_decode_steps` predicts those reservations (`predict_step`, one
step's `reserve_tokens`), and `adopt_step` checks the device's statuses later.
"""
# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from paged_kv.core.errors import Status
from paged_kv.core.state import PoolState
from paged_kv.pool import host_transitions as host_ops

if TYPE_CHECKING:
  from paged_kv.pool.block_pool import BlockPool

_NO_BLOCKS = np.zeros((0,), np.int64)
_NO_BLOCKS.setflags(write=False)


@dataclasses.dataclass
class StepPrediction:
  """A step's reservation, decided on the mirror before the step runs.

  Attributes:
    state: the flushed device state to hand to the step (donated there).
    slot_idx: `i32[B, T]` the slots each row's new tokens get (-1 padded).
    status: `i32[B]` each row's reservation status.
    touched_blocks: blocks the reservation changes (checked at the next commit).
    adopted: set once `adopt_step` took the step's state.
    committed: the reservation is already in `state` (`reserve_step`).
    grow, clock: with `committed`, `i32[B]` the tokens each row grows in place
      that the step applies itself, and the clock it sets (`model.plan.TailGrowth`).
  """

  state: PoolState
  slot_idx: np.ndarray
  status: np.ndarray
  touched_blocks: np.ndarray
  adopted: bool = False
  committed: bool = False
  grow: np.ndarray | None = None
  clock: int = 0


def predict_step(pool: BlockPool, seq_ids, num_new, *, max_new_tokens: int) -> StepPrediction:
  """Flushes and predicts on the mirror what a jitted step's own
  `reserve_tokens(atomic=False)` will do (per-row statuses, failed rows unchanged).
  Hand `prediction.state` to the step, then `adopt_step`. Not a method: the
  scheduler's single step takes `reserve_step`; the k-step decode, this k times."""
  ids = np.asarray(seq_ids, np.int64).reshape(-1)
  counts = np.asarray(num_new, np.int64).reshape(-1)
  pool.flush()
  host = pool.host
  host.log = pool._scratch_log
  try:
    slot_idx, status = host_ops.reserve(host, ids, counts, max_new_tokens=max_new_tokens,
                                        atomic=False)
  finally:
    host.log = pool._log
  touched = pool._scratch_log.touched_blocks(host)
  pool._scratch_log.reset(None)
  return StepPrediction(state=pool._state, slot_idx=slot_idx, status=status,
                        touched_blocks=touched)


def predict_decode_steps(pool: BlockPool, seq_ids: np.ndarray, remaining: np.ndarray,
                         num_steps: int) -> StepPrediction:
  """The reservations of `Executor.decode_steps` on the mirror, one step after the
  other (row b reserves one token at step j while `j < remaining[b]` and none of its
  earlier ones failed); `status` is `i32[num_steps, B]`."""
  ones = np.ones_like(seq_ids)
  stopped = np.zeros(seq_ids.shape, bool)
  statuses, touched, state = [], [], None
  for j in range(num_steps):
    live = (seq_ids >= 0) & (j < remaining) & ~stopped
    pred = predict_step(pool, np.where(live, seq_ids, -1), ones, max_new_tokens=1)
    state = pred.state if state is None else state
    statuses.append(pred.status)
    touched.append(pred.touched_blocks)
    stopped |= live & (pred.status != Status.OK)
  return StepPrediction(state=state, slot_idx=np.zeros((0,), np.int32),
                        status=np.stack(statuses),
                        touched_blocks=np.unique(np.concatenate(touched)))


def reserve_step(pool: BlockPool, seq_ids, num_new, *, max_new_tokens: int,
                 grow_in_step: bool = False) -> StepPrediction:
  """Reserves a step's slots on the mirror and commits them before the step runs.

  The step only reads the table (`paged_kv.model.metadata.reserved_slots`). Hand
  `prediction.state` to the step, then `adopt_step` (or `abandon_step`).
  `grow_in_step`: a decode row growing in place by one token (not yet in the log)
  stays out of the commit and
  the step applies it (`prediction.grow`; `paged_kv.core.growth.grow_tails`), so
  a decode step commits only the rows that took a block.
  """
  ids = np.asarray(seq_ids, np.int64).reshape(-1)
  counts = np.asarray(num_new, np.int64).reshape(-1)
  grow = np.zeros(ids.shape, np.int32)
  host = pool.host
  slot_idx, status = host_ops.reserve(host, ids, counts, max_new_tokens=max_new_tokens,
                                      atomic=False, grow=grow if grow_in_step else None)
  pool.flush()
  pool._log.settle_growth(host)
  return StepPrediction(state=pool._state, slot_idx=slot_idx, status=status,
                        touched_blocks=_NO_BLOCKS, committed=True, grow=grow,
                        clock=host.step)


def adopt_step(pool: BlockPool, state: PoolState, prediction: StepPrediction,
               device_status=None) -> None:
  """Takes the state a step returned; its reservation was `prediction`'s.

  After a prediction (`predict_decode_steps`), `device_status` (the step's, at
  least B entries per step) is compared with it, at once for a host array (raising
  `InternalInconsistency`), once ready for a device array.
  """
  pool._state = state
  prediction.adopted = True
  pool.runtime.dispatch("step")
  if prediction.committed:
    pool._done()
    return
  pool._log.adopt(pool._mirror, prediction.touched_blocks)
  pool._log.expected = pool._mirror.totals()
  if device_status is not None:
    b = prediction.status.shape[0]
    if isinstance(device_status, jax.Array):
      pool._checks.append(("jitted step reservation", device_status[:b] if
                           device_status.shape[0] != b else device_status, prediction.status))
    else:
      pool._check("jitted step reservation", np.asarray(device_status)[:b], prediction.status)
  pool._done()


def abandon_step(pool: BlockPool, state: PoolState | None = None) -> None:
  """The step raised: keep `state` if it returned one, and reload the mirror."""
  if state is not None:
    pool._state = state
  pool._log.reset(None)
  pool._mirror = None
