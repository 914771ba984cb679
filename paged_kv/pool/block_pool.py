"""`BlockPool`: the host API. It decides on a host mirror and sends the device one commit.

Every call validates its arguments and decides its outcome on an exact numpy
mirror of the bookkeeping (`HostState`), with the algorithms and status codes of
`paged_kv.core`'s transitions. A refused call raises its typed exception and
changes nothing; an accepted one changes the mirror and queues the change. The
queue goes to the device as ONE jitted `paged_kv.core.commit.commit` when the
device state is next needed or at `flush()`: a scheduler step costs one
bookkeeping dispatch and no blocking read (`pool.runtime` counts both). Each
commit also returns whether the device held what the host expected, read once
ready; a difference raises `InternalInconsistency` at the next call. Debug mode
(`debug=True` or `PAGED_KV_DEBUG=1`) compares the whole mirror after every call.

The class holds the device sync, the queries and the sequence transitions; a
step's reservation (`step_reservation`), opening rows (`open_row`), K/V I/O
(`kv_io`) and fragmentation work (`fragmentation`) are module functions taking
the pool, bound here as its methods.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

import jax
import numpy as np

from paged_kv.core import device_memory
from paged_kv.core import resize as resize_lib
from paged_kv.core.commit import commit
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import (InternalInconsistency, InvalidArgument, InvalidBlock,
                                  InvalidSequence, PoolExhausted, RefCountOverflow)
from paged_kv.core.invariants import check_invariants
from paged_kv.core.segment_format import Segments
from paged_kv.core.state import PoolState, init_pool
from paged_kv.pool import fragmentation, kv_io, open_row, step_reservation
from paged_kv.pool import host_transitions as host_ops
from paged_kv.pool.arguments import (I32_MAX, SMALL_IDS, as_int_array, bucket,
                                     raise_for_status, single_int)
from paged_kv.pool.changes import ChangeLog, CommitWidths, empty_batch
from paged_kv.pool.fragmentation import PackResult  # noqa: F401 (re-exported)
from paged_kv.pool.host_state import HostState
from paged_kv.pool.step_reservation import StepPrediction  # noqa: F401 (re-exported)
from paged_kv.runtime import executables
from paged_kv.runtime.counters import RuntimeCounters

DEBUG_ENV = "PAGED_KV_DEBUG"


def debug_default() -> bool:
  """Debug mode from the environment: `PAGED_KV_DEBUG=1` turns it on."""
  return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


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

  `pool.state` is the current `PoolState` (reading it flushes). A caller that
  runs a jitted transition on it reassigns `pool.state` (the mirror reloads:
  one blocking read). Segments in and out are `Segments` (`int32[n, 3]` rows
  `(block, start, length)`). A pool shared with a prefix cache is driven
  through `paged_kv.cache.cached_pool.CachedPool`.

  Args:
    config: the pool's config.
    state: an existing state (default: `init_pool(config)`), read at the first call.
    debug: compare the whole mirror with the device after every call (default:
      `PAGED_KV_DEBUG`).

  Raises:
    PoolTooLarge: the pages need more memory than the device has free.
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
    executables.track_pool(self)  # a new shape's programs stay below the map limit
    if state is None:
      device_memory.check_fits(config)  # before anything is allocated
      with device_memory.allocating(config):
        self._state = committed(init_pool(config))
      self._mirror: HostState | None = HostState.empty(config, self._log)
    else:
      self._state = committed(state)
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
    self._state = committed(state)
    self._mirror = None

  @property
  def unflushed_state(self) -> PoolState:
    """The device state *without* the queued changes: for checks of its buffers only."""
    return self._state

  @property
  def host(self) -> HostState:
    """The host mirror of the bookkeeping (read it; change it only through the pool)."""
    if self._mirror is None:
      self.resync()
    return self._mirror

  def resync(self) -> None:
    """Reloads the mirror from the device (one blocking read); pending changes are
    applied first, pending checks dropped."""
    if self._mirror is not None:
      self.flush()
    self._checks.clear()
    self._log.reset(None)
    self._mirror = HostState.from_device(self._state, self.config, self._log)
    self.runtime.read("resync")

  def flush(self) -> None:
    """Sends the queued changes to the device, one `commit` per `CommitWidths` chunk,
    and compares the earlier commits' results that are ready."""
    if self._mirror is not None and self._log.pending:
      for batch in self._log.batches(self._mirror):
        self._state, mismatch = commit(self._state, batch, config=self.config)
        self.runtime.dispatch("commit")
        self._checks.append(("commit", mismatch, None))
      self._log.reset(self._mirror)
    self.poll()

  def poll(self) -> None:
    """Compares the device results that are ready with the host's expectations;
    raises `InternalInconsistency` on a difference (the mirror then reloads)."""
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
    """Flushes, waits for every pending check and compares the whole mirror with the
    device (blocking reads); raises `InternalInconsistency` naming each difference."""
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
    """The commit program of `widths`, lowered, for a warm-up to compile concurrently."""
    return commit.lower(self.unflushed_state, empty_batch(self.host, widths),
                        config=self.config)

  def _done(self) -> None:
    """End of a public call: the checks that are ready, and debug mode's full compare."""
    if self.debug:
      self.verify()
    elif self._log.wants_flush:
      self.flush()
    else:
      self.poll()

  # -- queries -------------------------------------------------------------
  @property
  def num_free_blocks(self) -> int:
    return self.host.free.num_free

  def active_sequences(self) -> np.ndarray:
    return np.flatnonzero(self.host.active)

  def _check_ids(self, ids: np.ndarray, *, active: bool | None) -> None:
    if ids.size <= SMALL_IDS:  # a few: the same checks in plain Python
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
    ids = as_int_array(seq_id, "seq_id")
    self._check_ids(ids, active=True)
    return int(self.host.seq_len[ids[0]])

  def segments(self, seq_id: int) -> Segments:
    """`i32[n, 3]` `(block, start, length)` rows of one live sequence, in token order."""
    return self.segments_many([seq_id])[0]

  def segments_many(self, seq_ids) -> list[Segments]:
    """The `segments` of several live sequences (distinct rows), from the mirror."""
    i = single_int(seq_ids)
    if i is not None:
      self._check_id(i, active=True)
      return [self.host.row_segments(i)]
    ids = as_int_array(seq_ids, "seq_ids")
    self._check_ids(ids, active=True)
    h = self.host
    return [h.row_segments(int(i)) for i in ids]

  def check_invariants(self, extra_segments: Segments | None = None, *,
                       extra_blocks=None) -> None:
    """Raises `InvariantViolation` unless the state is consistent (after `verify`).

    Args:
      extra_segments: `i32[n, 3]` `(block, start, length)` rows held outside the
        tables (one reference each, e.g. a prefix cache's); None: those of the
        holder bound by `bind_outside_references`, else none.
      extra_blocks: block ids held outside the tables without a segment, one
        reference each (what the caller holds from `allocate()`). None: none.
    """
    if extra_segments is None and self._outside_refs is not None:
      extra_segments = self._outside_refs()
    self.verify()
    check_invariants(self.state, extra_segments, extra_blocks=extra_blocks)

  def bind_outside_references(self, segment_refs: Callable[[], Segments] | None) -> None:
    """Names the holder of references outside the tables (a prefix cache's), whose
    `segment_refs()` rows `check_invariants()` then counts; None unbinds."""
    if segment_refs is not None and not callable(segment_refs):
      raise InvalidArgument(f"segment_refs must be callable or None, got {segment_refs!r}")
    self._outside_refs = segment_refs

  # -- transitions -----------------------------------------------------------
  def reserve_tokens(self, seq_ids, num_new) -> np.ndarray:
    """Room for `num_new[i]` more tokens of each sequence; returns `slot_idx i32[B, T]`.

    `T` is `max(num_new)` rounded up to a power of two; entries past `num_new[i]`
    are -1. Decided on the mirror; the device applies it at the next flush.
    """
    i, count = single_int(seq_ids), single_int(num_new)
    if i is not None and count is not None and count >= 0:  # one row: no array work
      self._check_id(i, active=True)
      if -(-count // self.config.block_size) > self.config.num_blocks:
        raise PoolExhausted(f"the batch needs up to {-(-count // self.config.block_size)} "
                            f"blocks; the pool has {self.config.num_blocks}",
                            reason="no_free_block")
      slot_idx, status = host_ops.reserve(self.host, np.array([i]), np.array([count]),
                                          max_new_tokens=bucket(count), atomic=True)
      if status[0]:
        raise_for_status(status, "reserve_tokens")
      self._done()
      return slot_idx
    ids, counts = as_int_array(seq_ids, "seq_ids"), as_int_array(num_new, "num_new")
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
                                        max_new_tokens=bucket(biggest), atomic=True)
    raise_for_status(status, "reserve_tokens")
    self._done()
    return slot_idx

  def release(self, seq_ids, *, ref_deltas=None) -> None:
    """Ends the given live sequences; their blocks lose a reference each.

    Args:
      seq_ids: distinct live rows.
      ref_deltas: optional `(block_ids, deltas)` of holders outside the tables
        (a prefix cache taking the rows' segments), checked as `apply_ref_deltas`
        against the state before the release and applied atomically with it.

    Raises:
      InvalidSequence: a row out of range, repeated or not live; the errors of
      `apply_ref_deltas` for `ref_deltas`. Nothing changes on error.
    """
    i = single_int(seq_ids)
    if i is not None and ref_deltas is None:  # one row: no array work
      self._check_id(i, active=True)
      status = host_ops.release(self.host, np.array([i]), atomic=True)
      if status[0]:
        raise_for_status(status, "release")
      self._done()
      return
    ids = as_int_array(seq_ids, "seq_ids")
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
    self._check_ids(as_int_array(src, "src"), active=True)
    if dst is None:
      free = np.flatnonzero(~self.host.active)
      if free.size == 0:
        raise PoolExhausted("no free sequence row for the fork", reason="no_free_row")
      dst = int(free[0])
    self._check_ids(as_int_array(dst, "dst"), active=False)
    status = host_ops.fork(self.host, np.array([int(src)]), np.array([int(dst)]))
    raise_for_status(status, "fork")
    self._done()
    return int(dst)

  def allocate(self, num: int, contiguous: str = "prefer") -> np.ndarray:
    """`num` blocks owned by the caller (ref_count 1), ascending.

    The caller drops them with `apply_ref_deltas(ids, -1)` and names them to
    `check_invariants(extra_blocks=)` meanwhile. `contiguous`: `"prefer"`,
    `"require"` or `"never"` (`core.alloc.allocate`).
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

    Refused, with nothing changed: a block id out of range or an incref of a
    free block (`InvalidBlock`), a count below zero (`RefCountUnderflow`) or
    beyond int32 (`RefCountOverflow`), and a decref below the references live
    tables hold on the block (`BlockInUse`).
    """
    ids, d = self._ref_delta_args(block_ids, deltas)
    raise_for_status(host_ops.apply_ref_deltas(self.host, ids, d), "apply_ref_deltas")
    self._done()

  def _ref_delta_args(self, block_ids, deltas) -> tuple[np.ndarray, np.ndarray]:
    """`apply_ref_deltas`' host checks; returns the ids and deltas as int64 arrays."""
    ids, d = as_int_array(block_ids, "block_ids"), as_int_array(deltas, "deltas")
    if ids.shape != d.shape:
      raise InvalidArgument(f"block_ids {ids.shape} and deltas {d.shape} differ in shape")
    if ids.size and d.dtype == np.int64 and (d.size * int(np.abs(d).max()) <= I32_MAX):
      if ids.min() < 0 or ids.max() >= self.config.num_blocks:
        raise InvalidBlock(f"block ids outside [0, {self.config.num_blocks}): {ids.tolist()}")
      return ids, d  # no block can gain more than int32 holds
    if ids.size and (ids.min() < 0 or ids.max() >= self.config.num_blocks):
      raise InvalidBlock(f"block ids outside [0, {self.config.num_blocks}): {ids.tolist()}")
    # A block's sum can pass int32 only if the gains together do (the common case:
    # they do not, and the per-block sums are not needed).
    if ids.size and int(np.maximum(d, 0).sum()) > I32_MAX:
      uniq, inv = np.unique(ids, return_inverse=True)
      summed = np.zeros(uniq.size, np.int64)
      np.add.at(summed, inv, d)  # int64: K entries of int32 cannot overflow it
      if summed.max() > I32_MAX:
        b = int(uniq[np.argmax(summed)])
        raise RefCountOverflow(f"apply_ref_deltas: block {b} would gain {int(summed.max())} "
                               f"references, beyond int32 ({I32_MAX}); nothing was applied")
    return ids, d

  # -- parts defined beside their concept, bound as methods (no call layer) ----
  predict_decode_steps = step_reservation.predict_decode_steps
  reserve_step = step_reservation.reserve_step
  adopt_step = step_reservation.adopt_step
  abandon_step = step_reservation.abandon_step
  open_sequence = open_row.open_sequence
  open_sequences = open_row.open_sequences
  _open_one = open_row.open_one
  _open_few = open_row.open_few
  gather_kv = kv_io.gather_kv
  gather_kv_padded = kv_io.gather_kv_padded
  write_kv = kv_io.write_kv
  write_kv_layers = kv_io.write_kv_layers
  warm_data = kv_io.warm_data
  cow_split = fragmentation.cow_split
  pack_slots = fragmentation.pack_slots
  reclaim_slots = fragmentation.reclaim_slots
  plan = fragmentation.plan
  compact = fragmentation.compact
  move_blocks = fragmentation.move_blocks
  promote = fragmentation.promote
  resize = fragmentation.resize


def committed(state: PoolState) -> PoolState:
  """`state` with every array committed to its own sharding (`init_pool`'s are not):
  a program compiles per argument sharding, so the warm-up compiles what serving runs."""
  def commit_leaf(x):
    if isinstance(x, jax.Array) and not x.is_deleted():
      return jax.device_put(x, x.sharding)
    return x
  return jax.tree.map(commit_leaf, state)
