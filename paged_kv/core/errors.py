"""Status codes reported by jitted transitions and the typed exceptions of the host API.

Jitted transitions never raise: they return an `i32` status per request (0 = OK)
and leave the state unchanged for every failed request; `BlockPool` turns a
non-zero status into an exception with the state as it was before the call.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
  """Per-request outcome of a jitted transition."""

  OK = 0
  NO_FREE_BLOCK = 1       # not enough free blocks for the request
  NO_CONTIGUOUS_RUN = 2   # a contiguous run was required and none was free
  TABLE_FULL = 3          # the sequence would need more than max_segments segments
  INVALID_SEQUENCE = 4    # id out of range, inactive (or already active for open/fork dst), duplicated
  INVALID_COUNT = 5       # negative count, or above the static maximum of the call
  INVALID_BLOCK = 6       # block id out of range, or not live where a live block is required
  REF_UNDERFLOW = 7       # a decref below zero
  INVALID_SEGMENT = 8     # a segment outside its block, empty, or on unwritten slots
  ABORTED = 9             # valid, but not applied because another request of an atomic call failed
  REF_OVERFLOW = 10       # an incref would take a block's reference count above int32
  BLOCK_IN_USE = 11       # a decref would drop a block below the references live tables hold


# OOM reasons, as used in metrics (`oom_by_reason`).
OOM_REASONS = {Status.NO_FREE_BLOCK: "no_free_block", Status.NO_CONTIGUOUS_RUN: "no_contiguous_run",
               Status.TABLE_FULL: "table_full"}


class PagedKVError(Exception):
  """Base class of every error raised by paged_kv's host API."""


class PoolExhausted(PagedKVError):
  """The pool cannot satisfy an allocation. `reason` is one of `OOM_REASONS` values."""

  def __init__(self, message: str, *, reason: str):
    super().__init__(f"{message} (reason={reason})")
    self.reason = reason


class InvalidSequence(PagedKVError):
  """A sequence id is out of range, inactive, duplicated, or already active."""


class InvalidBlock(PagedKVError):
  """A block id is out of range or not in the state the operation requires."""


class InvalidSegment(PagedKVError):
  """A segment does not lie inside its block or refers to unwritten slots."""


class RefCountUnderflow(PagedKVError):
  """A decref would take a block's reference count below zero."""


class RefCountOverflow(PagedKVError):
  """An incref would take a block's reference count (or a summed delta) beyond int32."""


class BlockInUse(InvalidBlock):
  """The operation would free, rebind or overwrite a block or slot another holder uses.

  E.g. a decref below the live tables' references, `pack_slots` of a segment with
  no outside holder, `write_kv` into a slot that is not the writer's alone.
  """


class InvalidArgument(PagedKVError, ValueError):
  """A count, shape or dtype is not acceptable."""


class PoolTooLarge(InvalidArgument):
  """A pool's pages do not fit its device's free memory; raised before anything is allocated."""


class InvalidSegmentLayout(InvalidArgument):
  """A segments argument is not an `int32[n, 3]` array of `(block, start, length)` rows."""


class InvariantViolation(PagedKVError, AssertionError):
  """`check_invariants` found the state inconsistent."""


class InternalInconsistency(InvariantViolation):
  """The device state differs from the host mirror the pool decided with.

  Raised by a deferred check (a commit's comparison, a step's status against the
  host's prediction) or a debug-mode comparison. A bug, never load:
  `BlockPool.resync()` reloads the mirror, `check_invariants()` checks the device.
  """
