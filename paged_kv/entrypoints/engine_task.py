"""`EngineTask`: an `Engine` stepped by a task of the server's own asyncio loop.

The alternative to `EngineThread` for a server: one thread holds both the HTTP
handlers and the scheduler, so no step waits for the interpreter lock while the
loop parses a request (and the other way round), and the chunks of a step reach
their requests without a cross-thread wake-up. Between two steps the task yields
to the loop once (`await asyncio.sleep(0)`): the loop reads the sockets that are
ready and runs the handlers, whose requests join the next step. The cost is that a
step holds the loop for its host time (and, where the step waits for its device
result, that wait): requests are parsed between steps, not during them. This is
the design of vLLM's first `AsyncLLMEngine`; its second runs the engine in its own
process instead.

The interface is `EngineThread`'s (`submit`, `abort`, `call`, `stop`, `running`,
`outstanding`, `error`), with the same queue bound and failure semantics:
commands wait in the inbox until the task's next turn, and a request's chunks go
to its sink on the loop. `start()` must run on the loop (e.g. in an app's
lifespan); `stop()` and `call()` may come from any other thread.
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
  """Runs `engine` as a task of the asyncio loop `start()` is called on (see the
  module docstring). `dispatch` is not used: sinks run on the loop directly."""

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
    """Runs `fn(engine)` between two steps and returns its result. On the loop's own
    thread it runs at once (no step is under way while another coroutine runs).

    Raises:
      EngineStopped: the task is not running.
      TimeoutError: no answer within `timeout` seconds.
    """
    if not self.running:
      raise EngineStopped(self._why_stopped())
    if self._on_loop():
      return fn(self.engine)
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(("call", (fn, future)))
    self._poke()
    return future.result(timeout)

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops the task after its current step; live requests are aborted (their sinks
    get their last chunk). From another thread it waits up to `timeout` seconds for
    the task to end; on the loop's thread it returns at once."""
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
