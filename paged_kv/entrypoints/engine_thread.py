"""`EngineThread`: one background thread runs an `Engine`; other threads talk to it
through a thread-safe inbox and per-request sinks.

One thread touches the `Engine` because each step donates the pool's state. `submit`,
`abort` and `call` return at once; the thread applies them between two steps, in
order. Chunks go to each request's sink on the engine thread, or, with `dispatch`,
once per step as one list of `(sink, item)` pairs (one loop wake-up per step).
Requests outstanding are bounded by `max_queued`; one with `sampling.n > 1` counts `n`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.entrypoints.llm import CompletionChunk, Engine
from paged_kv.scheduler.parallel_sampling import sample_ids

__all__ = ["EngineStopped", "EngineThread", "QueueFull", "RequestFailed", "take_places"]

_log = logging.getLogger(__name__)

Sink = Callable[[Any], None]
"""Called on the engine thread with each `CompletionChunk` of a request, or once
with a `RequestFailed` (then nothing more comes)."""


class QueueFull(PagedKVError):
  """`max_queued` requests are submitted and not finished: try again later."""


class EngineStopped(PagedKVError):
  """The engine thread is not running (stopped, or died: see `EngineThread.error`)."""


@dataclasses.dataclass(frozen=True)
class RequestFailed:
  """A request's last item when it could not be served (`error`: why)."""

  request_id: Hashable
  error: BaseException


def take_places(engine: Any, request_id: Hashable, sampling: Any,
                in_use: Callable[[], bool] | None = None) -> int:
  """Counts a request's `sampling.n` samples against `engine`'s queue bound; returns `n`.

  Raises:
    InvalidArgument: `n` above `max_queued`, or `in_use()`.
    EngineStopped: the engine is not running.
    QueueFull: the samples do not fit beside the outstanding requests.
  """
  n = getattr(sampling, "n", 1)
  if n > max(engine.max_queued, 1):
    raise InvalidArgument(f"n={n} samples exceed the {engine.max_queued} requests this "
                          f"server queues at once")
  with engine._lock:  # pylint: disable=protected-access
    if not engine.running:
      raise EngineStopped(engine._why_stopped())  # pylint: disable=protected-access
    outstanding = engine._outstanding  # pylint: disable=protected-access
    if outstanding + n > engine.max_queued:
      raise QueueFull(f"{outstanding} requests are queued or running (the limit is "
                      f"{engine.max_queued}); retry later")
    if in_use is not None and in_use():
      raise InvalidArgument(f"request id {request_id!r} is in use")
    engine._outstanding = outstanding + n  # pylint: disable=protected-access
  return n


class EngineThread:
  """Runs `engine` on a daemon thread; touch `engine` only through `call`. `error`:
  the exception that stopped the thread, or None."""

  def __init__(self, engine: Engine, *, max_queued: int = 256, idle_wait_s: float = 0.05,
               dispatch: Callable[[list[tuple[Sink, Any]]], None] | None = None,
               name: str = "paged_kv-engine"):
    self.engine = engine
    self.dispatch = dispatch
    self.max_queued = max_queued
    self.error: BaseException | None = None
    self._idle_wait_s = idle_wait_s
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[Hashable, Sink] = {}
    self._pending: list[tuple[Sink, Any]] = []  # (sink, item) to dispatch after the step
    self._outstanding = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

  # ------------------------------------------------------------------ any thread
  def start(self) -> "EngineThread":
    self._thread.start()
    return self

  @property
  def running(self) -> bool:
    return self._thread.is_alive() and not self._stop.is_set()

  @property
  def outstanding(self) -> int:
    """Requests submitted and not finished."""
    return self._outstanding

  def submit(self, request_id: Hashable, prompt_ids: Sequence[int], sampling: Any,
             max_tokens: int, sink: Sink, *, index: int = 0, final_only: bool = False) -> None:
    """Queues a request; `Engine.add` runs on the thread and a refusal there reaches
    `sink` as a `RequestFailed` per sample. Raises as `take_places`."""
    take_places(self, request_id, sampling)
    self._inbox.put(("add", (request_id, list(prompt_ids), sampling, max_tokens, sink, index,
                             final_only)))

  def abort(self, request_id: Hashable) -> None:
    """Ends a request; its last chunk goes to its sink. Unknown ids are ignored."""
    self._inbox.put(("abort", request_id))

  def call(self, fn: Callable[[Engine], Any], timeout: float | None = 30.0) -> Any:
    """Runs `fn(engine)` on the engine thread between two steps; returns its result.

    Raises:
      EngineStopped: the thread is not running.
      TimeoutError: no answer within `timeout` seconds.
    """
    if not self.running:
      raise EngineStopped(self._why_stopped())
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(("call", (fn, future)))
    return future.result(timeout)

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops the thread after its current step; live requests are aborted (their
    sinks get their last chunk)."""
    self._stop.set()
    self._inbox.put(("stop", None))
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(timeout)

  def _why_stopped(self) -> str:
    if self.error is not None:
      return f"the engine stopped: {type(self.error).__name__}: {self.error}"
    return "the engine is not running"

  # ------------------------------------------------------------------ the thread
  def _deliver(self, item: Any) -> None:
    rid = item.request_id
    last = isinstance(item, RequestFailed) or item.finished
    sink = self._sinks.pop(rid, None) if last else self._sinks.get(rid)
    if sink is None:
      return
    if last:
      with self._lock:
        self._outstanding -= 1
    if self.dispatch is not None:
      self._pending.append((sink, item))
      return
    try:
      sink(item)
    except Exception:  # pylint: disable=broad-except  (a consumer's bug must not stop serving)
      _log.exception("a sink of request %r raised", rid)

  def _flush(self) -> None:
    """Hands the items gathered since the last flush to `dispatch`, in one call."""
    if self._pending:
      pending, self._pending = self._pending, []
      try:
        self.dispatch(pending)
      except Exception:  # pylint: disable=broad-except  (a consumer's bug must not stop serving)
        _log.exception("dispatching %d items raised", len(pending))

  def _apply(self, kind: str, arg: Any) -> None:
    engine = self.engine
    if kind == "add":
      rid, prompt, sampling, max_tokens, sink, index, final_only = arg
      ids = sample_ids(rid, getattr(sampling, "n", 1))
      for i in ids:
        self._sinks[i] = sink
      try:
        engine.add(prompt, sampling, max_tokens=max_tokens, request_id=rid, index=index,
                   final_only=final_only)
      except Exception as exc:  # pylint: disable=broad-except  (refused: the request's error)
        for i in ids:
          self._deliver(RequestFailed(i, exc))
    elif kind == "abort":
      chunk = engine.abort(arg)
      if chunk is not None:
        self._deliver(chunk)
    elif kind == "call":
      fn, future = arg
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(engine))
        except BaseException as exc:  # pylint: disable=broad-except  (handed to the caller)
          future.set_exception(exc)

  def _drain_inbox(self) -> None:
    """Applies the queued commands in order; a "stop" leaves the rest for `_shutdown`."""
    while True:
      try:
        kind, arg = self._inbox.get_nowait()
      except queue.Empty:
        return
      if kind == "stop":
        self._stop.set()
        return
      self._apply(kind, arg)

  def _loop(self) -> None:
    engine, inbox = self.engine, self._inbox
    try:
      while not self._stop.is_set():
        if not engine.has_work:
          try:  # idle: sleep until a command comes
            kind, arg = inbox.get(timeout=self._idle_wait_s)
          except queue.Empty:
            continue
          if kind == "stop":
            break
          self._apply(kind, arg)
        self._drain_inbox()
        self._flush()
        if self._stop.is_set():
          break
        if engine.has_work:
          chunks: list[CompletionChunk] = engine.step()
          for chunk in chunks:
            self._deliver(chunk)
          self._flush()
    except BaseException as exc:  # pylint: disable=broad-except  (recorded; sinks told)
      self.error = exc
      _log.exception("the engine thread stopped")
    finally:
      self._stop.set()
      self._shutdown()

  def _shutdown(self) -> None:
    """Ends every live request: aborted when the engine still works, failed otherwise;
    answers pending calls and refuses queued submissions."""
    for rid in list(self._sinks):
      chunk = None
      if self.error is None:
        try:
          chunk = self.engine.abort(rid)
        except Exception as exc:  # pylint: disable=broad-except
          self.error = exc
      self._deliver(chunk if chunk is not None else
                    RequestFailed(rid, EngineStopped(self._why_stopped())))
    while True:
      try:
        kind, arg = self._inbox.get_nowait()
      except queue.Empty:
        break
      if kind == "add":
        for rid in sample_ids(arg[0], getattr(arg[2], "n", 1)):
          self._sinks[rid] = arg[4]
          self._deliver(RequestFailed(rid, EngineStopped(self._why_stopped())))
      elif kind == "call":
        arg[1].set_exception(EngineStopped(self._why_stopped()))
    self._flush()
