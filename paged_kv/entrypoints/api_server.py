"""An OpenAI-compatible HTTP server over an `LLM` (the `server` extra: FastAPI, uvicorn,
jinja2).

  python -m paged_kv.serve --checkpoint Llama-3.2-1B --port 8000

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the checkpoint's
chat template, `openai_api.ChatTemplate`), `GET /v1/models`, `GET /health` (503
once the engine has stopped), `GET /metrics` (the Prometheus exporter,
`paged_kv.telemetry.MetricsExporter`, attached to the scheduler, in whichever
process runs it). `stream: true`
answers with server-sent events (`data: {...}` chunks, then `data: [DONE]`).

`Server(engine=...)` runs the scheduler on a thread (`EngineThread`, the default),
as a task of the event loop (`EngineTask`) or in a process (`EngineProcess`); see
docs/server.md. A client that disconnects gets its request aborted at once.

Status codes: 400 for a request the API refuses (OpenAI's error body names the
field), 404 for another model's name, 429 when `max_queued` requests are already
queued or running (retry later), 503 when the engine has stopped, 500 for a
failure of the server itself (counted in `Server.num_server_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from paged_kv.core.errors import InvalidArgument
from paged_kv.model import optional_import
from paged_kv.entrypoints import openai_api as api
from paged_kv.entrypoints.engine_process import EngineProcess, render_metrics
from paged_kv.entrypoints.engine_task import EngineTask
from paged_kv.entrypoints.engine_thread import EngineStopped, EngineThread, QueueFull, RequestFailed
from paged_kv.entrypoints.llm import LLM, CompletionChunk, ContextLengthExceeded, ServedModel
from paged_kv.scheduler.parallel_sampling import sample_ids

__all__ = ["BackgroundServer", "Server", "build_app", "serve"]

_log = logging.getLogger(__name__)

ENGINES = {"thread": EngineThread, "loop": EngineTask, "process": EngineProcess}
"""Where `Server(engine=...)` runs the scheduler: its own thread, the event loop, or
a process of its own."""

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks for its client


def _fastapi():
  return optional_import.require("fastapi", needed_for="the HTTP server", extra="server")


class Server:
  """The server's state: the `LLM`, its engine, the chat template, the metrics.

  `llm` is an `LLM`, or a picklable callable that builds one (e.g.
  `functools.partial(LLM, checkpoint, max_batch=64)`); `engine="process"` needs the
  callable: the engine process builds the `LLM` itself (this process keeps only its
  tokenizer and a description, `ServedModel`).

  Attributes:
    llm: the `LLM` served (None with `engine="process"`: it lives in the engine
      process).
    served: the `ServedModel` (name, context, vocabulary, tokenizer) requests are
      checked and decoded with.
    engine: the `EngineThread` running `llm.engine` (`engine="loop"`: the
      `EngineTask`; `engine="process"`: the `EngineProcess`).
    model_name: the name `/v1/models` lists and requests must use.
    template: the checkpoint's `ChatTemplate`, or None (`/v1/chat/completions`
      then answers 400).
    exporter: the `MetricsExporter`, or None (the `metrics` extra missing, or
      `engine="process"`: the exporter is in the engine process).
    metrics: whether /metrics has an exporter to render (here or in the engine
      process).
    num_server_errors: responses that failed inside the server (HTTP 500, or a
      stream cut by an engine failure).
    num_client_disconnects: requests whose client left before its body arrived
      (nothing was queued; answered 499 to nobody, not counted as errors).
  """

  def __init__(self, llm: Any, *, max_queued: int = 256, model_name: str | None = None,
               template: api.ChatTemplate | None = None, metrics: bool = True,
               engine: str = "thread"):
    if engine not in ENGINES:
      raise InvalidArgument(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
    self.template = template
    self.exporter = None
    self.num_server_errors = 0
    self.num_client_disconnects = 0
    self.created = int(time.time())
    if engine == "process":
      self.llm = None
      self.engine = EngineProcess(llm, max_queued=max_queued, model_name=model_name,
                                  metrics=metrics)
      self.served = self.engine.served
      self.model_name = model_name or self.served.model_name
      self.metrics = metrics
      return
    if not isinstance(llm, LLM):
      if not callable(llm):
        raise InvalidArgument(f"Server takes an LLM or a callable that builds one, got "
                              f"{type(llm).__name__}")
      llm = llm()
    self.llm = llm
    self.served = ServedModel.of(llm)
    self.model_name = model_name or llm.model_name
    if metrics:
      try:
        from paged_kv.telemetry.export import MetricsExporter  # pylint: disable=import-outside-toplevel
        self.exporter = MetricsExporter(model=self.model_name).attach(llm.scheduler)
      except ImportError:
        _log.warning("prometheus-client is not installed: /metrics answers 501")
    self.metrics = self.exporter is not None
    self.engine = ENGINES[engine](llm.engine, max_queued=max_queued)

  @property
  def max_logprobs(self) -> int:
    return self.served.max_logprobs

  async def render_metrics(self) -> str | None:
    """The Prometheus text, or None without an exporter."""
    if isinstance(self.engine, EngineProcess):
      return await self.engine.acall(render_metrics) if self.metrics else None
    return None if self.exporter is None else self.exporter.render()

  def prompt_ids(self, prompt: Any) -> list[int]:
    """Token ids of a text or token-id prompt (`BadRequest` when refused)."""
    try:
      return self.served.encode(list(prompt) if isinstance(prompt, tuple) else prompt)
    except InvalidArgument as err:
      raise api.BadRequest(str(err), param="prompt") from None

  def chat_ids(self, messages: list) -> list[int]:
    if self.template is None:
      raise api.BadRequest("this model has no chat template (tokenizer_config.json's "
                           "chat_template): use /v1/completions", param="messages")
    if self.served.tokenizer is None:
      raise api.BadRequest("this model has no tokenizer", param="messages")
    text = self.template.render(messages)
    ids = self.served.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
      raise api.BadRequest("the chat template rendered an empty prompt", param="messages")
    return ids

  def max_tokens(self, num_prompt: int, asked: int | None) -> int:
    """`asked`, or the rest of the context; `BadRequest` beyond the context."""
    max_tokens = asked if asked is not None else self.served.max_seq_len - num_prompt
    try:
      self.served.check_context(num_prompt, max(max_tokens, 1))
    except ContextLengthExceeded as err:
      raise api.BadRequest(str(err), param="max_tokens" if asked else "messages",
                           code="context_length_exceeded") from None
    return max_tokens


class _Submitted:
  """The requests of one HTTP request and where their chunks go (on the loop): a queue
  the stream reads, or, not streamed, lists per choice (`choice`: prompt, then its
  `n` samples) and an event set when all finished (no coroutine wakes per chunk)."""

  def __init__(self, server: Server, prefix: str, num_prompts: int, *, stream: bool,
               n: int = 1):
    self.server, self.prefix, self.n = server, prefix, n
    self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
    self.chunks: list[list[CompletionChunk]] = [[] for _ in range(num_prompts * n)]
    self.failed: BaseException | None = None
    self.done = asyncio.Event()
    self.live: set[str] = set()

  def _keep(self, item: Any) -> None:
    if isinstance(item, RequestFailed):
      self.failed = self.failed or item.error
      self.live.discard(item.request_id)
    else:
      self.chunks[self.choice(item)].append(item)
      if item.finished:
        self.live.discard(item.request_id)
    if not self.live:
      self.done.set()

  def choice(self, item: CompletionChunk) -> int:
    """The choice `index` of a chunk: OpenAI's (and vLLM's) prompt * n + sample."""
    return item.index * self.n + item.sample

  def submit(self, ids_and_limits: list[tuple[list[int], int]], sampling: Any) -> None:
    # Sinks run on the loop (`_dispatch_on`).
    sink = self.queue.put_nowait if self.queue is not None else self._keep
    ids: list = []
    try:
      for i, (prompt, limit) in enumerate(ids_and_limits):
        ids = sample_ids(f"{self.prefix}-{i}", self.n)
        self.live.update(ids)
        self.server.engine.submit(ids[0], prompt, sampling, limit, sink, index=i,
                                  final_only=self.queue is None)
    except BaseException:
      self.live.difference_update(ids)
      self.abort()
      raise

  async def batch(self) -> list:
    """The items of a streamed request that arrived since the last call (waits for one)."""
    items = [await self.queue.get()]
    while not self.queue.empty():
      items.append(self.queue.get_nowait())
    for item in items:
      if isinstance(item, RequestFailed) or item.finished:
        self.live.discard(item.request_id)
    return items

  async def wait(self, request: Any) -> bool:
    """Until every request of a non-streamed one finished (True), or its client went
    away (False: they are aborted)."""
    try:
      while not self.done.is_set():
        try:
          await asyncio.wait_for(self.done.wait(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            self.abort()
            return False
    except BaseException:
      self.abort()
      raise
    if self.failed is not None:
      raise self.failed
    return True

  def abort(self) -> None:
    for rid in self.live:
      self.server.engine.abort(rid)


def build_app(server: Server) -> Any:
  """The FastAPI app of `server` (its lifespan starts and stops the engine)."""
  fastapi = _fastapi()
  from fastapi import responses  # pylint: disable=import-outside-toplevel
  from starlette.requests import ClientDisconnect  # pylint: disable=import-outside-toplevel

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    if isinstance(server.engine, EngineThread) and not isinstance(server.engine, EngineTask):
      server.engine.dispatch = _dispatch_on(asyncio.get_running_loop())  # else on the loop
    if not server.engine.running:
      server.engine.start()
    try:
      yield
    finally:
      await asyncio.to_thread(server.engine.stop)

  app = fastapi.FastAPI(title="paged_kv", lifespan=lifespan)
  app.state.server = server

  def error(status: int, message: str, **kwargs) -> Any:
    kind = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return responses.JSONResponse(api.error_body(message, kind=kind, **kwargs), status_code=status)

  async def body_of(request: Any) -> Any:
    try:
      return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as err:
      raise api.BadRequest(f"the request body is not JSON: {err}") from None

  async def handle(request: Any, run) -> Any:
    try:
      out = await run(await body_of(request))
      # A body as a JSONResponse: FastAPI would pass a dict through jsonable_encoder
      # first (~60-170 us a completion, all of a batch's at its last step).
      return responses.JSONResponse(out) if isinstance(out, dict) else out
    except api.BadRequest as err:
      return error(err.status, str(err), param=err.param, code=err.code)
    except InvalidArgument as err:  # refused at submit (nothing queued): the client's
      return error(400, str(err))
    except QueueFull as err:
      return error(429, str(err))
    except EngineStopped as err:
      return error(503, str(err))
    except ClientDisconnect:  # gone while its body was read: nobody to answer
      server.num_client_disconnects += 1
      return responses.Response(status_code=499)
    except Exception as err:  # pylint: disable=broad-except  (answered 500, counted, logged)
      server.num_server_errors += 1
      _log.exception("request failed")
      return error(500, f"{type(err).__name__}: {err}")

  @app.get("/health")
  async def health():
    if server.engine.running:
      return {"status": "ok", "outstanding": server.engine.outstanding}
    return error(503, EngineStopped(server.engine._why_stopped()).args[0])  # pylint: disable=protected-access

  @app.get("/metrics")
  async def metrics():
    try:
      text = await server.render_metrics()
    except EngineStopped as err:
      return error(503, str(err))
    if text is None:
      return responses.PlainTextResponse("prometheus-client is not installed "
                                         "(pip install 'paged-kv[metrics]')\n", status_code=501)
    return responses.PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": server.created,
        "owned_by": "paged_kv", "max_model_len": server.served.max_seq_len}]}

  async def completions(request):
    return await handle(request, lambda body: _completions(server, request, body))

  async def chat_completions(request):
    return await handle(request, lambda body: _chat(server, request, body))

  # FastAPI injects the request by the parameter's annotation (a class, not a string:
  # this module's annotations are postponed).
  from starlette.requests import Request  # pylint: disable=import-outside-toplevel
  for route in (completions, chat_completions):
    route.__annotations__ = {"request": Request}
  app.post("/v1/completions")(completions)
  app.post("/v1/chat/completions")(chat_completions)
  return app


def _dispatch_on(loop: asyncio.AbstractEventLoop):
  """The engine thread's `dispatch`: a step's `(sink, item)` pairs run on `loop`, in one
  wake-up (each sink is an `asyncio.Queue.put_nowait` of that loop)."""

  def run(pairs: list) -> None:
    for sink, item in pairs:
      sink(item)

  return lambda pairs: loop.call_soon_threadsafe(run, pairs)


class _ClientGone:
  """Set when a streamed response's client went away (`_event_stream`)."""

  __slots__ = ("gone",)

  def __init__(self):
    self.gone = False


@functools.cache
def _event_stream_class() -> type:
  """Starlette's `StreamingResponse` that also marks a `_ClientGone` when its listener
  sees the client disconnect. The listener cancels the stream's task, but a
  cancellation lands only while the task waits on a pending future: with the engine
  on the event loop (`EngineTask`) each step hands the stream its next chunks before
  the cancellation is delivered, so the stream checks the mark between chunks."""
  from starlette.responses import StreamingResponse  # pylint: disable=import-outside-toplevel

  class EventStream(StreamingResponse):

    def __init__(self, content, client: _ClientGone):
      super().__init__(content, media_type="text/event-stream")
      self.client = client

    async def listen_for_disconnect(self, receive) -> None:
      await super().listen_for_disconnect(receive)
      self.client.gone = True

  return EventStream


def _event_stream(server: Server, sub: _Submitted, render, *, first: str, last) -> Any:
  """The server-sent-events response of a streamed request (`_events`)."""
  client = _ClientGone()
  return _event_stream_class()(_events(server, sub, render, first=first, last=last,
                                       client=client), client)


async def _events(server: Server, sub: _Submitted, render, *, first: str, last,
                  client: _ClientGone) -> AsyncIterator[str]:
  """A streamed response's server-sent events: `first`, then `render(chunk)` of every
  chunk (the chunks that arrived together in one write), then `last()` and
  `data: [DONE]`. Aborts what still runs when the client goes away (the response is
  closed mid-stream, or `client.gone`) or the engine fails."""
  try:
    if first:
      yield first
    while sub.live and not client.gone:
      items = await sub.batch()
      failed = next((i for i in items if isinstance(i, RequestFailed)), None)
      if failed is not None:
        server.num_server_errors += 1
        yield _sse(api.error_body(f"{type(failed.error).__name__}: {failed.error}",
                                  kind="server_error"))
        return
      yield "".join(render(item) for item in items)
    if not client.gone:
      yield last() + "data: [DONE]\n\n"
  finally:
    sub.abort()


# Characters `str.splitlines` ends a line at that JSON leaves raw (it escapes the
# others, all below U+0020): a client reading the stream by lines (httpx's
# `aiter_lines`) would cut an event at a generated NEL, LS or PS.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: Any) -> str:
  """One server-sent event of `data` as JSON, on one line for any line splitter."""
  text = json.dumps(data, ensure_ascii=False, separators=(',', ':'))
  if "\x85" in text or "\u2028" in text or "\u2029" in text:  # rare; translate costs ~5 us
    text = text.translate(_LINE_BREAKS)
  return f"data: {text}\n\n"


async def _completions(server: Server, request: Any, body: Any) -> Any:
  from fastapi import responses  # pylint: disable=import-outside-toplevel
  parsed = api.parse_completion(body, served=server.model_name, max_logprobs=server.max_logprobs)
  planned = []
  for prompt in parsed.prompts:
    ids = server.prompt_ids(prompt)
    planned.append((ids, server.max_tokens(len(ids), parsed.max_tokens)))
  rid = f"cmpl-{uuid.uuid4().hex}"
  created, model = int(time.time()), server.model_name
  sub = _Submitted(server, rid, len(planned), stream=parsed.stream, n=parsed.sampling.n)
  sub.submit(planned, parsed.sampling)
  num_prompt = sum(len(ids) for ids, _ in planned)
  tok = server.served.tokenizer
  top = parsed.logprobs

  def lp(chunk_logprobs, offset):
    return api.completion_logprobs(tok, chunk_logprobs, offset) if top is not None else None

  def body_of(choices, usage=None):
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": choices}
    if usage is not None:
      out["usage"] = usage
    return out

  if not parsed.stream:
    if not await sub.wait(request):
      return responses.Response(status_code=499)  # nobody reads it
    choices, generated = [], 0
    for i, chunks in enumerate(sub.chunks):
      text = "".join(c.text or "" for c in chunks)
      logprobs = [x for c in chunks for x in (c.logprobs or ())]
      generated += chunks[-1].num_tokens
      choices.append(api.completion_choice(i, text, chunks[-1].finish_reason,
                                           lp(logprobs, 0)))
      if parsed.sampling.prompt_logprobs is not None:  # vLLM's extra field
        choices[-1]["prompt_logprobs"] = api.prompt_logprobs_json(
            tok, chunks[-1].prompt_logprobs)
    return body_of(choices, api.usage(num_prompt, generated))

  offsets = [0] * len(sub.chunks)
  generated = [0]

  def render(item: CompletionChunk) -> str:
    text, choice = item.text or "", sub.choice(item)
    out = _sse(body_of([api.completion_choice(choice, text, item.finish_reason,
                                              lp(item.logprobs, offsets[choice]))]))
    offsets[choice] += len(text)
    if item.finished:
      generated[0] += item.num_tokens
    return out

  def last() -> str:
    return _sse(body_of([], api.usage(num_prompt, generated[0]))) if parsed.include_usage else ""

  return _event_stream(server, sub, render, first="", last=last)


async def _chat(server: Server, request: Any, body: Any) -> Any:
  from fastapi import responses  # pylint: disable=import-outside-toplevel
  parsed, messages = api.parse_chat(body, served=server.model_name,
                                    max_logprobs=server.max_logprobs)
  ids = server.chat_ids(messages)
  server.prompt_ids(ids)  # the vocabulary check
  planned = [(ids, server.max_tokens(len(ids), parsed.max_tokens))]
  rid = f"chatcmpl-{uuid.uuid4().hex}"
  created, model = int(time.time()), server.model_name
  sub = _Submitted(server, rid, 1, stream=parsed.stream, n=parsed.sampling.n)
  sub.submit(planned, parsed.sampling)
  tok = server.served.tokenizer
  top = parsed.logprobs

  def lp(chunk_logprobs):
    return api.chat_logprobs(tok, chunk_logprobs, top) if top is not None else None

  if not parsed.stream:
    if not await sub.wait(request):
      return responses.Response(status_code=499)  # nobody reads it
    choices = []
    for i, chunks in enumerate(sub.chunks):
      text = "".join(c.text or "" for c in chunks)
      logprobs = [x for c in chunks for x in (c.logprobs or ())]
      choices.append({"index": i, "message": {"role": "assistant", "content": text},
                      "logprobs": lp(logprobs), "finish_reason": chunks[-1].finish_reason})
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
           "choices": choices,
           "usage": api.usage(len(ids), sum(c[-1].num_tokens for c in sub.chunks))}
    if parsed.sampling.prompt_logprobs is not None:  # vLLM's extra field
      out["prompt_logprobs"] = api.prompt_logprobs_json(tok, sub.chunks[0][-1].prompt_logprobs)
    return out

  def chunk_body(delta: dict, finish_reason: str | None, logprobs: Any, usage=None,
                 index: int = 0) -> dict:
    choices = [] if usage is not None else [
        {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": choices}
    if usage is not None:
      out["usage"] = usage
    return out

  generated = [0]

  def render(item: CompletionChunk) -> str:
    if item.finished:
      generated[0] += item.num_tokens
    delta = {"content": item.text} if item.text else {}
    return _sse(chunk_body(delta, item.finish_reason, lp(item.logprobs), index=sub.choice(item)))

  def last() -> str:
    return (_sse(chunk_body({}, None, None, api.usage(len(ids), generated[0])))
            if parsed.include_usage else "")

  first = "".join(_sse(chunk_body({"role": "assistant", "content": ""}, None, None, index=i))
                  for i in range(len(sub.chunks)))
  return _event_stream(server, sub, render, first=first, last=last)


def _uvicorn():
  return optional_import.require("uvicorn", needed_for="the HTTP server", extra="server")


def serve(server: Server, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
  """Serves `server` with uvicorn until interrupted (Ctrl-C, SIGTERM)."""
  uvicorn = _uvicorn()
  uvicorn.Server(uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=5)).run()


class BackgroundServer:
  """`server` on uvicorn in a thread of this process, on a free port of `host`
  (for tests and benchmarks).

  Example:
    with BackgroundServer(Server(llm)) as bg:
      client = openai.OpenAI(base_url=bg.url + "/v1", api_key="none")
  """

  def __init__(self, server: Server, *, host: str = "127.0.0.1", log_level: str = "warning"):
    uvicorn = _uvicorn()
    self.server = server
    self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._socket.bind((host, 0))
    self.host, self.port = self._socket.getsockname()[:2]
    self._uvicorn = uvicorn.Server(uvicorn.Config(build_app(server), log_level=log_level,
                                                  timeout_graceful_shutdown=5))
    self._thread = threading.Thread(target=self._uvicorn.run,
                                    kwargs=dict(sockets=[self._socket]),
                                    name="paged_kv-http", daemon=True)

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 60.0) -> "BackgroundServer":
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self._uvicorn.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.02)
    return self

  def stop(self, timeout: float = 30.0) -> None:
    self._uvicorn.should_exit = True
    self._thread.join(timeout)
    self._socket.close()

  def __enter__(self) -> "BackgroundServer":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()
