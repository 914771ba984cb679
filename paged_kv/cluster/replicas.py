"""Data-parallel replicas in separate processes behind the cache-aware router.

`ReplicaSet` starts one process per `ReplicaSpec` (`multiprocessing`, spawn), each a
`Scheduler` on its own pool (`replica_worker`), probes every live replica's cache and
backlog per request and submits it where the `routing` router picks.

    specs = [ReplicaSpec(pool_config, scheduler_config)] * 4
    with ReplicaSet(specs, CacheAwareRouter(load_weight=0.1)) as replicas:
      for request in requests:            # ReplicaRequest, in arrival order
        replicas.submit(request)
      results = replicas.drain()          # ReplicaResult per request
    # every replica process is gone here, whatever was raised

A replica that exits, breaks its pipe or does not reply within `reply_timeout_s` is
killed, reaped and dropped from `live_indices`; its in-flight requests are routed
again (delivery at least once). The router gets the live replicas' views in index
order and returns a position in that list. With the `"trace"` clock `submit` first
advances every replica to the request's `arrival_s` (deterministic replays).
`close()` (any exit of the context manager) stops, terminates, kills and reaps every
process; a child also dies with its parent *thread* (`PR_SET_PDEATHSIG`), so build the
set on a thread that outlives it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
import weakref
from collections.abc import Hashable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np

from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.cluster import replica_worker
from paged_kv.cluster.replica_worker import (ReplicaRequest, ReplicaResult, ReplicaSpec,
                                             TinyLlamaFactory, backlog_tokens)
from paged_kv.cluster.routing import CacheAwareRouter, ReplicaView, RoutedRequest, Router

__all__ = ["NoLiveReplica", "Replica", "ReplicaCommandError", "ReplicaDown", "ReplicaError",
           "ReplicaRequest", "ReplicaResult", "ReplicaSet", "ReplicaSetSummary", "ReplicaSpec",
           "ReplicaStartError", "TinyLlamaFactory", "backlog_tokens"]

_STOP_GRACE_S = 5.0  # a stopping replica's time to exit before it is terminated
_KILL_GRACE_S = 2.0  # after terminate (SIGTERM), before kill (SIGKILL)


class ReplicaError(PagedKVError):
  """Base class of the replica errors."""


class ReplicaStartError(ReplicaError):
  """A replica process failed to build its scheduler (the message has its traceback)
  or did not say it was ready within `start_timeout_s`."""


class ReplicaDown(ReplicaError):
  """A replica is gone: its process exited, its pipe broke, or it did not reply in time."""

  def __init__(self, index: int, reason: str):
    super().__init__(f"replica {index} is down: {reason}")
    self.index = index
    self.reason = reason


class ReplicaCommandError(ReplicaError):
  """A replica raised while answering a command (the message has its traceback)."""


class NoLiveReplica(ReplicaError):
  """Every replica of the set is down."""


# ----------------------------------------------------------------------------- one
class Replica:
  """One replica process and the parent's end of its pipe."""

  def __init__(self, spec: ReplicaSpec, index: int, *, context: Any):
    self.index = index
    self.spec = spec
    self.conn, child_conn = context.Pipe(duplex=True)
    self.process = context.Process(
        target=replica_worker.serve, args=(child_conn, spec, index, os.getpid()),
        name=f"paged_kv-replica-{index}", daemon=True)
    try:
      self.process.start()
    finally:
      child_conn.close()
    self.pid: int = self.process.pid

  def wait_ready(self, timeout_s: float) -> None:
    """Waits for the process's `ready`; raises `ReplicaStartError` otherwise."""
    try:
      kind, value = self._receive(timeout_s)
    except ReplicaDown as e:
      raise ReplicaStartError(f"replica {self.index} did not start: {e.reason}") from None
    if kind != "ready":
      raise ReplicaStartError(f"replica {self.index} failed to start:\n{value}")

  def send(self, message: tuple) -> None:
    """Sends one command; raises `ReplicaDown` if the pipe is broken."""
    try:
      self.conn.send(message)
    except (BrokenPipeError, EOFError, OSError) as e:
      raise ReplicaDown(self.index, f"pipe broken on send ({type(e).__name__})") from None

  def receive(self, timeout_s: float) -> Any:
    """The reply to the last command; `ReplicaDown` if none comes, `ReplicaCommandError`
    if the replica raised (it is still up)."""
    kind, value = self._receive(timeout_s)
    if kind == "error":
      raise ReplicaCommandError(f"replica {self.index} raised:\n{value}")
    return value

  def call(self, message: tuple, timeout_s: float) -> Any:
    """`send` then `receive`."""
    self.send(message)
    return self.receive(timeout_s)

  def _receive(self, timeout_s: float) -> tuple:
    ready = mp_connection.wait([self.conn, self.process.sentinel], timeout_s)
    if self.conn in ready:
      try:
        return self.conn.recv()
      except (EOFError, OSError) as e:
        raise ReplicaDown(self.index, f"pipe closed ({type(e).__name__}); exit code "
                          f"{self.process.exitcode}") from None
    if ready:
      self.process.join(0.1)
      raise ReplicaDown(self.index, f"process exited (exit code {self.process.exitcode})")
    raise ReplicaDown(self.index, f"no reply within {timeout_s:g} s")

  @property
  def exited(self) -> bool:
    return self.process.exitcode is not None

  def kill(self) -> None:
    """Ends the process now (terminate, then kill), reaps it, closes the pipe."""
    _reap(self.process)
    self.conn.close()


def _reap(process: Any) -> None:
  """Terminates, then kills, a process that is still running; joins it either way."""
  if process.exitcode is None:
    process.terminate()
    process.join(_KILL_GRACE_S)
  if process.exitcode is None:
    process.kill()
    process.join(_KILL_GRACE_S)
  process.join(0)


def _reap_all(processes: list[Any]) -> None:
  for process in processes:
    _reap(process)


# ----------------------------------------------------------------------------- set
@dataclasses.dataclass(frozen=True)
class ReplicaSetSummary:
  """Totals over the results of a `ReplicaSet` (`down`: replica index -> why)."""

  num_requests: int
  rejected: int
  prompt_tokens: int
  hit_tokens: int
  rerouted: int
  per_replica_requests: tuple[int, ...]
  down: dict

  @property
  def hit_rate(self) -> float:
    """Prompt tokens reused / prompt tokens."""
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ReplicaSet:
  """`N` replica processes behind a router (default `CacheAwareRouter()`).

  Args:
    specs: one `ReplicaSpec` per replica (all with the same clock).
    reply_timeout_s: the longest wait for one reply; a replica silent longer is
      marked down and killed.
    submit_timeout_s: the same within `submit` (default `reply_timeout_s`). Keep it
      above what one command takes, and short only once the replicas compiled
      their programs (a replica compiling answers late).
    max_steps_per_call: scheduler steps one `advance`/`drain` command may run.
    poll_s: wall clock: the pause between polls while draining.
  """

  def __init__(self, specs: Sequence[ReplicaSpec], router: Router | None = None, *,
               reply_timeout_s: float = 60.0, start_timeout_s: float = 300.0,
               max_steps_per_call: int = 256, poll_s: float = 0.01,
               submit_timeout_s: float | None = None):
    specs = list(specs)
    if not specs:
      raise InvalidArgument("a ReplicaSet needs at least one ReplicaSpec")
    for i, spec in enumerate(specs):
      if not isinstance(spec, ReplicaSpec):
        raise InvalidArgument(f"specs[{i}] must be a ReplicaSpec, got {type(spec).__name__}")
    clocks = {spec.clock for spec in specs}
    if len(clocks) != 1:
      raise InvalidArgument(f"every replica of a set needs the same clock, got {sorted(clocks)}")
    if submit_timeout_s is None:
      submit_timeout_s = reply_timeout_s
    for name, value in (("reply_timeout_s", reply_timeout_s),
                        ("start_timeout_s", start_timeout_s), ("poll_s", poll_s),
                        ("submit_timeout_s", submit_timeout_s)):
      if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
          or not 0 < value < float("inf")):
        raise InvalidArgument(f"ReplicaSet {name} must be a number > 0, got {value!r}")
    if (isinstance(max_steps_per_call, bool)
        or not isinstance(max_steps_per_call, (int, np.integer)) or max_steps_per_call < 1):
      raise InvalidArgument(f"max_steps_per_call must be an int >= 1, got {max_steps_per_call!r}")
    self.specs = specs
    self.router = router if router is not None else CacheAwareRouter()
    self.clock = clocks.pop()
    self.reply_timeout_s = float(reply_timeout_s)
    self.submit_timeout_s = float(submit_timeout_s)
    self.start_timeout_s = float(start_timeout_s)
    self.max_steps_per_call = int(max_steps_per_call)
    self.poll_s = float(poll_s)
    self.replicas: list[Replica] = []
    self.down: dict[int, str] = {}
    self.results: list[ReplicaResult] = []
    self._inflight: dict[int, dict[Hashable, ReplicaRequest]] = {}
    self._orphans: list[ReplicaRequest] = []  # in flight on a replica that went down
    self._reroutes: dict[Hashable, int] = {}
    self._seen: set[Hashable] = set()
    self._now_s = float("-inf")
    self._closed = False
    self._finalizer: weakref.finalize | None = None

  # ------------------------------------------------------------------ lifecycle
  def start(self) -> "ReplicaSet":
    """Starts every replica and waits until all are ready (`ReplicaStartError`: one
    failed or timed out; every process started is gone)."""
    if self.replicas or self._closed:
      raise ReplicaError("a ReplicaSet starts once")
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    self._finalizer = weakref.finalize(self, _reap_all, processes)
    try:
      for i, spec in enumerate(self.specs):
        replica = Replica(spec, i, context=context)
        self.replicas.append(replica)
        processes.append(replica.process)
        self._inflight[i] = {}
      deadline = time.monotonic() + self.start_timeout_s
      for replica in self.replicas:
        replica.wait_ready(max(0.0, deadline - time.monotonic()))
    except BaseException:
      self.close()
      raise
    return self

  def close(self) -> None:
    """Stops every replica (stop, then terminate, then kill) and reaps it; idempotent."""
    if self._closed:
      return
    self._closed = True
    live = [r for r in self.replicas if r.index not in self.down]
    for replica in live:
      try:
        if replica.process.is_alive():
          replica.send(("stop",))
      except ReplicaError:
        pass
    deadline = time.monotonic() + _STOP_GRACE_S
    for replica in live:
      replica.process.join(max(0.0, deadline - time.monotonic()))
    for replica in self.replicas:
      replica.kill()
    if self._finalizer is not None:
      self._finalizer.detach()

  def __enter__(self) -> "ReplicaSet":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.close()

  # ------------------------------------------------------------------ views
  @property
  def num_replicas(self) -> int:
    return len(self.specs)

  @property
  def live_indices(self) -> list[int]:
    """Indices of the replicas the router may pick (the ones not marked down)."""
    return [r.index for r in self.replicas if r.index not in self.down]

  @property
  def pids(self) -> list[int]:
    """Process ids of every replica started (live or not)."""
    return [r.pid for r in self.replicas]

  def in_flight(self) -> dict[int, int]:
    """Requests submitted and not finished, per live replica."""
    return {i: len(self._inflight[i]) for i in self.live_indices}

  # ------------------------------------------------------------------ requests
  def submit(self, request: ReplicaRequest) -> int:
    """Routes `request` to a live replica and queues it there; returns that index.

    With the trace clock every live replica first advances to `request.arrival_s`.
    Returns -1 when the chosen replica rejected it (it can never fit its pool).

    Raises:
      InvalidArgument: not a `ReplicaRequest`, an id seen before, time going backwards.
      NoLiveReplica: every replica is down.
      ReplicaCommandError: a replica raised while handling it.
    """
    self._check_open()
    if not isinstance(request, ReplicaRequest):
      raise InvalidArgument(f"submit takes a ReplicaRequest, got {type(request).__name__}")
    if request.request_id in self._seen:
      raise InvalidArgument(f"request id {request.request_id!r} was submitted before")
    if self.clock == "trace":
      if request.arrival_s < self._now_s:
        raise InvalidArgument(f"requests must arrive in time order: {request.arrival_s} after "
                              f"{self._now_s}")
      self._now_s = float(request.arrival_s)
      probes = self._advance(self._now_s, request)
    else:
      probes = None
    self._seen.add(request.request_id)
    if self._orphans:
      self._reroute_orphans()
      probes = None  # the backlogs moved
    return self._route(request, probes)

  def drain(self, timeout_s: float | None = None) -> list[ReplicaResult]:
    """Runs until every submitted request has a result; returns all results so far.

    Raises:
      NoLiveReplica: every replica went down with requests left.
      ReplicaError: `timeout_s` passed first.
    """
    self._check_open()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      self._reroute_orphans()
      busy = [i for i in self.live_indices if self._inflight[i]]
      if not busy:
        return list(self.results)
      if deadline is not None and time.monotonic() > deadline:
        raise ReplicaError(f"drain: {sum(len(self._inflight[i]) for i in busy)} requests "
                           f"unfinished after {timeout_s:g} s")
      before = len(self.results)
      for i, (_, results) in self._broadcast(busy, ("drain", self.max_steps_per_call)).items():
        self._collect(i, results)
      if self.clock == "wall" and len(self.results) == before:
        time.sleep(self.poll_s)

  def replica_stats(self) -> dict[int, dict]:
    """Each live replica's scheduler counters (`SchedulerStats` fields, `pid`)."""
    self._check_open()
    return self._broadcast(self.live_indices, ("stats",))

  def summary(self) -> ReplicaSetSummary:
    """Totals over the results so far."""
    per = [0] * self.num_replicas
    for r in self.results:
      per[r.replica] += 1
    return ReplicaSetSummary(
        num_requests=len(self.results),
        rejected=sum(r.stop_reason == "rejected" for r in self.results),
        prompt_tokens=sum(r.prompt_tokens for r in self.results),
        hit_tokens=sum(r.hit_tokens for r in self.results),
        rerouted=sum(r.reroutes > 0 for r in self.results),
        per_replica_requests=tuple(per),
        down=dict(self.down))

  # ------------------------------------------------------------------ internals
  def _check_open(self) -> None:
    if self._closed:
      raise ReplicaError("the ReplicaSet is closed")
    if not self.replicas:
      raise ReplicaError("the ReplicaSet is not started (use it as a context manager, or "
                         "call start())")

  def _broadcast(self, indices: list[int], message: tuple,
                 timeout_s: float | None = None) -> dict[int, Any]:
    """Sends `message` to each replica, then collects the replies (they work in
    parallel); a replica that fails is marked down and left out."""
    timeout_s = self.reply_timeout_s if timeout_s is None else timeout_s
    sent = []
    for i in indices:
      try:
        self.replicas[i].send(message)
        sent.append(i)
      except ReplicaDown as e:
        self._mark_down(i, e.reason)
    replies, error = {}, None
    for i in sent:  # every reply is read, so no pipe is left a reply behind
      try:
        replies[i] = self.replicas[i].receive(timeout_s)
      except ReplicaDown as e:
        self._mark_down(i, e.reason)
      except ReplicaCommandError as e:
        error = error or e
    if error is not None:
      raise error
    return replies

  def _advance(self, now_s: float, request: ReplicaRequest) -> dict[int, tuple]:
    """Trace clock: steps every live replica up to `now_s`, in bounded commands, and
    probes each for `request` once there; returns the probes by replica."""
    tokens = request.prompt if self.router.needs_probe else None
    message = ("advance", now_s, self.max_steps_per_call, request.namespace, tokens)
    pending, probes = self.live_indices, {}
    while pending:
      replies = self._broadcast(pending, message, self.submit_timeout_s)
      pending = []
      for i, (reached, results, probe) in replies.items():
        self._collect(i, results)
        if reached:
          probes[i] = probe
        else:
          pending.append(i)
    return {i: p for i, p in probes.items() if i not in self.down}

  def _route(self, request: ReplicaRequest, probes: dict[int, tuple] | None = None) -> int:
    routed = RoutedRequest(tokens=request.prompt, arrival_s=request.arrival_s,
                           num_output_tokens=request.max_new_tokens,
                           namespace=request.namespace)
    tokens = request.prompt if self.router.needs_probe else None
    while True:
      live = self.live_indices
      if not live:
        raise NoLiveReplica(f"every replica is down: {self.down}")
      if probes is None or set(probes) != set(live):
        probes = self._broadcast(live, ("probe", request.namespace, tokens),
                                 self.submit_timeout_s)
      views = [ReplicaView(i, matched, backlog)
               for i, (matched, backlog) in sorted(probes.items())]
      if not views:
        continue  # they all went down while probed: the loop raises NoLiveReplica
      position = self.router.choose(routed, views)
      if not (isinstance(position, (int, np.integer)) and 0 <= position < len(views)):
        raise ReplicaError(f"router {self.router.name!r} chose {position!r}, not a position "
                           f"in [0, {len(views)})")
      index = views[int(position)].index
      try:
        rejected = self.replicas[index].call(("submit", request), self.submit_timeout_s)
      except ReplicaDown as e:
        self._mark_down(index, e.reason)
        probes = None
        continue  # route it again among the others
      if rejected is not None:
        self._record(rejected)
        return -1
      self._inflight[index][request.request_id] = request
      return index

  def _reroute_orphans(self) -> None:
    while self._orphans:
      self._route(self._orphans.pop(0))

  def _mark_down(self, index: int, reason: str) -> None:
    if index in self.down:
      return
    self.down[index] = reason
    self.replicas[index].kill()
    orphans = list(self._inflight[index].values())
    self._inflight[index] = {}
    for request in orphans:
      self._reroutes[request.request_id] = self._reroutes.get(request.request_id, 0) + 1
    self._orphans.extend(orphans)

  def _collect(self, index: int, results: list[ReplicaResult]) -> None:
    for result in results:
      self._inflight[index].pop(result.request_id, None)
      self._record(result)

  def _record(self, result: ReplicaResult) -> None:
    reroutes = self._reroutes.get(result.request_id, 0)
    if reroutes:
      result = dataclasses.replace(result, reroutes=reroutes)
    self.results.append(result)
