"""`EngineProcess`: a server's `Engine` in a process of its own, driven over a pipe
from the server's event loop.

`Server(engine="process")`: the scheduler's steps and the HTTP path never share an
interpreter lock (vLLM V1's AsyncLLM / EngineCore split, here with `multiprocessing`
spawn and one duplex pipe). The engine process builds the `LLM` from a picklable
`make`, sends `("ready", ServedModel)`, then loops: commands, one step, one message
of new tokens. Requests are added with `detokenize=False`; this side decodes text.
The interface and failure semantics are `EngineThread`'s; the engine process dies
with this one (`PR_SET_PDEATHSIG`, EOF on its pipe). Details: docs/server.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.entrypoints.engine_thread import EngineStopped, RequestFailed, Sink, take_places
from paged_kv.entrypoints.llm import LLM, CompletionChunk, Engine, ServedModel
from paged_kv.scheduler.parallel_sampling import sample_ids

__all__ = ["EngineProcess", "EngineStartError", "served_llm"]

_log = logging.getLogger(__name__)

_STOP_WAIT_S = 30.0  # a stopping engine's time to abort its requests and exit
_PIPE_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


class EngineStartError(PagedKVError):
  """The engine process failed to build its engine (the message has its traceback),
  or exited before it was ready."""


# ---------------------------------------------------------------------- engine side
_served: dict[str, Any] = {"llm": None, "exporter": None}  # in the engine process


def served_llm() -> LLM | None:
  """In an engine process: the `LLM` it serves (None for an engine `make` built
  without one). Elsewhere: None."""
  return _served["llm"]


def render_metrics(_engine: Any) -> str | None:
  """The Prometheus text of the engine process's exporter (None without one); a
  `call` target."""
  exporter = _served["exporter"]
  return None if exporter is None else exporter.render()


def _portable(exc: BaseException) -> BaseException:
  """`exc` if it survives pickling, else a library error or `RuntimeError` with its text."""
  try:
    pickle.loads(pickle.dumps(exc))
    return exc
  except Exception:  # pylint: disable=broad-except
    base = next((b for b in (InvalidArgument, PagedKVError) if isinstance(exc, b)), RuntimeError)
    return base(f"{type(exc).__name__}: {exc}")


def _pack(chunk: CompletionChunk) -> tuple:
  return (chunk.request_id, chunk.text, chunk.token_ids, chunk.logprobs, chunk.finished,
          chunk.finish_reason, chunk.num_tokens, chunk.sample, chunk.prompt_logprobs)


def _build(make: Callable[[], Any], model_name: str | None, metrics: bool,
           compile_cache_dir: str | None) -> tuple[Any, ServedModel | None]:
  """The engine process's engine and what the front needs of it."""
  if compile_cache_dir:
    from paged_kv.runtime import compile_cache  # pylint: disable=import-outside-toplevel
    compile_cache.enable_compilation_cache(compile_cache_dir)
  built = make()
  if not isinstance(built, LLM):  # an engine-like object (tests): nothing more to say
    return built, None
  _served["llm"] = built
  if metrics:
    try:
      from paged_kv.telemetry.export import MetricsExporter  # pylint: disable=import-outside-toplevel
      _served["exporter"] = MetricsExporter(model=model_name or built.model_name).attach(
          built.scheduler)
    except ImportError:
      _log.warning("prometheus-client is not installed: /metrics answers 501")
  return built.engine, ServedModel.of(built)


def _engine_main(conn: Any, make: Callable[[], Any], parent_pid: int,
                 options: dict) -> None:
  """The engine process: builds the engine, says ready, serves commands until `stop`
  or until the parent's end of the pipe closes."""
  from paged_kv.cluster.replica_worker import _die_with_parent  # pylint: disable=import-outside-toplevel
  _die_with_parent()
  if os.getppid() != parent_pid:  # the parent died before the line above
    return
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
  try:
    engine, served = _build(make, **options)
  except BaseException as exc:  # pylint: disable=broad-except  (sent to the parent)
    conn.send(("error", _portable(exc), traceback.format_exc()))
    conn.close()
    return
  conn.send(("ready", served))
  try:
    stopped = _EngineLoop(conn, engine).run()
  except _PIPE_GONE:  # the parent closed its end (or died)
    return
  if stopped:  # every request ended and said so: skip the interpreter's ~1 s teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


class _EngineLoop:
  """The engine process's loop: commands, one step, one message of its chunks."""

  def __init__(self, conn: Any, engine: Any):
    self.conn, self.engine = conn, engine
    self.front_decodes = isinstance(engine, Engine)  # else the engine's own text
    self.poller = select.poll()  # one poll object: `conn.poll` builds a selector per call
    self.poller.register(conn.fileno(), select.POLLIN)
    self.live: set = set()
    self.out: list[tuple] = []
    self.failed: list[tuple] = []
    self.stopping = False

  def run(self) -> bool:
    """Serves until `stop` (True) or a failure of the engine (False, said to the parent)."""
    conn, engine, poll = self.conn, self.engine, self.poller.poll
    try:
      while not self.stopping:
        if not engine.has_work:
          poll()  # idle: wait for a command
        while not self.stopping and poll(0):
          self._apply(conn.recv())
        if not self.stopping and engine.has_work:
          for chunk in engine.step():
            self._keep(chunk)
        self._send()
      for rid in list(self.live):  # stopped: every live request ends as aborted
        chunk = engine.abort(rid)
        if chunk is not None:
          self._keep(chunk)
      self._send()
      conn.send(("stopped",))
      return True
    except _PIPE_GONE:
      raise
    except BaseException as exc:  # pylint: disable=broad-except  (the engine is lost)
      conn.send(("died", _portable(exc), traceback.format_exc()))
      return False

  def _keep(self, chunk: CompletionChunk) -> None:
    if chunk.finished:
      self.live.discard(chunk.request_id)
    self.out.append(_pack(chunk))

  def _send(self) -> None:
    if self.out or self.failed:
      self.conn.send(("out", self.out, self.failed))
      self.out, self.failed = [], []

  def _apply(self, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
      _, rid, prompt, sampling, max_tokens, index, final_only = message
      try:
        self.engine.add(prompt, sampling, max_tokens=max_tokens, request_id=rid, index=index,
                        detokenize=not self.front_decodes, final_only=final_only)
        self.live.update(sample_ids(rid, getattr(sampling, "n", 1)))
      except Exception as exc:  # pylint: disable=broad-except  (refused: the request's error)
        error = _portable(exc)
        self.failed.extend((i, error) for i in sample_ids(rid, getattr(sampling, "n", 1)))
    elif kind == "abort":
      chunk = self.engine.abort(message[1])
      if chunk is not None:
        self._keep(chunk)
    elif kind == "call":
      _, call_id, fn = message
      try:
        reply = ("reply", call_id, True, fn(self.engine))
        payload = pickle.dumps(reply)
      except BaseException as exc:  # pylint: disable=broad-except  (handed to the caller)
        payload = pickle.dumps(("reply", call_id, False, _portable(exc)))
      self.conn.send_bytes(payload)
    elif kind == "stop":
      self.stopping = True


# ---------------------------------------------------------------------- server side
@dataclasses.dataclass
class _Route:
  """Where one request's chunks go, and its text decoder (None: the engine decodes)."""

  request_id: Hashable
  sink: Sink
  index: int
  decoder: Any


class EngineProcess:
  """An engine in a process of its own, started by the constructor.

  Args:
    make: a picklable callable that builds the `LLM` in the engine process (or, for
      tests, an object with `Engine`'s `add`, `abort`, `step` and `has_work`).
    metrics: attach a `MetricsExporter` to the scheduler there (`render_metrics`).
    compile_cache_dir: JAX's persistent compilation cache there (default: this
      process's, if any).

  Raises (constructor):
    InvalidArgument: `make` raised it in the engine process (a bad checkpoint path,
      a pool too small); the engine process is gone.
    EngineStartError: any other failure to build, or an exit before `ready`.
  """

  def __init__(self, make: Callable[[], Any], *, max_queued: int = 256,
               model_name: str | None = None, metrics: bool = True,
               start_timeout_s: float = 600.0, compile_cache_dir: str | None = None,
               name: str = "paged_kv-engine"):
    if not callable(make) or isinstance(make, LLM):
      raise InvalidArgument(f"EngineProcess builds its LLM in the engine process: pass a "
                            f"picklable callable that builds it (e.g. functools.partial(LLM, "
                            f"checkpoint, ...)), got {type(make).__name__}")
    if compile_cache_dir is None:
      compile_cache_dir = _compile_cache_dir()
    self.max_queued = max_queued
    self.error: BaseException | None = None
    self._routes: dict[int, _Route] = {}
    self._ids: dict[Hashable, Hashable] = {}  # a front id -> its id in the engine process
    self._next_id = itertools.count()
    self._calls: dict[int, concurrent.futures.Future] = {}
    self._outstanding = 0
    self._lock = threading.Lock()  # the counters and the pipe's sending end
    self._loop: asyncio.AbstractEventLoop | None = None
    self._loop_thread: int | None = None
    self._started = False
    self._stopped = threading.Event()
    context = multiprocessing.get_context("spawn")
    self._conn, child_conn = context.Pipe(duplex=True)
    options = dict(model_name=model_name, metrics=metrics, compile_cache_dir=compile_cache_dir)
    self._process = context.Process(target=_engine_main,
                                    args=(child_conn, make, os.getpid(), options),
                                    name=name, daemon=True)
    try:
      self._process.start()
    finally:
      child_conn.close()
    self.pid: int = self._process.pid
    self._finalizer = weakref.finalize(self, _reap, self._process, self._conn)
    try:
      self.served: ServedModel | None = self._wait_ready(start_timeout_s)
    except BaseException:
      self._stopped.set()
      self._finalizer()
      raise

  def _wait_ready(self, timeout_s: float) -> ServedModel | None:
    from multiprocessing import connection  # pylint: disable=import-outside-toplevel
    if not connection.wait([self._conn, self._process.sentinel], timeout_s):
      raise EngineStartError(f"the engine process was not ready within {timeout_s:g} s")
    try:
      message = self._conn.recv()
    except (EOFError, OSError):
      self._process.join(5)
      raise EngineStartError(f"the engine process exited before it was ready (exit code "
                             f"{self._process.exitcode})") from None
    if message[0] == "error":
      _, exc, text = message
      if isinstance(exc, InvalidArgument):
        raise exc
      raise EngineStartError(f"the engine process failed to start:\n{text}")
    return message[1]

  # ------------------------------------------------------------------ any thread
  def start(self) -> "EngineProcess":
    """Makes the running event loop read the engine's messages (call it from a
    coroutine of that loop)."""
    if self._stopped.is_set():
      raise EngineStopped(self._why_stopped())
    self._loop = asyncio.get_running_loop()
    self._loop_thread = threading.get_ident()
    fd = self._conn.fileno()
    self._loop.add_reader(fd, self._on_readable)
    os.set_blocking(fd, True)  # uvloop's reader made it non-blocking: a long message
    self._started = True       # would come in parts (and a send could fail half-way)
    return self

  @property
  def running(self) -> bool:
    return self._started and not self._stopped.is_set()

  @property
  def outstanding(self) -> int:
    """Requests submitted and not finished."""
    return self._outstanding

  def submit(self, request_id: Hashable, prompt_ids: Sequence[int], sampling: Any,
             max_tokens: int, sink: Sink, *, index: int = 0, final_only: bool = False) -> None:
    """As `EngineThread.submit`, on the event loop's thread (sinks run there).

    Raises:
      QueueFull, EngineStopped, InvalidArgument: as `take_places` (also: id in use).
    """
    fronts = sample_ids(request_id, getattr(sampling, "n", 1))
    n = take_places(self, request_id, sampling,
                    in_use=lambda: any(i in self._ids for i in fronts))
    rid = next(self._next_id)
    tokenizer = self.served.tokenizer if self.served is not None else None
    stops = getattr(sampling, "stop", None)
    for front, engine_id in zip(fronts, sample_ids(rid, n)):
      decoder = None
      if tokenizer is not None:
        from paged_kv.scheduler.stop_strings import StopStringMatcher  # pylint: disable=import-outside-toplevel
        decoder = StopStringMatcher(tokenizer, stops) if stops else tokenizer.stream()
      self._routes[engine_id] = _Route(front, sink, index, decoder)
      self._ids[front] = engine_id
    self._send(("add", rid, list(prompt_ids), sampling, max_tokens, index, final_only))

  def abort(self, request_id: Hashable) -> None:
    """Ends a request (its row and blocks are released in the engine process); its
    last chunk (`finish_reason="abort"`) goes to its sink. Unknown ids are ignored."""
    rid = self._ids.get(request_id)
    if rid is not None and self.running:
      self._send(("abort", rid))

  def call(self, fn: Callable[[Engine], Any], timeout: float | None = 30.0) -> Any:
    """Runs the picklable `fn(engine)` in the engine process between two steps; raises
    as `EngineThread.call`, and `InvalidArgument` on the event loop's thread (use
    `acall`)."""
    if threading.get_ident() == self._loop_thread:
      raise InvalidArgument("EngineProcess.call on the event loop's thread would wait for "
                            "the loop itself: await acall(fn) there")
    return self._call(fn).result(timeout)

  async def acall(self, fn: Callable[[Engine], Any]) -> Any:
    """`call` for a coroutine of the event loop."""
    return await asyncio.wrap_future(self._call(fn))

  def stop(self, timeout: float | None = _STOP_WAIT_S) -> None:
    """As `EngineThread.stop`, and reaps the process."""
    if not self._stopped.is_set():
      try:
        self._send(("stop",))  # never started: the process exits all the same
      except EngineStopped:
        pass
      if self._started and threading.get_ident() != self._loop_thread:
        self._stopped.wait(timeout)
      if not self._stopped.is_set():  # no answer (or never started): end it here
        self._end_soon()
    if threading.get_ident() != self._loop_thread:
      self._process.join(timeout)
      self._finalizer()

  def _end_soon(self) -> None:
    """`_end` on the loop's thread when the loop still runs (sinks belong to it), else here."""
    loop = self._loop
    if loop is not None and not loop.is_closed() and threading.get_ident() != self._loop_thread:
      try:
        loop.call_soon_threadsafe(lambda: self._end(None, on_loop=True))
        return
      except RuntimeError:  # closed meanwhile
        pass
    self._end(None, on_loop=loop is not None and not loop.is_closed())

  def _why_stopped(self) -> str:
    if self.error is not None:
      return f"the engine stopped: {type(self.error).__name__}: {self.error}"
    return "the engine is not running"

  def _call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
    if not self.running:
      raise EngineStopped(self._why_stopped())
    call_id = next(self._next_id)
    try:
      payload = pickle.dumps(("call", call_id, fn))
    except Exception as exc:  # pylint: disable=broad-except  (the caller's mistake)
      raise InvalidArgument(f"call needs a picklable fn (a module-level function or a "
                            f"functools.partial of one): {exc}") from None
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._calls[call_id] = future
    try:
      self._send(payload)
    except BaseException:
      self._calls.pop(call_id, None)
      raise
    return future

  def _send(self, message: tuple | bytes) -> None:
    """Sends a command (or its pickle)."""
    try:
      with self._lock:
        if isinstance(message, bytes):
          self._conn.send_bytes(message)
        else:
          self._conn.send(message)
    except (BrokenPipeError, OSError) as exc:
      raise EngineStopped(f"the engine process is gone ({type(exc).__name__})") from None

  # ------------------------------------------------------------------ on the loop
  def _on_readable(self) -> None:
    try:
      message = self._conn.recv()
    except (EOFError, OSError) as exc:
      self._process.join(1.0)
      self._end(EngineStopped(
          f"the engine process exited (exit code {self._process.exitcode})"
          if isinstance(exc, (EOFError, ConnectionResetError))  # reset: it died unread
          else f"the pipe to the engine process broke: {exc!r}"),
                on_loop=True)
      return
    kind = message[0]
    if kind == "out":
      self._deliver(message[1], message[2])
    elif kind == "reply":
      _, call_id, ok, value = message
      future = self._calls.pop(call_id, None)
      if future is not None and future.set_running_or_notify_cancel():
        (future.set_result if ok else future.set_exception)(value)
    elif kind == "died":
      _log.error("the engine process stopped:\n%s", message[2])
      self._end(message[1], on_loop=True)
    elif kind == "stopped":
      self._end(None, on_loop=True)

  def _deliver(self, chunks: list[tuple], failed: list[tuple]) -> None:
    routes = self._routes
    for (rid, text, token_ids, logprobs, finished, reason, num_tokens, sample,
         prompt_logprobs) in chunks:
      route = routes.pop(rid, None) if finished else routes.get(rid)
      if route is None:
        continue
      decoder = route.decoder
      if decoder is not None:
        text = "".join([decoder.add(t) for t in token_ids])
        if finished:
          text += decoder.flush()
      self._finish(route, rid, CompletionChunk(route.request_id, route.index, text, token_ids,
                                               logprobs, finished, reason, num_tokens, sample,
                                               prompt_logprobs), finished)
    for rid, exc in failed:
      route = routes.pop(rid, None)
      if route is not None:
        self._finish(route, rid, RequestFailed(route.request_id, exc), True)

  def _finish(self, route: _Route, rid: int, item: Any, last: bool) -> None:
    if last:
      self._ids.pop(route.request_id, None)
      with self._lock:
        self._outstanding -= 1
    try:
      route.sink(item)
    except Exception:  # pylint: disable=broad-except  (a consumer's bug must not stop serving)
      _log.exception("a sink of request %r raised", route.request_id)

  def _end(self, error: BaseException | None, *, on_loop: bool) -> None:
    """The engine is gone (stopped, or lost): every live request's sink gets a
    `RequestFailed`, every pending call an `EngineStopped`."""
    if self._stopped.is_set():
      return
    if error is not None:
      self.error = error
    if on_loop and self._loop is not None:
      self._loop.remove_reader(self._conn.fileno())
    why = EngineStopped(self._why_stopped())
    for rid, route in list(self._routes.items()):
      self._routes.pop(rid, None)
      self._finish(route, rid, RequestFailed(route.request_id, why), True)
    for future in list(self._calls.values()):
      if future.set_running_or_notify_cancel():
        future.set_exception(why)
    self._calls.clear()
    self._stopped.set()


def _compile_cache_dir() -> str | None:
  """The persistent compilation cache this process has on, without importing JAX."""
  if "jax" not in sys.modules:
    return None
  return sys.modules["jax"].config.jax_compilation_cache_dir


def _reap(process: Any, conn: Any) -> None:
  """Closes the pipe and ends the process (terminate, then kill) if it still runs."""
  from paged_kv.cluster.replicas import _reap as reap  # pylint: disable=import-outside-toplevel
  conn.close()
  reap(process)
