"""Multi-controller runs: one Python process per host, `jax.distributed`, host messages.

Every process calls `initialize`, builds the same global mesh and issues the same
device programs in the same order. What they must agree on beyond those (a step's
arrivals, digests of decisions) travels through a `Channel` over the coordination
service's key-value store, polled in slices so a wait ends in a typed error
(`ScheduleDiverged`, `PeerFailed`, `PeerTimeout`), never a hang. A process that dies
silently stops its heartbeats and the service aborts the others after
`heartbeat_timeout_s`. `launch` sets `PAGED_KV_COORDINATOR`,
`PAGED_KV_NUM_PROCESSES` and `PAGED_KV_PROCESS_ID`. Failure table: docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Sequence

import jax

from paged_kv.core.errors import InvalidArgument, PagedKVError

__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "DistributedError",
           "ScheduleDiverged", "PeerFailed", "PeerTimeout", "ProcessGroup", "initialize",
           "single_process", "shutdown", "Channel", "digest"]

ENV_COORDINATOR = "PAGED_KV_COORDINATOR"
ENV_NUM_PROCESSES = "PAGED_KV_NUM_PROCESSES"
ENV_PROCESS_ID = "PAGED_KV_PROCESS_ID"
LEADER = 0  # the process that owns admission (and hosts the coordination service)
_DEADLINE = "DEADLINE_EXCEEDED"  # a blocking get whose slice ran out (not an error)


class DistributedError(PagedKVError):
  """A multi-process run cannot continue in lockstep."""


class ScheduleDiverged(DistributedError):
  """The processes disagree: their digests of the same exchange (`label`) differ.
  `step` is -1 outside a step; `digests` maps process id -> digest."""

  def __init__(self, label: str, step: int, digests: dict[int, str]):
    self.label, self.step, self.digests = label, step, dict(digests)
    groups: dict[str, list[int]] = {}
    for pid, d in sorted(digests.items()):
      groups.setdefault(d, []).append(pid)
    parts = "; ".join(f"processes {pids}: {d[:16]}" for d, pids in groups.items())
    super().__init__(f"schedule diverged at step {step} ({label}): {parts}")


class PeerFailed(DistributedError):
  """Another process stopped with an error (its own report, or its service gone).

  A process that had not read every digest of a diverged exchange learns of it this
  way (`error_type == "ScheduleDiverged"`; "" when unknown).
  """

  def __init__(self, process_id: int, reason: str):
    self.process_id, self.reason = process_id, reason
    self.error_type = reason.split(":", 1)[0] if ": " in reason else ""
    super().__init__(f"process {process_id} failed: {reason}")


class PeerTimeout(DistributedError):
  """Processes (`missing`) did not report within the channel's timeout."""

  def __init__(self, missing: Sequence[int], label: str, waited_s: float):
    self.missing, self.label, self.waited_s = tuple(missing), label, waited_s
    super().__init__(f"processes {list(self.missing)} did not report {label!r} within "
                     f"{waited_s:.1f} s (dead, stuck, or far slower than the others)")


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
  """This process's place in a run: process 0 leads; `coordinator` is None with one
  process (no `jax.distributed`)."""

  process_id: int
  num_processes: int
  coordinator: str | None = None

  @property
  def is_leader(self) -> bool:
    return self.process_id == LEADER

  @property
  def distributed(self) -> bool:
    return self.num_processes > 1


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError as e:
    raise InvalidArgument(f"${name} must be an int, got {value!r}") from e


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_collectives: str = "gloo",
               initialization_timeout_s: int = 120, heartbeat_timeout_s: int = 30,
               shutdown_timeout_s: int = 30) -> ProcessGroup:
  """`jax.distributed.initialize` for a paged_kv run; call it first, before any JAX op.

  Args:
    coordinator: `host:port` of process 0 (default `$PAGED_KV_COORDINATOR`).
    num_processes: processes in the run (default `$PAGED_KV_NUM_PROCESSES`).
    process_id: this process (default `$PAGED_KV_PROCESS_ID`).
    cpu_collectives: `jax_cpu_collectives_implementation` for CPU devices
      (`"gloo"`, or `"mpi"`); no effect on GPUs.
    heartbeat_timeout_s: a process silent this long is declared dead, and the
      coordination service terminates the others.

  Returns:
    The `ProcessGroup`; with one process `jax.distributed` is not started.

  Raises:
    InvalidArgument: an argument or environment variable is missing or bad.
  """
  coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
  num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  if num_processes is None and coordinator is None and process_id is None:
    return single_process()
  if num_processes is None or process_id is None or coordinator is None:
    raise InvalidArgument(
        f"initialize needs coordinator, num_processes and process_id (or ${ENV_COORDINATOR}, "
        f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got {coordinator!r}, {num_processes!r}, "
        f"{process_id!r}")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise InvalidArgument(f"num_processes must be an int >= 1, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise InvalidArgument(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  if num_processes == 1:
    return single_process()
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s)
  return ProcessGroup(process_id, num_processes, coordinator)


def single_process() -> ProcessGroup:
  """The group of a run without `jax.distributed`: one process, the leader."""
  return ProcessGroup(0, 1, None)


def shutdown() -> None:
  """`jax.distributed.shutdown()` when it was started (waits for the other processes)."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


def digest(*parts) -> str:
  """A short hex digest of `repr(parts)` (blake2b); numpy arrays by dtype, shape, bytes."""
  h = hashlib.blake2b(digest_size=16)
  for part in parts:
    tobytes = getattr(part, "tobytes", None)
    if tobytes is not None and hasattr(part, "dtype"):
      h.update(f"{part.dtype}{part.shape}".encode())
      h.update(tobytes())
    else:
      h.update(repr(part).encode())
    h.update(b"\x00")
  return h.hexdigest()


def _client():
  """The coordination service client of `jax.distributed` (its key-value store)."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  client = getattr(jax_distributed.global_state, "client", None)
  if client is None:
    raise DistributedError("jax.distributed is not initialized in this process "
                           "(paged_kv.cluster.distributed.initialize first)")
  return client


class Channel:
  """Ordered host messages between the processes of a run (the coordination KV store).

  Every process makes the same calls in the same order; call `n` uses keys
  `<namespace>/<n>/...`, so a different call (label) is caught, not left waiting.
  `timeout_s` must cover the slowest step, compiles included.
  """

  def __init__(self, group: ProcessGroup, *, namespace: str = "paged_kv",
               timeout_s: float = 300.0, poll_s: float = 0.25):
    if timeout_s <= 0 or poll_s <= 0:
      raise InvalidArgument(f"timeout_s and poll_s must be > 0, got {timeout_s}, {poll_s}")
    self.group = group
    self.namespace = namespace
    self.timeout_s = float(timeout_s)
    self.poll_s = float(poll_s)
    self._client = _client() if group.distributed else None
    self._seq = 0
    self._mine: list[tuple[int, str]] = []  # (seq, key) this process wrote
    self.num_exchanges = 0
    self.wait_seconds = 0.0  # time spent waiting for the others (all calls)

  # -- messages -----------------------------------------------------------------
  def broadcast(self, value: str | None, *, label: str = "broadcast") -> str:
    """The leader's `value`, on every process (the others pass None)."""
    seq = self._next()
    if self.group.is_leader:
      if value is None:
        raise InvalidArgument("the leader must broadcast a value")
      self._put(seq, f"{seq}/b", json.dumps([label, value]))
      return value
    if value is not None:
      raise InvalidArgument(f"process {self.group.process_id} is not the leader: it "
                            f"broadcasts nothing (value must be None)")
    got_label, got = json.loads(self._get(f"{seq}/b", LEADER, label))
    if got_label != label:
      raise ScheduleDiverged(label, -1, {LEADER: got_label, self.group.process_id: label})
    return got

  def exchange(self, value: str, *, label: str = "exchange", step: int = -1) -> list[str]:
    """Every process's `value`, in process order; raises `ScheduleDiverged` if another
    process made a different call here, or `PeerFailed` / `PeerTimeout`."""
    seq = self._next()
    me = self.group.process_id
    self._put(seq, f"{seq}/x/{me}", json.dumps([label, value]))
    out = []
    for pid in range(self.group.num_processes):
      if pid == me:
        out.append([label, value])
      else:
        out.append(json.loads(self._get(f"{seq}/x/{pid}", pid, label)))
    self._collect(seq)  # every process has passed every earlier call
    labels = {pid: lab for pid, (lab, _) in enumerate(out)}
    if len(set(labels.values())) > 1:
      raise ScheduleDiverged(label, step, labels)
    return [v for _, v in out]

  def agree(self, label: str, value: str, *, step: int = -1) -> None:
    """Raises `ScheduleDiverged` unless every process passes the same `value` (a digest)."""
    values = self.exchange(value, label=label, step=step)
    if len(set(values)) > 1:
      raise ScheduleDiverged(label, step, dict(enumerate(values)))

  def report_failure(self, exc: BaseException) -> None:
    """Posts this process's error for the others (they raise `PeerFailed` on their next
    wait). Best effort: never raises."""
    if self._client is None or isinstance(exc, PeerFailed):
      return
    try:
      key = f"{self.namespace}/failed/{self.group.process_id}"
      self._client.key_value_set(key, f"{type(exc).__name__}: {exc}"[:2000], True)
    except Exception:  # pylint: disable=broad-except
      pass

  def stop(self, exc: BaseException | None = None, *, linger_s: float = 10.0) -> None:
    """Leaves a run that failed; call it before the process exits on an error.

    Posts `exc` for the others; the leader (whose process hosts the coordination
    service) waits up to `linger_s` for the others to stop, so they read the error
    before the service vanishes. Best effort: never raises.
    """
    if self._client is None:
      return
    if exc is not None:
      self.report_failure(exc)
    try:
      self._client.key_value_set(f"{self.namespace}/stopped/{self.group.process_id}", "1", True)
      if not self.group.is_leader:
        return
      deadline = time.monotonic() + linger_s
      others = self.group.num_processes - 1
      while time.monotonic() < deadline:
        stopped = self._client.key_value_dir_get(f"{self.namespace}/stopped/")
        if len([k for k, _ in stopped if not k.endswith(f"/{self.group.process_id}")]) >= others:
          return
        time.sleep(self.poll_s)
    except Exception:  # pylint: disable=broad-except
      pass

  # -- internals ----------------------------------------------------------------
  def _next(self) -> int:
    seq = self._seq
    self._seq += 1
    self.num_exchanges += 1
    return seq

  def _put(self, seq: int, key: str, value: str) -> None:
    if self._client is None:
      return
    full = f"{self.namespace}/{key}"
    self._client.key_value_set(full, value)
    self._mine.append((seq, full))

  def _collect(self, seq: int) -> None:
    """Deletes this process's keys of calls before `seq` (every process has read them)."""
    if self._client is None:
      return
    keep = []
    for s, key in self._mine:
      if s < seq:
        try:
          self._client.key_value_delete(key)
        except Exception:  # pylint: disable=broad-except
          pass
      else:
        keep.append((s, key))
    self._mine = keep

  def _check_failures(self) -> None:
    for key, value in self._client.key_value_dir_get(f"{self.namespace}/failed/"):
      pid = int(key.rsplit("/", 1)[-1])
      if pid != self.group.process_id:
        raise PeerFailed(pid, value)

  def _get(self, key: str, pid: int, label: str) -> str:
    """Process `pid`'s value at `key`, polled in slices between failure checks."""
    if self._client is None:
      raise DistributedError("a one-process channel has no one to wait for")
    full = f"{self.namespace}/{key}"
    t0 = time.monotonic()
    slice_ms = max(1, int(self.poll_s * 1000))
    try:
      while True:
        try:
          return self._client.blocking_key_value_get(full, slice_ms)
        except jax.errors.JaxRuntimeError as e:
          if _DEADLINE not in str(e):
            raise PeerFailed(LEADER, f"coordination service unreachable ({e})") from e
        self._check_failures()
        if time.monotonic() - t0 > self.timeout_s:
          raise PeerTimeout([pid], label, time.monotonic() - t0)
    finally:
      self.wait_seconds += time.monotonic() - t0
