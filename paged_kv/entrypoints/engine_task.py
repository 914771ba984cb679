"""`EngineTask`: an `Engine` stepped by a task of the server's own asyncio loop.

`EngineThread`'s interface and failure semantics on one thread: no interpreter-lock
contention and no cross-thread wake-up, but a step holds the loop for its host time
(the task yields once per step). `start()` must run on the loop; `stop()` and
`call()` may come from any thread. Trade-offs: docs/server.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from paged_kv.entrypoints.engine_thread import EngineStopped, EngineThread, Sink
from paged_kv.entrypoints.llm import Engine

__all__ = ["EngineTask"]

_log = logging.getLogger(__name__)


class EngineTask(EngineThread):
  """Runs `engine` as a task of the loop `start()` is called on; sinks run on the loop."""

  def __init__(self, engine: Engine, *, max_queued: int = 256,
               name: str = "paged_kv-engine"):
    super().__init__(engine, max_queued=max_queued, name=name)
    self._loop: asyncio.AbstractEventLoop | None = None
    self._loop_thread: int | None = None
    self._task: asyncio.Task | None = None
    self._wake: asyncio.Event | None = None
    self._done = threading.Event()

  # ------------------------------------------------------------------ any thread
  def start(self) -> "EngineTask":
    """Creates the task on the running loop (call it from a coroutine of that loop)."""
    self._loop = asyncio.get_running_loop()
    self._loop_thread = threading.get_ident()
    self._wake = asyncio.Event()
    self._task = self._loop.create_task(self._run(), name=self._thread.name)
    return self

  @property
  def running(self) -> bool:
    return self._task is not None and not self._done.is_set() and not self._stop.is_set()

  def submit(self, request_id: Hashable, prompt_ids: Sequence[int], sampling: Any,
             max_tokens: int, sink: Sink, *, index: int = 0, final_only: bool = False) -> None:
    """As `EngineThread.submit` (the request joins at the task's next turn)."""
    super().submit(request_id, prompt_ids, sampling, max_tokens, sink, index=index,
                   final_only=final_only)
    self._poke()

  def abort(self, request_id: Hashable) -> None:
    """As `EngineThread.abort`."""
    super().abort(request_id)
    self._poke()

  def call(self, fn: Callable[[Engine], Any], timeout: float | None = 30.0) -> Any:
    """As `EngineThread.call`; on the loop's own thread it runs at once (no step is
    under way while another coroutine runs)."""
    if not self.running:
      raise EngineStopped(self._why_stopped())
    if self._on_loop():
      return fn(self.engine)
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(("call", (fn, future)))
    self._poke()
    return future.result(timeout)

  def stop(self, timeout: float | None = 30.0) -> None:
    """As `EngineThread.stop`; on the loop's thread it returns without waiting."""
    self._stop.set()
    self._inbox.put(("stop", None))
    if self._task is None:
      return
    self._poke()
    if not self._on_loop():
      self._done.wait(timeout)

  def _on_loop(self) -> bool:
    return threading.get_ident() == self._loop_thread

  def _poke(self) -> None:
    """Wakes the task if it waits for work."""
    if self._wake is None:
      return
    if self._on_loop():
      self._wake.set()
    else:
      try:
        self._loop.call_soon_threadsafe(self._wake.set)
      except RuntimeError:  # the loop is closed: the task is gone with it
        pass

  # ------------------------------------------------------------------ the task
  async def _run(self) -> None:
    engine, inbox, wake = self.engine, self._inbox, self._wake
    try:
      while not self._stop.is_set():
        if not engine.has_work and inbox.empty():
          wake.clear()
          if inbox.empty():
            await wake.wait()
          continue
        self._drain_inbox()
        if self._stop.is_set():
          break
        if engine.has_work:
          for chunk in engine.step():
            self._deliver(chunk)
        await asyncio.sleep(0)  # the loop's turn: sockets, handlers
    except asyncio.CancelledError:  # the loop is shutting down: clean up, then let it
      raise
    except BaseException as exc:  # pylint: disable=broad-except  (recorded; sinks told)
      self.error = exc
      _log.exception("the engine task stopped")
    finally:
      self._stop.set()
      self._shutdown()
      self._done.set()
