"""`BlockPool`: the host API. It decides on a host mirror and sends the device one commit.

Every call validates its arguments and decides its outcome on an exact numpy
mirror of the pool's bookkeeping (`paged_kv.pool.host_state.HostState`: reference
counts, slot bits, the free index, the segment tables), with the same
algorithms and status codes as the jitted transitions in `paged_kv.core`. A
refused call raises its typed exception (`PoolExhausted(reason=...)`,
`InvalidSequence`, ...) and changes nothing; an accepted one changes the mirror
and queues the change. Nothing waits for the device: the queue goes to the
device as ONE jitted program (`paged_kv.core.commit.commit`) when the device
state is next needed (`pool.state`, a K/V write or gather, a scheduler step) or
`flush()` is called. So a scheduler step costs one bookkeeping dispatch and no
blocking read (`pool.runtime` counts both; `paged_kv.runtime.counters`).

The device is still checked: each commit compares what the device held with
what the host expected and returns a flag, read once it is ready (no wait); a
jitted step's reservation status is compared with the host's prediction the
same way. A difference raises `InternalInconsistency` at the next call. In
debug mode (`BlockPool(debug=True)` or `PAGED_KV_DEBUG=1`) every call flushes
and compares the whole mirror with the device synchronously (`verify()`).

Shapes come from fixed buckets derived from the config (`CommitWidths`, power-of-two
K/V lengths), so the set of programs is small and enumerable
(`paged_kv.scheduler.warmup` runs it). Assigning `pool.state` directly (a caller that ran a
transition itself) marks the mirror stale: the next call reloads it from the
device (one counted blocking read).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import compact, device_memory, kv, regions, slots
from paged_kv.core import resize as resize_lib
from paged_kv.core.commit import commit
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import (OOM_REASONS, BlockInUse, InternalInconsistency, InvalidArgument,
                                  InvalidBlock, InvalidSegment, InvalidSequence, PoolExhausted,
                                  RefCountOverflow, RefCountUnderflow, Status)
from paged_kv.core.page_copy import BLOCK_MOVE_IMPLS
from paged_kv.core.invariants import check_invariants
from paged_kv.core.segment_format import Segments, as_segments, empty_segments
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC, PoolState, init_pool
from paged_kv.pool import open_row
from paged_kv.pool import host_transitions as host_ops
from paged_kv.pool.changes import ChangeLog, CommitWidths, empty_batch
from paged_kv.pool.host_state import HostState
from paged_kv.runtime import executables
from paged_kv.runtime.counters import RuntimeCounters

DEBUG_ENV = "PAGED_KV_DEBUG"


def debug_default() -> bool:
  """Debug mode from the environment: `PAGED_KV_DEBUG=1` turns it on."""
  return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _bucket(x: int, low: int = 1) -> int:
  """Smallest power of two >= max(x, low, 1)."""
  return 1 << max(int(x) - 1, int(low) - 1, 0).bit_length()


def _pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full((size,) + a.shape[1:], fill, np.int32)
  out[:a.shape[0]] = a
  return out


_I32 = np.iinfo(np.int32)
_I32_MIN, _I32_MAX = int(_I32.min), int(_I32.max)
# Id arguments of at most this many entries are checked in plain Python.
_SMALL_IDS = 32
_NO_BLOCKS = np.zeros((0,), np.int64)
_NO_BLOCKS.setflags(write=False)


def _as_int_array(x, name: str) -> np.ndarray:
  """A 1-D int64 copy of `x`; refuses non-integers and values outside int32.

  The range is checked on the values as given, before any cast, so an unsigned
  `2**64 - 1` is reported as itself (not as the `-1` a cast would make of it).
  """
  if type(x) is np.ndarray and x.ndim == 1:
    if x.dtype == np.int32:
      return x.astype(np.int64)  # int32: nothing to check (the prefix cache's ids)
    if x.dtype == np.int64 and x.size <= _SMALL_IDS:  # a few: the range in plain Python
      if not x.size or _I32_MIN <= min(v := x.tolist()) and max(v) <= _I32_MAX:
        return x.copy()
  elif type(x) is list and len(x) <= _SMALL_IDS and all(type(v) is int for v in x):
    if not x or _I32_MIN <= min(x) and max(x) <= _I32_MAX:
      return np.array(x, np.int64)
  try:
    a = np.asarray(x)
  except (TypeError, ValueError) as e:
    raise InvalidArgument(f"{name} must be a 1-D array of ints, got {type(x).__name__}") from e
  if a.ndim == 0:
    a = a[None]
  if a.ndim != 1 or not (a.size == 0 or (np.issubdtype(a.dtype, np.integer)
                                         and a.dtype != np.bool_)):
    raise InvalidArgument(f"{name} must be a 1-D array of ints, got {a.dtype} {a.shape}")
  if a.size and (a.min() < _I32.min or a.max() > _I32.max):
    raise InvalidArgument(f"{name} has values outside int32: {a.min()}..{a.max()}")
  return a.astype(np.int64)


def _single_int(x) -> int | None:
  """The one value of a one-entry id argument (`3`, `[3]`, `(3,)`, an int scalar or a
  1-entry int array) when it is a plain integer within int32; else None (the caller
  takes its general, fully checked path, which reports any problem)."""
  if type(x) in (list, tuple):
    if len(x) != 1:
      return None
    x = x[0]
  if type(x) is int:
    return x if _I32_MIN <= x <= _I32_MAX else None
  if isinstance(x, np.ndarray):
    if x.size != 1 or x.ndim > 1:
      return None
    x = x.reshape(())[()]
  if isinstance(x, np.integer) and not isinstance(x, np.bool_):
    v = int(x)
    return v if _I32_MIN <= v <= _I32_MAX else None
  return None


def _fast_segments(x) -> np.ndarray | None:
  """`x` when it already is a C-contiguous `i32[n, 3]` array (what the prefix cache
  hands out: nothing to check or convert), else None."""
  if (type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 2 and x.shape[1] == 3
      and x.flags.c_contiguous):
    return x
  return None


def _as_int_scalar(x, name: str, *, low: int | None = None, high: int | None = None) -> int:
  """`x` as a Python int: a Python, numpy or JAX integer scalar, never a bool or float.

  Refuses values outside `[low, high)` (bounds optional) with `InvalidArgument`.
  """
  value = None
  if isinstance(x, (bool, np.bool_)):
    pass
  elif isinstance(x, (int, np.integer)):
    value = int(x)
  elif isinstance(x, (np.ndarray, jax.Array)) and x.shape == () and (
      np.issubdtype(x.dtype, np.integer) and x.dtype != np.bool_):
    value = int(x)
  if value is None:
    raise InvalidArgument(f"{name} must be an integer scalar, got {x!r}")
  if (low is not None and value < low) or (high is not None and value >= high):
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    raise InvalidArgument(f"{name} {value} outside [{lo}, {hi})")
  return value


def _as_kv_array(x, name: str):
  """`x` if it is an array (JAX or numpy); a nested list becomes a numpy array."""
  if isinstance(x, (jax.Array, np.ndarray)):
    return x
  try:
    a = np.asarray(x)
  except (TypeError, ValueError) as e:
    raise InvalidArgument(f"write_kv: {name} must be an array, got {type(x).__name__}") from e
  if a.dtype == object:
    raise InvalidArgument(f"write_kv: {name} must be a numeric array, got {type(x).__name__}")
  return a


def _table_segments_host(table) -> tuple[np.ndarray, np.ndarray]:
  """`(segs i64[S, 3], rows i64[S])`: every live table segment and its row (host)."""
  used = table.active[:, None] & (np.arange(table.block.shape[1])[None, :]
                                  < table.num_segments[:, None])
  rows = np.broadcast_to(np.arange(table.block.shape[0])[:, None], used.shape)[used]
  segs = np.stack([table.block[used], table.start[used], table.length[used]],
                  axis=1).astype(np.int64)
  return segs, rows.astype(np.int64)


_STATUS_OK, _STATUS_ABORTED = int(Status.OK), int(Status.ABORTED)


def raise_for_status(status: np.ndarray, what: str) -> None:
  """Raises the typed exception for the first failed entry of `status`."""
  status = np.asarray(status)
  if not status.any():  # all OK (0): the common case, without the enum comparisons
    return
  bad = np.flatnonzero((status != _STATUS_OK) & (status != _STATUS_ABORTED))
  if bad.size == 0:
    return
  i = int(bad[0])
  code = Status(int(status[i]))
  msg = f"{what}: entry {i} failed with {code.name}; nothing was applied"
  if code in OOM_REASONS:
    raise PoolExhausted(msg, reason=OOM_REASONS[code])
  raise {Status.INVALID_SEQUENCE: InvalidSequence, Status.INVALID_COUNT: InvalidArgument,
         Status.INVALID_BLOCK: InvalidBlock, Status.REF_UNDERFLOW: RefCountUnderflow,
         Status.INVALID_SEGMENT: InvalidSegment, Status.REF_OVERFLOW: RefCountOverflow,
         Status.BLOCK_IN_USE: BlockInUse}[code](msg)



@dataclasses.dataclass
class StepPrediction:
  """What a jitted step's `reserve_tokens` will do, decided on the mirror beforehand.

  Attributes:
    state: the flushed device state to hand to the step (donated there).
    slot_idx: `i32[B, T]` the slots each row's new tokens get (-1 padded).
    status: `i32[B]` each row's reservation status.
    touched_blocks: blocks the reservation changes (checked at the next commit).
    adopted: set once `adopt_step` took the step's state (the caller's signal not
      to hand it back again after a later exception).
    committed: the reservation is already in `state` (`BlockPool.reserve_step`:
      the host decided it and committed it; the step only reads it), rather than
      one the step makes on the device (`predict_step`).
    grow: with `committed`, `i32[B]` the tokens each row grows in place that the
      step applies itself, and `clock` the logical clock it sets
      (`paged_kv.model.plan.TailGrowth`).
  """

  state: PoolState
  slot_idx: np.ndarray
  status: np.ndarray
  touched_blocks: np.ndarray
  adopted: bool = False
  committed: bool = False
  grow: np.ndarray | None = None
  clock: int = 0


class BlockPool:
  """A block pool with a host-side API raising typed exceptions.

  Example:
    pool = BlockPool(PoolConfig(num_blocks=1024, block_size=16, num_layers=2,
                                num_kv_heads=2, head_dim=64))
    seq = pool.open_sequence()
    slots = pool.reserve_tokens([seq], [5])      # i32[1, 8], -1 padded (numpy)
    pool.write_kv(0, slots[:, :5], k, v, seq_ids=seq)   # k, v: [1, 5, kv_heads, head_dim]
    child = pool.fork(seq)
    pool.release([seq, child])

  The current `PoolState` is `pool.state` (reading it applies the queued
  changes: one commit); it may also be passed to the jitted transitions directly
  (they donate it, so reassign `pool.state` afterwards; the mirror then reloads).

  Segments in and out (`segments`, `open_sequence(segments=)`,
  `pack_slots(extra_segments=)`, `reclaim_slots`, `check_invariants`) are
  `Segments`: `int32[n, 3]` rows `(block, start, length)`, the format of
  `radix.PrefixCache` too. A pool shared with a prefix cache is driven through
  `paged_kv.cache.cached_pool.CachedPool`, which applies the cache's references.

  Args:
    config: the pool's config.
    state: an existing state (default: `init_pool(config)`); its mirror is read
      from the device at the first call.
    debug: flush and compare the whole mirror with the device after every call
      (default: `PAGED_KV_DEBUG` from the environment).

  Raises:
    PoolTooLarge: the pages need more memory than the device has free (checked
      before anything is allocated; `paged_kv.core.device_memory`).
  """

  def __init__(self, config: PoolConfig, state: PoolState | None = None, *,
               debug: bool | None = None):
    if not isinstance(config, PoolConfig):
      raise InvalidArgument(f"config must be a PoolConfig, got {type(config).__name__}")
    if debug is not None and not isinstance(debug, (bool, np.bool_)):
      raise InvalidArgument(f"debug must be a bool or None (PAGED_KV_DEBUG), got {debug!r}")
    self.config = config
    self.runtime = RuntimeCounters()
    self.debug = debug_default() if debug is None else bool(debug)
    self._log = ChangeLog(config)
    # A prediction's changes (the device makes them): the touched blocks only.
    self._scratch_log = ChangeLog(config, rows=False)
    self._checks: collections.deque = collections.deque()
    self.last_resize: resize_lib.ResizeReport | None = None  # the latest `resize`'s
    self._outside_refs: Callable[[], Segments] | None = None  # `bind_outside_references`
    if not isinstance(config, PoolConfig):
      raise InvalidArgument(f"config must be a PoolConfig, got {type(config).__name__}")
    executables.track_pool(self)  # a new shape's programs stay below the map limit
    if state is None:
      device_memory.check_fits(config)  # before anything is allocated
      with device_memory.allocating(config):
        self._state = _committed(init_pool(config))
      self._mirror: HostState | None = HostState.empty(config, self._log)
    else:
      self._state = _committed(state)
      self._mirror = None  # read from the device on first use

  # -- the device state and the mirror ---------------------------------------
  @property
  def state(self) -> PoolState:
    """The device state, with every queued change applied (a flush)."""
    self.flush()
    return self._state

  @state.setter
  def state(self, state: PoolState) -> None:
    """A state the caller computed (e.g. with a jitted transition): the mirror reloads."""
    self._log.reset(None)
    self._state = _committed(state)
    self._mirror = None

  @property
  def unflushed_state(self) -> PoolState:
    """The device state *without* applying the queued changes: for checks that look
    at its buffers only (`state_lost`), never for its values."""
    return self._state

  @property
  def host(self) -> HostState:
    """The host mirror of the bookkeeping (read it; change it only through the pool)."""
    if self._mirror is None:
      self.resync()
    return self._mirror

  def resync(self) -> None:
    """Reloads the mirror from the device (one blocking read of the bookkeeping arrays).

    Pending changes are applied first; pending checks are dropped (the device is
    taken as it is).
    """
    if self._mirror is not None:
      self.flush()
    self._checks.clear()
    self._log.reset(None)
    self._mirror = HostState.from_device(self._state, self.config, self._log)
    self.runtime.read("resync")

  def flush(self) -> None:
    """Sends the queued changes to the device: one `commit` per `CommitWidths` chunk.

    Also compares the results of earlier commits that are ready (no wait).
    """
    if self._mirror is not None and self._log.pending:
      for batch in self._log.batches(self._mirror):
        self._state, mismatch = commit(self._state, batch, config=self.config)
        self.runtime.dispatch("commit")
        self._checks.append(("commit", mismatch, None))
      self._log.reset(self._mirror)
    self.poll()

  def poll(self) -> None:
    """Compares the device results that are ready with the host's expectations.

    Raises:
      InternalInconsistency: a commit found the device holding other values than
        the mirror expected, or a step's reservation status differed from the
        prediction (the mirror is reloaded from the device first).
    """
    while self._checks and self._checks[0][1].is_ready():
      self._check(*self._checks.popleft())

  def _check(self, what: str, value, expected) -> None:
    self.runtime.deferred_checks += 1
    got = np.asarray(value)
    bad = (got != 0).any() if expected is None else not np.array_equal(got, expected)
    if bad:
      self._checks.clear()
      self._mirror = None  # the device is the truth from here: reload at the next call
      detail = (f"mismatch bits {int(got)} (1 blocks, 2 rows, 4 totals)" if expected is None
                else f"device {got.tolist()} != host {np.asarray(expected).tolist()}")
      raise InternalInconsistency(f"{what}: the device state differs from the host mirror "
                                  f"({detail}); the mirror will be reloaded from the device; "
                                  "check_invariants() says whether the device state is sound")

  def verify(self) -> None:
    """Flushes, waits for every pending check, and compares the whole mirror with
    the device (blocking reads). What debug mode runs after every call.

    Raises:
      InternalInconsistency: a difference (named field by field).
    """
    if self._mirror is None:
      return
    self.flush()
    while self._checks:
      what, value, expected = self._checks.popleft()
      if not value.is_ready():
        self.runtime.read("check")
      self._check(what, value, expected)
    diff = self._mirror.differences(self._state)
    self.runtime.read("check")
    if diff:
      self._mirror = None
      raise InternalInconsistency("device state != host mirror: " + "; ".join(diff))

  def warm_commit(self, widths: CommitWidths) -> None:
    """Runs (compiles) the commit program of `widths` on a batch that changes nothing."""
    self.flush()
    self._state, mismatch = commit(self._state, empty_batch(self.host, widths),
                                   config=self.config)
    self.runtime.dispatch("commit")
    self._checks.append(("commit (warm-up)", mismatch, None))

  def lower_commit(self, widths: CommitWidths) -> jax.stages.Lowered:
    """The commit program of `widths`, lowered (not run): `warm_commit` compiles it,
    or a warm-up compiles it ahead, concurrently with other programs."""
    return commit.lower(self.unflushed_state, empty_batch(self.host, widths),
                        config=self.config)

  def warm_data(self, length: int) -> None:
    """Runs (compiles) the K/V gather and the layered write at the power-of-two
    bucket of `length` tokens (swap, persistence), changing nothing."""
    width = _bucket(length, 16)
    state = self.state
    k, v, _ = kv.gather_kv(state, np.int32(0), max_len=width)
    self._state = _write_layers(state, np.full((width,), -1, np.int32), k, v)
    self.runtime.dispatch("data", 2)

  def _done(self) -> None:
    """End of a public call: the checks that are ready, and debug mode's full compare."""
    if self.debug:
      self.verify()
    elif self._log.wants_flush:
      self.flush()
    else:
      self.poll()

  # -- a jitted step that reserves on the device -------------------------------
  def predict_step(self, seq_ids, num_new, *, max_new_tokens: int) -> StepPrediction:
    """Flushes and decides on the mirror what the step's `reserve_tokens(atomic=False)`
    will do on the device; hand `prediction.state` to the step, then `adopt_step`.

    The reservation is not validated beyond what `reserve_tokens` itself checks
    (statuses per row; failed rows change nothing), exactly as on the device.
    """
    ids = np.asarray(seq_ids, np.int64).reshape(-1)
    counts = np.asarray(num_new, np.int64).reshape(-1)
    self.flush()
    host = self.host
    host.log = self._scratch_log
    try:
      slot_idx, status = host_ops.reserve(host, ids, counts, max_new_tokens=max_new_tokens,
                                          atomic=False)
    finally:
      host.log = self._log
    touched = self._scratch_log.touched_blocks(host)
    self._scratch_log.reset(None)
    return StepPrediction(state=self._state, slot_idx=slot_idx, status=status,
                          touched_blocks=touched)

  def reserve_step(self, seq_ids, num_new, *, max_new_tokens: int,
                   grow_in_step: bool = False) -> StepPrediction:
    """Reserves a step's slots on the mirror and commits them before the step runs.

    The same reservation as `predict_step`'s (`reserve_tokens(atomic=False)`'s
    algorithm: statuses per row, failed rows change nothing), but the host's
    decision is final: the rows' new segments and lengths and the blocks' slots
    and counts go to the device in this flush's commit (one dispatch of an
    already compiled commit program, with whatever else was queued), so the
    step reads the table as it is and reserves nothing itself (a plan's
    `reserved`, `paged_kv.model.metadata.reserved_slots`). Hand
    `prediction.state` to the step, then `adopt_step` (or `abandon_step`).

    `grow_in_step`: a decode row that grows in place by one token (and is not in
    the window's log already) stays out of the commit and the step applies it
    (`prediction.grow` and `.clock`, handed over as `ReservedSlots.grow`:
    `paged_kv.core.growth.grow_tails`), so a decode step commits only the rows
    that took a block. The step must then run on `prediction.state` and apply
    them (or be abandoned: the mirror reloads).

    Returns:
      A `StepPrediction` with `committed` set: `slot_idx i32[B, max_new_tokens]`
      (-1 padded), `status i32[B]`, `state` holding the reservation (but for
      `grow i32[B]`, all zeros unless `grow_in_step`).
    """
    ids = np.asarray(seq_ids, np.int64).reshape(-1)
    counts = np.asarray(num_new, np.int64).reshape(-1)
    grow = np.zeros(ids.shape, np.int32)
    host = self.host
    slot_idx, status = host_ops.reserve(host, ids, counts, max_new_tokens=max_new_tokens,
                                        atomic=False, grow=grow if grow_in_step else None)
    self.flush()
    self._log.settle_growth(host)
    return StepPrediction(state=self._state, slot_idx=slot_idx, status=status,
                          touched_blocks=_NO_BLOCKS, committed=True, grow=grow,
                          clock=host.step)

  def adopt_step(self, state: PoolState, prediction: StepPrediction,
                 device_status=None) -> None:
    """Takes the state a step returned; its reservation was `prediction`'s.

    For a step that reserved on the device (`predict_step`), the touched blocks
    are checked at the next commit (their values now must be the device's), and
    `device_status` (the step's status, a device or host array of at least B
    entries) against the prediction: at once for a host array, once ready for a
    device array. A `reserve_step` reservation was committed before the step,
    whose status is the host's own: nothing is left to compare.

    Raises:
      InternalInconsistency: a host `device_status` differs from the prediction.
    """
    self._state = state
    prediction.adopted = True
    self.runtime.dispatch("step")
    if prediction.committed:
      self._done()
      return
    self._log.adopt(self._mirror, prediction.touched_blocks)
    self._log.expected = self._mirror.totals()
    if device_status is not None:
      b = prediction.status.shape[0]
      if isinstance(device_status, jax.Array):
        self._checks.append(("jitted step reservation", device_status[:b] if
                             device_status.shape[0] != b else device_status, prediction.status))
      else:
        self._check("jitted step reservation", np.asarray(device_status)[:b], prediction.status)
    self._done()

  def abandon_step(self, state: PoolState | None = None) -> None:
    """The step raised: keep `state` if it returned one, and reload the mirror."""
    if state is not None:
      self._state = state
    self._log.reset(None)
    self._mirror = None

  # -- queries -------------------------------------------------------------
  @property
  def num_free_blocks(self) -> int:
    return self.host.free.num_free

  def active_sequences(self) -> np.ndarray:
    return np.flatnonzero(self.host.active)

  def _check_ids(self, ids: np.ndarray, *, active: bool | None) -> None:
    if ids.size <= _SMALL_IDS:  # a few: the same checks in plain Python
      lst = ids.tolist()
      if lst and (min(lst) < 0 or max(lst) >= self.config.max_seqs):
        raise InvalidSequence(f"sequence ids {lst} outside [0, {self.config.max_seqs})")
      if len(set(lst)) != len(lst):
        raise InvalidSequence(f"repeated sequence ids in {lst}")
      if active is not None and lst:
        act = self.host.active
        bad = [i for i in lst if bool(act[i]) != active]
        if bad:
          raise InvalidSequence(f"sequences {bad} are {'not ' if active else ''}active")
      return
    if ids.size and (ids.min() < 0 or ids.max() >= self.config.max_seqs):
      raise InvalidSequence(f"sequence ids {ids.tolist()} outside [0, {self.config.max_seqs})")
    if len(set(ids.tolist())) != ids.size:
      raise InvalidSequence(f"repeated sequence ids in {ids.tolist()}")
    if active is not None and ids.size:
      act = self.host.active[ids]
      if not (act == active).all():
        bad = ids[act != active].tolist()
        raise InvalidSequence(f"sequences {bad} are {'not ' if active else ''}active")

  def _check_id(self, i: int, *, active: bool) -> None:
    """`_check_ids` of one id (same errors)."""
    if not 0 <= i < self.config.max_seqs:
      raise InvalidSequence(f"sequence ids {[i]} outside [0, {self.config.max_seqs})")
    if bool(self.host.active[i]) != active:
      raise InvalidSequence(f"sequences {[i]} are {'not ' if active else ''}active")

  def seq_len(self, seq_id: int) -> int:
    ids = _as_int_array(seq_id, "seq_id")
    self._check_ids(ids, active=True)
    return int(self.host.seq_len[ids[0]])

  def segments(self, seq_id: int) -> Segments:
    """`i32[n, 3]` `(block, start, length)` rows of one live sequence, in token order.

    One row of `segments_many`.
    """
    return self.segments_many([seq_id])[0]

  def segments_many(self, seq_ids) -> list[Segments]:
    """The `segments` of several live sequences (distinct rows), from the mirror."""
    i = _single_int(seq_ids)
    if i is not None:
      self._check_id(i, active=True)
      return [self.host.row_segments(i)]
    ids = _as_int_array(seq_ids, "seq_ids")
    self._check_ids(ids, active=True)
    h = self.host
    return [h.row_segments(int(i)) for i in ids]

  def gather_kv(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Logical `k, v: [num_layers, num_kv_heads, seq_len, head_dim]` of one sequence.

    Host arrays: one jitted gather at a power-of-two length, read to the host
    and cut there (no program per length). `gather_kv_padded` keeps them on
    the device.
    """
    k, v, length = self.gather_kv_padded(seq_id)
    k, v = jax.device_get((k, v))
    self.runtime.read("data")
    return k[:, :, :length], v[:, :, :length]

  def gather_kv_padded(self, seq_id: int) -> tuple[jax.Array, jax.Array, int]:
    """`(k, v, length)`: the logical K/V on the device, zero-padded to a power of two
    (>= 16) along the token axis; no host read."""
    length = self.seq_len(seq_id)
    state = self.state
    k, v, _ = kv.gather_kv(state, np.int32(seq_id), max_len=_bucket(length, 16))
    self.runtime.dispatch("data")
    return k, v, length

  def check_invariants(self, extra_segments: Segments | None = None, *,
                       extra_blocks=None) -> None:
    """Raises `InvariantViolation` unless the state is consistent.

    Flushes, compares the mirror with the device (`verify`: blocking reads),
    then checks the device state.

    Args:
      extra_segments: `i32[n, 3]` `(block, start, length)` rows held outside the
        tables (one reference each, e.g. a prefix cache's); None: those of the
        holder bound by `bind_outside_references` (a `CachedPool` binds its cache),
        else only the tables hold references.
      extra_blocks: block ids held outside the tables without a segment, one
        reference each: what the caller holds from `allocate()` (the pool does
        not track it). None: none.
    """
    if extra_segments is None and self._outside_refs is not None:
      extra_segments = self._outside_refs()
    self.verify()
    check_invariants(self.state, extra_segments, extra_blocks=extra_blocks)

  def bind_outside_references(self, segment_refs: Callable[[], Segments] | None) -> None:
    """Names the holder of references outside the tables (a prefix cache's).

    `check_invariants()` without `extra_segments` then counts `segment_refs()`'s
    rows, so the pool under a `CachedPool` (which binds its cache here) checks as
    healthy by itself. None unbinds.

    Raises:
      InvalidArgument: `segment_refs` is neither callable nor None.
    """
    if segment_refs is not None and not callable(segment_refs):
      raise InvalidArgument(f"segment_refs must be callable or None, got {segment_refs!r}")
    self._outside_refs = segment_refs

  # -- transitions ---------------------------------------------------------
  def open_sequence(self, segments: Segments | None = None,
                    seq_id: int | None = None, *, copy_tail: bool = False) -> int:
    """Activates a row (the lowest free one unless `seq_id` is given).

    One row of `open_sequences` (same checks, same errors).

    Args:
      segments: `i32[n, 3]` `(block, start, length)` rows of a shared prefix (e.g. a
        `PrefixCache.match`'s `segments`), each gaining a reference; they must lie
        on live blocks and written slots. None or empty: an empty sequence.
      seq_id: the row to open; default the lowest free one.
      copy_tail: then copy the row's tail into a fresh exclusive block when it is
        shared or slotted and a block is free, so that appends continue in place:
        `cow_split([row], skip_exhausted=True)` right after the open, in one call
        (the row opens on the copy).

    Returns:
      The row.

    Raises:
      InvalidSegmentLayout: `segments` is not `i32[n, 3]`.
      InvalidBlock / InvalidSegment: a segment off a live block, on unwritten slots, or
        on dead slots (a block only the tables hold, on slots none of them covers).
      PoolExhausted: no free row, or more than `max_segments` segments.
      InvalidSequence: `seq_id` out of range or active.
    """
    if seq_id is None:
      row = self._open_one(segments, copy_tail=copy_tail)
      if row is not None:
        return row
    rows = self.open_sequences([segments], None if seq_id is None else [seq_id])
    if copy_tail:
      self.cow_split(rows, skip_exhausted=True)
    return int(rows[0])

  def open_sequences(self, segments: Sequence[Segments | None],
                     seq_ids=None) -> np.ndarray:
    """Activates one row per entry of `segments`, atomically.

    Args:
      segments: per new row, `i32[n, 3]` `(block, start, length)` rows of a shared
        prefix (each gaining a reference), or None / empty for an empty sequence.
      seq_ids: the rows to open (`int[B]`, distinct, inactive); default the `B`
        lowest free rows, in order.

    Returns:
      `i64[B]` the rows, in the order of `segments`.

    Raises:
      The errors of `open_sequence`, for the first row that fails; nothing is
      opened then (atomic).
    """
    if len(segments) == 1 and seq_ids is None:
      row = self._open_one(segments[0])
      if row is not None:
        return np.array([row], np.int64)
    segs = [empty_segments() if s is None else as_segments(s) for s in segments]
    k = len(segs)
    h = self.host
    if seq_ids is None:
      free = np.flatnonzero(~h.active)
      if free.size < k:
        raise PoolExhausted(f"all {self.config.max_seqs} sequence rows are in use"
                            if free.size == 0 else
                            f"{k} rows wanted, {free.size} of {self.config.max_seqs} free",
                            reason="no_free_row")
      ids = free[:k].astype(np.int64)
    else:
      ids = _as_int_array(seq_ids, "seq_ids")
      if ids.size != k:
        raise InvalidArgument(f"{ids.size} seq_ids for {k} rows of segments")
      self._check_ids(ids, active=False)
    if k == 0:
      return ids
    nums = np.array([len(x) for x in segs], np.int64)
    p = int(nums.max())
    if p > self.config.max_segments:
      raise PoolExhausted(f"{p} segments > max_segments {self.config.max_segments}",
                          reason="table_full")
    flat = np.concatenate(segs) if p else np.zeros((0, 3), np.int32)
    if p and (flat[:, 0].min() < 0 or flat[:, 0].max() >= self.config.num_blocks):
      raise InvalidBlock(f"segment blocks {flat[:, 0].tolist()} outside "
                         f"[0, {self.config.num_blocks})")
    grid = np.zeros((3, k, max(p, 1)), np.int64)
    if p:
      rows = np.repeat(np.arange(k), nums)
      cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(nums) - nums, nums)
      grid[:, rows, cols] = flat.T
      used = np.arange(grid.shape[2])[None, :] < nums[:, None]
      dead = host_ops.dead_segments(h, grid[0], grid[1], grid[2], used)
      if dead.any():
        r, c = (int(x[0]) for x in np.nonzero(dead))
        b, start, length = (int(x) for x in grid[:, r, c])
        raise InvalidSegment(
            f"open_sequence: row {r}'s segment ({b}, {start}, {length}) lies on dead "
            f"slots of block {b} (handed out, but no live segment covers them and nothing "
            "outside the tables holds the block); nothing was applied")
    status = host_ops.open_rows(h, ids, grid[0], grid[1], grid[2], nums)
    raise_for_status(status, "open_sequence")
    self._done()
    return ids

  def _open_one(self, segments, *, copy_tail: bool = False) -> int | None:
    """`open_sequences` of one row in the lowest free row, without the batch work
    (`copy_tail`: and the tail copy of `open_sequence`); None when the general path
    must decide (a problem to report, or segments whose blocks no outside holder
    vouches for: the dead-slot check); nothing changed then."""
    segs = empty_segments() if segments is None else _fast_segments(segments)
    if segs is None:
      return None
    h = self.host
    free = ~h.active
    row = int(free.argmax())
    if not free[row]:
      return None
    if not segs.shape[0]:
      status = host_ops.open_rows(h, np.array([row]), segs[None, :, 0], segs[None, :, 1],
                                  segs[None, :, 2], np.array([0]))
      if status[0]:
        return None
      self._done()
      return row
    counts = open_row.held_counts(h, segs)
    if counts is None:
      return None
    if (copy_tail and int(segs[-1, 2]) < self.config.block_size and h.free.num_free
        and self._log.page_conflict(segs[-1:, 0], h.free.lowest(1), copies=1)):
      self.flush()  # the copy (into the lowest free block) must wait for the window's pages
    open_row.open_held(h, row, segs, *counts, copy_tail=copy_tail)
    self._done()
    return row

  def _open_few(self, segments: Sequence, copy_tails: Sequence[bool]) -> np.ndarray | None:
    """`open_sequences(segments)` in the lowest free rows, then `cow_split(rows marked
    in copy_tails, skip_exhausted=True)`: every row checked in one pass, the rows
    without a tail copy opened in one pass (`open_row.open_many_held`), then the
    others one at a time in row order (`_open_one`); the same rows, blocks and
    copies as one open after the other, since an open changes nothing another
    row's checks read. None when a row needs the general path (nothing changed)."""
    h = self.host
    rows = np.flatnonzero(~h.active)[:len(segments)]
    if rows.size < len(segments):
      return None
    segs = [empty_segments() if x is None else _fast_segments(x) for x in segments]
    if any(x is None for x in segs):
      return None
    counts = open_row.held_counts_many(h, segs)
    if counts is None:
      return None
    if any(copy_tails):  # those rows after the others, in order (the lowest free rows left)
      alone = np.array(copy_tails, bool)
      blocks, ref, tr = counts
      keep = np.repeat(~alone, [x.shape[0] for x in segs])
      batch = [x for x, a in zip(segs, copy_tails) if not a]
      if batch:
        open_row.open_many_held(h, rows[~alone], batch, blocks[keep], ref[keep], tr[keep])
      for x in itertools.compress(segs, copy_tails):
        if self._open_one(x, copy_tail=True) is None:
          raise InternalInconsistency("open: a row checked to open was refused")
    else:
      open_row.open_many_held(h, rows, segs, *counts)
    self._done()
    return rows.astype(np.int64)

  def reserve_tokens(self, seq_ids, num_new) -> np.ndarray:
    """Room for `num_new[i]` more tokens of each sequence; returns `slot_idx i32[B, T]`.

    `T` is `max(num_new)` rounded up to a power of two; entries past `num_new[i]`
    are -1. A host array: the slots are decided on the mirror (the device
    applies them at the next flush).
    """
    i, count = _single_int(seq_ids), _single_int(num_new)
    if i is not None and count is not None and count >= 0:  # one row: no array work
      self._check_id(i, active=True)
      if -(-count // self.config.block_size) > self.config.num_blocks:
        raise PoolExhausted(f"the batch needs up to {-(-count // self.config.block_size)} "
                            f"blocks; the pool has {self.config.num_blocks}",
                            reason="no_free_block")
      slot_idx, status = host_ops.reserve(self.host, np.array([i]), np.array([count]),
                                          max_new_tokens=_bucket(count), atomic=True)
      if status[0]:
        raise_for_status(status, "reserve_tokens")
      self._done()
      return slot_idx
    ids, counts = _as_int_array(seq_ids, "seq_ids"), _as_int_array(num_new, "num_new")
    if ids.shape != counts.shape:
      raise InvalidArgument(f"seq_ids {ids.shape} and num_new {counts.shape} differ in shape")
    self._check_ids(ids, active=True)
    if counts.size and counts.min() < 0:
      raise InvalidArgument(f"num_new must be >= 0, got {counts.tolist()}")
    bs = self.config.block_size
    biggest = int(counts.max()) if counts.size else 0
    need_upper = int(np.sum(-(-counts // bs)))
    if need_upper > self.config.num_blocks:
      raise PoolExhausted(f"the batch needs up to {need_upper} blocks; the pool has "
                          f"{self.config.num_blocks}", reason="no_free_block")
    slot_idx, status = host_ops.reserve(self.host, ids, counts,
                                           max_new_tokens=_bucket(biggest), atomic=True)
    raise_for_status(status, "reserve_tokens")
    self._done()
    return slot_idx

  def write_kv(self, layer: int, slot_idx, k: jax.Array, v: jax.Array, *,
               seq_ids) -> None:
    """Writes new tokens' K/V of one layer; `k, v: slot_idx.shape + (kv_heads, head_dim)`.

    Checked: every slot (`-1` = skip) must be an integer in `[0, num_slots)` (no
    cast first: an int64 `2**32 + s` or a float `4.9` is refused, not read as
    `s` or `4`), named once in the call, on a live block, handed out
    (`reserve_tokens`), and *exclusively* the writer's: covered by exactly one live
    table segment, of the sequence `seq_ids` names for its row, on a block no
    holder outside the tables (a prefix cache, an `allocate()` caller) references.
    So a write can never land in another sequence's tokens, a shared prefix, a
    cached block or a free block. The writer is required: without it a slot of
    another live sequence could not be told from one's own.

    The checks read the mirror: this is the host API (swap-in, cache load,
    tests), not the decode path. Model code writes inside its jitted step with
    `paged_kv.core.kv.write_kv` / `paged_kv.model.paged_attention`, which trust
    `reserve_tokens`' output and check nothing (see their docstrings).

    Args:
      layer: an integer scalar (Python, numpy or JAX; not a bool) in
        `[0, num_layers)`.
      slot_idx: int array of flat physical slots (`block * block_size + offset`).
      k, v: arrays (JAX or numpy) of the config dtype.
      seq_ids: the writer of each row of `slot_idx` (`int[B]` for a `[B, ...]`
        `slot_idx`, as `reserve_tokens` takes them; a 1-D `slot_idx`'s rows are its
        slots), or one live sequence (an int) for every slot.

    Raises:
      InvalidArgument: bad layer, dtype, shape or value type; a slot named twice.
      InvalidBlock: a slot out of range or on a free block.
      InvalidSegment: a slot never handed out, or no live sequence's.
      BlockInUse: a slot shared, held outside the tables, or another sequence's.
      InvalidSequence: a `seq_ids` entry out of range or inactive.
    """
    c = self.config
    layer = _as_int_scalar(layer, "layer", low=0, high=c.num_layers)
    try:
      s = np.asarray(slot_idx)
    except (TypeError, ValueError) as e:
      raise InvalidArgument(f"write_kv: slot_idx must be an int array, got "
                            f"{type(slot_idx).__name__}") from e
    if isinstance(slot_idx, jax.Array):
      self.runtime.read("data")
    if s.size and (s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.integer)):
      raise InvalidArgument(f"write_kv: slot_idx must be an int array, got {s.dtype}")
    if s.size and (s.min() < -1 or s.max() >= c.num_slots):
      raise InvalidBlock(f"write_kv: slot index outside [-1, {c.num_slots}): "
                         f"{s.min()}..{s.max()}")
    s = s.astype(np.int32)
    k, v = _as_kv_array(k, "k"), _as_kv_array(v, "v")
    self._write(lambda state: _write_state(state, np.int32(layer), s, k, v), "write_kv", s, k, v,
                tuple(s.shape) + (c.num_kv_heads, c.head_dim), seq_ids)

  def write_kv_layers(self, slot_idx, k, v, *, seq_ids) -> None:
    """Writes every layer's K/V of the tokens at `slot_idx` in one jitted write.

    What restores a sequence (swap-in, a cache load): `k, v: [num_layers,
    num_kv_heads, T, head_dim]` (the layout `gather_kv` returns), `slot_idx:
    int[T]` (`-1` = skip, e.g. padding to a power of two), `seq_ids`: the writer
    of each slot (`int[T]`) or one sequence for all. The slots are checked as
    `write_kv`'s. One program per `T`: pad `T` to a few sizes.

    Raises:
      The errors of `write_kv`.
    """
    c = self.config
    s = np.asarray(slot_idx)
    if s.ndim != 1 or (s.size and (s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.integer))):
      raise InvalidArgument(f"write_kv_layers: slot_idx must be a 1-D int array, got "
                            f"{s.dtype}{list(s.shape)}")
    if s.size and (s.min() < -1 or s.max() >= c.num_slots):
      raise InvalidBlock(f"write_kv_layers: slot index outside [-1, {c.num_slots}): "
                         f"{s.min()}..{s.max()}")
    s = s.astype(np.int32)
    self._write(lambda state: _write_layers(state, s, k, v), "write_kv_layers", s, k, v,
                (c.num_layers, c.num_kv_heads, s.shape[0], c.head_dim), seq_ids)

  def _write(self, program, what: str, s: np.ndarray, k, v, want: tuple, seq_ids) -> None:
    """The end of a K/V write: `k`/`v` of shape `want` and the pool's dtype, the slots'
    ownership checks (`write_kv`'s docstring), then `program(state)` on the flushed state."""
    dtype = self.config.jnp_dtype
    for name, x in (("k", k), ("v", v)):
      if tuple(x.shape) != want or x.dtype != dtype:
        raise InvalidArgument(f"{what}: {name} is {x.dtype}{list(x.shape)}, expected "
                              f"{dtype}{list(want)}")
    self._check_write_targets(s, seq_ids)
    self._state = program(self.state)
    self.runtime.dispatch("data")
    self._done()

  def _check_write_targets(self, s: np.ndarray, seq_ids) -> None:
    """`write_kv`'s ownership checks (on the mirror; see its docstring)."""
    c = self.config
    bs = c.block_size
    h = self.host
    one = _single_int(seq_ids) if np.ndim(seq_ids) == 0 else None
    if one is not None:  # one writer for every slot
      self._check_id(one, active=True)
      writer = np.full(s.size, one, np.int64)
    else:
      ids = _as_int_array(seq_ids, "seq_ids")
      if s.ndim == 0 or ids.shape != s.shape[:1]:
        raise InvalidArgument(f"write_kv: seq_ids {ids.shape} must give one sequence per "
                              f"row of slot_idx {s.shape}, or be one sequence")
      writer = np.broadcast_to(ids.reshape((-1,) + (1,) * (s.ndim - 1)), s.shape).reshape(-1)
    flat = s.reshape(-1).astype(np.int64)
    keep = flat >= 0
    flat = flat[keep]
    writer = writer[keep]  # a padding slot's writer is not checked
    if one is None and writer.size:
      self._check_ids(np.unique(writer), active=True)
    if flat.size == 0:
      return
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
      raise InvalidArgument(f"write_kv: slots {uniq[counts > 1][:8].tolist()} named more than "
                            "once in one call (the winner would be undefined)")
    blk, off = flat // bs, flat % bs
    ref = h.ref_count[blk].astype(np.int64)
    free = ref == 0
    if free.any():
      raise InvalidBlock(f"write_kv: slots {flat[free][:8].tolist()} lie on free blocks")
    words = h.slots[blk]
    bit = (words[np.arange(flat.size), off // 32] >> (off % 32).astype(np.uint32)) & 1
    if not bit.all():
      raise InvalidSegment(f"write_kv: slots {flat[bit == 0][:8].tolist()} were never handed "
                           "out (reserve_tokens first)")
    held_outside = ref > h.table_refs[blk]
    if held_outside.any():
      raise BlockInUse(f"write_kv: slots {flat[held_outside][:8].tolist()} lie on blocks held "
                       "outside the tables too (a prefix cache or an allocate() caller): "
                       "their K/V may be read elsewhere")
    used = h.used_mask()
    on = used & np.isin(h.block, np.unique(blk))
    rows = np.broadcast_to(np.arange(c.max_seqs)[:, None], used.shape)[on].astype(np.int64)
    segs = np.stack([h.block[on], h.start[on], h.length[on]], axis=1).astype(np.int64)
    rel = flat[:, None] - (segs[None, :, 0] * bs + segs[None, :, 1])
    cover = (rel >= 0) & (rel < segs[None, :, 2])
    num_cover = cover.sum(axis=1)
    if (num_cover == 0).any():
      raise InvalidSegment(f"write_kv: slots {flat[num_cover == 0][:8].tolist()} belong to "
                           "no live sequence")
    if (num_cover > 1).any():
      raise BlockInUse(f"write_kv: slots {flat[num_cover > 1][:8].tolist()} are shared by "
                       "several segments (a fork or a shared prefix): never overwritten")
    owner = rows[np.argmax(cover, axis=1)]
    wrong = owner != writer
    if wrong.any():
      i = int(np.argmax(wrong))
      raise BlockInUse(f"write_kv: slot {int(flat[i])} belongs to sequence {int(owner[i])}, "
                       f"not to the writer {int(writer[i])}")

  def release(self, seq_ids, *, ref_deltas=None) -> None:
    """Ends the given live sequences; their blocks lose a reference each.

    Args:
      seq_ids: distinct live rows.
      ref_deltas: optional `(block_ids, deltas)` of holders outside the tables
        (a prefix cache taking the rows' segments) applied first, with the checks
        of `apply_ref_deltas` against the state before the release; then both
        happen atomically (`segments.release_with_refs`).

    Raises:
      InvalidSequence: a row out of range, repeated or not live. The errors of
      `apply_ref_deltas` for `ref_deltas`. Nothing changes on error.
    """
    i = _single_int(seq_ids)
    if i is not None and ref_deltas is None:  # one row: no array work
      self._check_id(i, active=True)
      status = host_ops.release(self.host, np.array([i]), atomic=True)
      if status[0]:
        raise_for_status(status, "release")
      self._done()
      return
    ids = _as_int_array(seq_ids, "seq_ids")
    self._check_ids(ids, active=True)
    h = self.host
    if ref_deltas is None:
      raise_for_status(host_ops.release(h, ids, atomic=True), "release")
      self._done()
      return
    blk, d = self._ref_delta_args(*ref_deltas)
    status, ref_status = host_ops.release_with_refs(h, ids, blk, d)
    raise_for_status(ref_status, "release (ref_deltas)")
    raise_for_status(status, "release")
    self._done()

  def fork(self, src: int, dst: int | None = None) -> int:
    """A new sequence sharing every segment of `src`; returns its row."""
    self._check_ids(_as_int_array(src, "src"), active=True)
    if dst is None:
      free = np.flatnonzero(~self.host.active)
      if free.size == 0:
        raise PoolExhausted("no free sequence row for the fork", reason="no_free_row")
      dst = int(free[0])
    self._check_ids(_as_int_array(dst, "dst"), active=False)
    status = host_ops.fork(self.host, np.array([int(src)]), np.array([int(dst)]))
    raise_for_status(status, "fork")
    self._done()
    return int(dst)

  def allocate(self, num: int, contiguous: str = "prefer") -> np.ndarray:
    """`num` blocks owned by the caller (ref_count 1), ascending.

    The caller holds one reference on each, outside the tables: it drops them
    with `apply_ref_deltas(ids, -1)` and names them to
    `check_invariants(extra_blocks=ids)` meanwhile.

    Args:
      num: an integer scalar >= 0 (not a bool).
      contiguous: `"prefer"`, `"require"` or `"never"` (see `core.alloc.allocate`).
    """
    if (isinstance(num, (bool, np.bool_)) or not isinstance(num, (int, np.integer))
        or num < 0):
      raise InvalidArgument(f"num must be an int >= 0, got {num!r}")
    if not isinstance(contiguous, str) or contiguous not in ("prefer", "require", "never"):
      raise InvalidArgument(f"contiguous must be one of ('prefer', 'require', 'never'), got "
                            f"{contiguous!r}")
    num = int(num)
    if num > self.config.num_blocks:
      raise PoolExhausted(f"{num} blocks requested; the pool has {self.config.num_blocks}",
                          reason="no_free_block")
    ids, status = host_ops.allocate(self.host, num, contiguous=contiguous)
    raise_for_status(np.array([status]), "allocate")
    self._done()
    return ids.astype(np.int32)

  def apply_ref_deltas(self, block_ids, deltas) -> None:
    """Applies reference changes of holders outside the tables, atomically.

    For a prefix cache's or an `allocate()` caller's references (a `CachedPool`
    applies its cache's itself). Refused, with nothing changed: a block id out of
    range (`InvalidBlock`), an incref of a free block (`InvalidBlock`), a count
    below zero (`RefCountUnderflow`) or beyond int32 (`RefCountOverflow`, summed
    per block in int64 on the host), and a decref that would take a block below
    the references live sequence tables hold on it (`BlockInUse`: it would free
    or under-count a block a live sequence still reads).
    """
    ids, d = self._ref_delta_args(block_ids, deltas)
    raise_for_status(host_ops.apply_ref_deltas(self.host, ids, d), "apply_ref_deltas")
    self._done()

  def _ref_delta_args(self, block_ids, deltas) -> tuple[np.ndarray, np.ndarray]:
    """`apply_ref_deltas`' host checks; returns the ids and deltas as int64 arrays."""
    ids, d = _as_int_array(block_ids, "block_ids"), _as_int_array(deltas, "deltas")
    if ids.shape != d.shape:
      raise InvalidArgument(f"block_ids {ids.shape} and deltas {d.shape} differ in shape")
    if ids.size and d.dtype == np.int64 and (d.size * int(np.abs(d).max()) <= _I32_MAX):
      if ids.min() < 0 or ids.max() >= self.config.num_blocks:
        raise InvalidBlock(f"block ids outside [0, {self.config.num_blocks}): {ids.tolist()}")
      return ids, d  # no block can gain more than int32 holds
    if ids.size and (ids.min() < 0 or ids.max() >= self.config.num_blocks):
      raise InvalidBlock(f"block ids outside [0, {self.config.num_blocks}): {ids.tolist()}")
    # A block's sum can pass int32 only if the gains together do (the common case:
    # they do not, and the per-block sums are not needed).
    if ids.size and int(np.maximum(d, 0).sum()) > _I32.max:
      uniq, inv = np.unique(ids, return_inverse=True)
      summed = np.zeros(uniq.size, np.int64)
      np.add.at(summed, inv, d)  # int64: K entries of int32 cannot overflow it
      if summed.max() > _I32.max:
        b = int(uniq[np.argmax(summed)])
        raise RefCountOverflow(f"apply_ref_deltas: block {b} would gain {int(summed.max())} "
                               f"references, beyond int32 ({_I32.max}); nothing was applied")
    return ids, d

  # -- fragmentation (issue B): COW, packing, compaction, regions ---------------
  def cow_split(self, seq_ids, *, skip_exhausted: bool = False) -> np.ndarray:
    """Copies shared/slotted tails into exclusive blocks; returns `bool[B]` split.

    Atomic by default: with too few free blocks for every copy, nothing is split
    and `PoolExhausted` is raised. With `skip_exhausted`, the rows are served in
    order while blocks last and the rest are left as they are (`split` False),
    as if each row had been split alone, one call after the other.
    """
    i = _single_int(seq_ids)
    if i is not None:
      self._check_id(i, active=True)
      ids = np.array([i], np.int64)
    else:
      ids = _as_int_array(seq_ids, "seq_ids")
      self._check_ids(ids, active=True)
    h = self.host
    tails = h.block[ids, np.maximum(h.num_segments[ids] - 1, 0)]
    if self._log.page_conflict(tails, self._log.free_page_dsts(h), copies=ids.size):
      self.flush()
    split, status = host_ops.cow_split(h, ids, atomic=not skip_exhausted)
    if skip_exhausted:  # the rows were checked above: only a missing block can fail them
      status = np.where(status == Status.NO_FREE_BLOCK, Status.OK, status)
    raise_for_status(status, "cow_split")
    self._done()
    return split

  def pack_slots(self, table_segments=(), extra_segments: Segments = (), *,
                 groups=None, block_groups=None) -> "PackResult":
    """Packs short segments into slotted blocks (see `paged_kv.core.slots`).

    Runs synchronously on the device (the mirror does not model the placement):
    the queued changes are flushed, the transition's status is read, and the
    mirror reloads (blocking reads, counted in `runtime`).

    Args:
      table_segments: `i32[T, 2]` `(row, col)` pairs naming segments of live
        sequences (positions in the tables, not segments).
      extra_segments: `i32[E, 3]` `(block, start, length)` rows held outside the
        pool (one reference each, e.g. a prefix-cache node's segment).
      groups: `int[T + E]` each segment's group (a tenant, >= 0; table segments
        first), None: all 0.
      block_groups: `int[num_blocks]` each block's group as a destination (-1:
        none), None: all 0. A segment goes only to a block of its group or to a
        fresh one (`paged_kv.core.slots.pack_slots`).

    Returns:
      A `PackResult`; the references were already transferred by the pool.
    """
    try:
      tab_arr = np.asarray(table_segments)
    except (TypeError, ValueError) as e:
      raise InvalidArgument("table_segments must be an int[T, 2] array of (row, col) pairs, "
                            f"got {type(table_segments).__name__}") from e
    if tab_arr.size == 0:
      tab_arr = np.zeros((0, 2), np.int64)
    if tab_arr.ndim != 2 or tab_arr.shape[1] != 2:
      raise InvalidArgument("table_segments must be an int[T, 2] array of (row, col) pairs, "
                            f"got shape {tab_arr.shape}")
    tab = _as_int_array(tab_arr.reshape(-1), "table_segments").reshape(-1, 2)
    ext = as_segments(extra_segments, name="extra_segments").astype(np.int64)
    t = self.host
    if tab.size:
      self._check_ids(np.unique(tab[:, 0]), active=True)
      if (tab[:, 1] < 0).any() or (tab[:, 1] >= t.num_segments[tab[:, 0]]).any():
        raise InvalidSegment(f"segment columns {tab[:, 1].tolist()} outside the rows' segments")
    if ext.size and (ext[:, 0].min() < 0 or ext[:, 0].max() >= self.config.num_blocks):
      raise InvalidBlock(f"extra segment blocks outside [0, {self.config.num_blocks})")
    if ext.size:
      # An outside holder holds ref_count - (table references) on a block: never more
      # extra segments than that (a segment nobody outside holds, or a table's own).
      n = self.config.num_blocks
      ref = t.ref_count.astype(np.int64)
      outside = ref - t.table_refs
      claimed = np.bincount(ext[:, 0], minlength=n)
      over = np.flatnonzero(claimed > outside)
      if over.size:
        b = int(over[0])
        raise BlockInUse(f"pack_slots: {int(claimed[b])} extra segment(s) on block {b}, but "
                         f"only {max(int(outside[b]), 0)} of its {int(ref[b])} references are "
                         "held outside the tables; nothing was changed")
    k = len(tab) + len(ext)
    owner = np.concatenate([tab[:, 0], np.full(len(ext), slots.OWNER_EXTERNAL)])
    col = np.concatenate([tab[:, 1], np.zeros(len(ext), np.int64)])
    blk = np.concatenate([t.block[tab[:, 0], tab[:, 1]], ext[:, 0]])
    start = np.concatenate([t.start[tab[:, 0], tab[:, 1]], ext[:, 1]])
    length = np.concatenate([t.length[tab[:, 0], tab[:, 1]], ext[:, 2]])
    b = _bucket(k)
    seg_group = np.zeros((k,), np.int64) if groups is None else np.asarray(groups, np.int64)
    block_group = (np.zeros((self.config.num_blocks,), np.int32) if block_groups is None
                   else np.asarray(block_groups, np.int32))
    if seg_group.shape != (k,) or (seg_group < 0).any() or block_group.shape != (
        self.config.num_blocks,):
      raise InvalidArgument(f"pack_slots: groups must be int[{k}] >= 0 and block_groups "
                            f"int[{self.config.num_blocks}], got shapes {seg_group.shape}, "
                            f"{block_group.shape}")
    state = self.state
    self._state, (new_block, new_start, status) = slots.pack_slots(
        state, _pad(owner, b, -1), _pad(col, b, 0), _pad(blk, b, -1), _pad(start, b, 0),
        _pad(length, b, 0), _pad(seg_group, b, 0), block_group, config=self.config,
        atomic=True)
    self._synced("pack_slots")
    status, new_block, new_start = jax.device_get((status, new_block, new_start))
    raise_for_status(np.asarray(status)[:k], "pack_slots")
    nb, ns = np.asarray(new_block)[:k], np.asarray(new_start)[:k]
    new = np.stack([nb, ns, length], axis=1).astype(np.int32)
    ids = np.concatenate([nb, blk]).astype(np.int64)
    deltas = np.concatenate([np.ones(k, np.int64), -np.ones(k, np.int64)])
    uniq, inv = np.unique(ids, return_inverse=True)
    summed = np.bincount(inv, weights=deltas, minlength=uniq.size).astype(np.int32)
    keep = summed != 0
    return PackResult(table_segments=np.concatenate([tab.astype(np.int32), new[:len(tab)]],
                                                    axis=1),
                      extra_segments=new[len(tab):],
                      ref_deltas=(uniq[keep].astype(np.int32), summed[keep]))

  def _synced(self, what: str) -> None:
    """A transition ran on the device: count it, read its status, reload the mirror."""
    del what
    self.runtime.dispatch("sync")
    self.runtime.read("status")
    self._mirror = None

  def reclaim_slots(self, extra_segments: Segments = ()) -> int:
    """Frees slots no live segment covers (see `paged_kv.core.slots.reclaim_slots`).

    `extra_segments` (`i32[n, 3]` `(block, start, length)` rows) must be *every*
    segment held outside the tables; if they do not account for `ref_count`,
    nothing changes and `InvalidSegment` is raised. Returns the slots reclaimed.
    Runs synchronously on the device (as `pack_slots`).
    """
    ext = as_segments(extra_segments, name="extra_segments")
    b = _bucket(len(ext))
    state = self.state
    self._state, (status, reclaimed) = slots.reclaim_slots(
        state, _pad(ext[:, 0], b, 0), _pad(ext[:, 1], b, 0), _pad(ext[:, 2], b, 0),
        config=self.config)
    self._synced("reclaim_slots")
    status, reclaimed = jax.device_get((status, reclaimed))
    if int(status) != Status.OK:
      raise InvalidSegment("reclaim_slots: the segments given plus the tables do not account "
                           "for every block's ref_count; nothing was changed")
    return int(reclaimed)

  def _check_impl(self, impl) -> str:
    if not isinstance(impl, str) or impl not in BLOCK_MOVE_IMPLS:
      raise InvalidArgument(f"impl must be one of {BLOCK_MOVE_IMPLS}, got {impl!r}")
    return impl

  def plan(self, policy: compact.CompactionPolicy) -> tuple[np.ndarray, np.ndarray]:
    """`(src, dst)`: `policy`'s compaction plan on the mirror (no device work)."""
    h = self.host
    moves = policy.num_moves(self.config.num_blocks, self.config.block_bytes)
    if policy.strategy == "merge":
      return compact.plan_defrag(h.ref_count, h.region, budget=moves)
    return host_ops.plan_compaction(h, budget=moves)

  def compact(self, budget: int = 32, impl: str = "xla", *,
              policy: compact.CompactionPolicy | None = None) -> np.ndarray:
    """One compaction step of up to `budget` moves; returns `remap i32[num_blocks]`.

    Block ids held outside the tables (a prefix cache's) must follow `remap`;
    a `CachedPool` does that itself.

    Args:
      budget: a positive integer scalar. A plan has at most `num_blocks // 2`
        moves (each needs a live source and a distinct free destination), so a
        larger budget is clamped to that. Ignored when `policy` is given.
      impl: `"xla"` (the moves run in the pool's commit); `"pallas"`/`"mosaic"`
        run them at once with that kernel (synchronously, see `pack_slots`).
      policy: plan with this policy instead: its strategy, and its byte budget
        turned into moves with this pool's `config.block_bytes`.
    """
    impl = self._check_impl(impl)
    if policy is not None:
      src, dst = self.plan(policy)
    else:
      budget = _as_int_scalar(budget, "budget", low=1)
      budget = max(1, min(budget, self.config.num_blocks // 2))
      src, dst = host_ops.plan_compaction(self.host, budget=budget)
    return self._move(src, dst, impl, REGION_DYNAMIC, "move_blocks")

  def move_blocks(self, src, dst, impl: str = "xla") -> np.ndarray:
    """Applies a compaction plan (`compact_permute`); returns `remap i32[num_blocks]`.

    Args:
      src, dst: `i32[M]` a plan from `plan_compaction` / `CompactionPolicy.plan`
        (live sources, free destinations, `-1` padding).
      impl: page copy implementation (`"xla"`, `"pallas"`, `"mosaic"`).

    Raises:
      InvalidArgument: `src`/`dst` not 1-D int arrays of one shape, or a bad `impl`.
      InvalidBlock: a move the pool refuses; nothing moved.
    """
    impl = self._check_impl(impl)
    s, d = _as_int_array(src, "src"), _as_int_array(dst, "dst")
    if s.shape != d.shape:
      raise InvalidArgument(f"src {s.shape} and dst {d.shape} differ in shape")
    return self._move(s, d, impl, REGION_DYNAMIC, "move_blocks")

  def _move(self, src, dst, impl: str, dst_region: int, what: str) -> np.ndarray:
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    n = self.config.num_blocks
    if impl != "xla":  # a kernel: run the device transition itself
      b = _bucket(src.size)
      state = self.state
      fn = compact.compact_permute if dst_region == REGION_DYNAMIC else regions.promote_blocks
      self._state, (remap, status) = fn(state, _pad(src, b, -1), _pad(dst, b, -1),
                                        config=self.config, impl=impl)
      self._synced(what)
      remap, status = jax.device_get((remap, status))
      raise_for_status(status, what)
      return np.asarray(remap)
    live = (src >= 0) | (dst >= 0)
    if live.any() and self._log.page_conflict(src[src >= 0], dst[dst >= 0], moves=True):
      self.flush()
    s, d, status = host_ops.move_blocks(self.host, src, dst, dst_region=dst_region)
    raise_for_status(status, what)
    self._done()
    return host_ops.remap_of(n, s, d)

  def promote(self, min_readers: int, max_moves: int = 8) -> np.ndarray:
    """Moves blocks with >= `min_readers` references into the base pool; returns remap.

    Args:
      min_readers: an integer scalar >= 1.
      max_moves: a positive integer scalar; clamped to the base pool's size (no
        more promotions can exist), so the plan's static width stays bounded.

    A call that finds nothing to promote changes nothing.
    """
    min_readers = _as_int_scalar(min_readers, "min_readers", low=1)
    max_moves = _as_int_scalar(max_moves, "max_moves", low=1)
    max_moves = max(1, min(max_moves, self.config.num_base_blocks))
    src, dst = host_ops.plan_promotion(self.host, min_readers, max_moves=max_moves)
    return self._move(src, dst, "xla", REGION_BASE, "promote")

  def resize(self, num_blocks: int, *, staging: str = "auto") -> resize_lib.ResizeReport:
    """Shrinks (the cut tail must be free: compact first) or grows the pool.

    The pages get new shapes. `staging` picks how (`paged_kv.core.resize`):
    `"device"` builds the new pages beside the old ones in one program (fast; the
    device holds both pools for a moment), `"host"` copies the kept pages to host
    memory one layer at a time, frees the old pages and uploads them back (device
    peak: the larger pool plus one layer of K; the kept bytes cross the host link
    twice), `"auto"` (default) stages only when the device lacks room for the new
    pages beside the old ones.

    Returns:
      The `ResizeReport` (path, peak live device bytes, bytes staged, time); also
      kept as `last_resize`.

    Raises:
      InvalidArgument: `num_blocks` not an int above the base pool, or a size the
        config refuses (slots beyond int32, pages beyond `MAX_POOL_BYTES`); the
        message names the limit; or a bad `staging`.
      InvalidBlock: a block to cut off is still referenced.
      PoolTooLarge: growing needs more memory than the device has free.
      Nothing changed when it raises.
    """
    num_blocks = _as_int_scalar(num_blocks, "num_blocks", low=1)
    new_config = regions.resized_config(self.config, num_blocks)
    staged, budget = resize_lib.plan_staging(self.config, new_config, staging)
    h = self.host
    if num_blocks < self.config.num_blocks:
      tail = h.ref_count[num_blocks:]
      if tail.any():
        live = np.flatnonzero(tail) + num_blocks
        raise InvalidBlock(f"cannot cut blocks [{num_blocks}, {self.config.num_blocks}): "
                           f"{live.size} still referenced (e.g. {live[:8].tolist()}); "
                           "compact first")
    elif num_blocks > self.config.num_blocks:
      # The grown pages sit beside the old ones, or (staged) replace them, less one
      # staged layer of K.
      c = self.config
      reusable = (c.num_blocks * c.block_bytes * (2 * c.num_layers - 1) // (2 * c.num_layers)
                  if staged else 0)
      device_memory.check_fits(new_config, reusable=reusable)
    # A failed staged resize puts the old pages back into this state before it raises.
    with device_memory.allocating(new_config):
      if staged:
        new_state, report = resize_lib.resize_state_staged(
            self.state, config=self.config, new_config=new_config, device_budget=budget)
      else:
        new_state, report = resize_lib.resize_state_device(self.state, config=self.config,
                                                           new_config=new_config)
    self._state = _committed(new_state)
    self.runtime.dispatch("sync")
    if report.staged:
      self.runtime.read("data", 2 * self.config.num_layers)
    self._scratch_log = ChangeLog(new_config, rows=False)
    self._mirror = h.resized(new_config)
    self.config = new_config
    self.last_resize = report
    self._done()
    return report


@dataclasses.dataclass(frozen=True)
class PackResult:
  """Outcome of `BlockPool.pack_slots`.

  Attributes:
    table_segments: `i32[T, 5]` rows `(row, col, new_block, new_start, length)`.
    extra_segments: `Segments` (`i32[E, 3]`): the new `(block, start, length)` of
      each outside segment, in the order given: the holder rewrites its record to it.
    ref_deltas: `(block_ids, deltas)` the pool already applied (+1 new block,
      -1 old block per moved reference, aggregated); an outside holder's own
      rebind deltas must equal these and must not be applied again.
  """

  table_segments: np.ndarray
  extra_segments: np.ndarray
  ref_deltas: tuple[np.ndarray, np.ndarray]


def _committed(state: PoolState) -> PoolState:
  """`state` with every array committed to its own sharding (device).

  A jitted program is compiled per argument sharding, committed or not: a fresh
  `init_pool` state is uncommitted, the outputs of the pool's programs are
  committed. Committing the state once at the start keeps every call on one
  shape of arguments, so the warm-up compiles what the serving path runs.
  """
  def commit_leaf(x):
    if isinstance(x, jax.Array) and not x.is_deleted():
      return jax.device_put(x, x.sharding)
    return x
  return jax.tree.map(commit_leaf, state)


@functools.partial(jax.jit, donate_argnames=("state",))
def _write_state(state: PoolState, layer: jax.Array, slot_idx: jax.Array, k: jax.Array,
                 v: jax.Array) -> PoolState:
  return dataclasses.replace(state, pages=kv.write_kv(state.pages, layer, slot_idx, k, v))


@functools.partial(jax.jit, donate_argnames=("state",))
def _write_layers(state: PoolState, slot_idx: jax.Array, k: jax.Array,
                  v: jax.Array) -> PoolState:
  """Every layer's K/V (`[L, H, T, D]`) into slots `slot_idx: i32[T]` (-1 dropped)."""
  pages = state.pages
  n, bs = pages.k.shape[2], pages.k.shape[3]
  blk = jnp.where(slot_idx >= 0, slot_idx // bs, n)  # out of range: dropped
  off = jnp.where(slot_idx >= 0, slot_idx % bs, 0)
  def put(p, x):  # advanced (block, offset) indices: the update is [L, H, T, D], in place
    return p.at[:, :, blk, off].set(x.astype(p.dtype), mode="drop")
  return dataclasses.replace(state, pages=dataclasses.replace(pages, k=put(pages.k, k),
                                                              v=put(pages.v, v)))
