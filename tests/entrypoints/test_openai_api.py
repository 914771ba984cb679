"""The server's pieces without a model: request checks and the sampling mapping
(`openai_api`), chat templates rendered as transformers renders them, and the
engine's queue bound, failures and shutdown on its own thread (`EngineThread`), as
a task of an event loop (`EngineTask`) and in a process of its own (`EngineProcess`),
over a fake engine."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading

import pytest

pytest.importorskip("jinja2", reason="the server extra (pip install 'paged-kv[server]')")

# pylint: disable=wrong-import-position
from paged_kv.entrypoints import openai_api as api
from paged_kv.entrypoints.engine_process import EngineProcess, EngineStartError
from paged_kv.entrypoints.engine_task import EngineTask
from paged_kv.entrypoints.engine_thread import EngineStopped, EngineThread, QueueFull, RequestFailed
from paged_kv.entrypoints.llm import CompletionChunk
from paged_kv.scheduler.sampling_params import SamplingParams


def _completion(**fields):
  return api.parse_completion(dict(dict(model="m", prompt="hi"), **fields), served="m",
                              max_logprobs=5)


def test_sampling_fields_map_onto_sampling_params():
  parsed = _completion(temperature=0.5, top_p=0.9, top_k=7, seed=3, logprobs=2, max_tokens=9,
                       stop_token_ids=[4, 5], min_p=0.1)
  assert parsed.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=7, seed=3,
                                           logprobs=2, stop_token_ids=(4, 5), min_p=0.1)
  assert (parsed.max_tokens, parsed.logprobs, parsed.stream) == (9, 2, False)
  default = _completion()
  assert default.sampling.temperature == 1.0 and default.max_tokens == 16  # OpenAI's defaults
  assert _completion(top_k=-1).sampling.top_k == 0  # vLLM's "all"
  # Unset values of the fields SamplingParams lacks are accepted.
  _completion(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0, stop=[],
              logit_bias={}, ignore_eos=False, min_tokens=0, n=1, best_of=1, user="u")


@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2),
    ("min_tokens", 3), ("logit_bias", {"5": 10}), ("ignore_eos", True),
    ("prompt_logprobs", 1), ("stop", "\n")])
def test_vllm_sampling_fields_pass_to_sampling_params_by_name(name, value):
  assert name in {f.name for f in dataclasses.fields(SamplingParams)}
  got = getattr(_completion(**{name: value}).sampling, name)
  assert got == {"logit_bias": {5: 10.0}, "stop": ("\n",)}.get(name, value), (name, got)


@pytest.mark.parametrize("fields, message", [
    (dict(prompt=""), None),
    (dict(prompt=[]), "prompt must be"),
    (dict(prompt=[1, True]), "prompt must be"),
    (dict(prompt=["a", 1]), "prompt must be"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(temperature=float("nan")), "temperature must be a number"),
    (dict(top_p=0), "top_p must be above 0"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids must be a list"),
    (dict(stream="yes"), "stream must be a boolean"),
    (dict(stream_options={"include_usage": True}), "only allowed with stream=true"),
    (dict(stream=True, stream_options={"x": 1}), "takes only include_usage"),
    (dict(best_of=3), "best_of=3 is not supported"),
    (dict(suffix="x"), "suffix is not supported"),
    (dict(logprobs=6), r"logprobs must be an integer \[0, 5\]"),
])
def test_completion_requests_are_checked(fields, message):
  if message is None:
    assert _completion(**fields).prompts == ("",)
    return
  with pytest.raises(api.BadRequest, match=message):
    _completion(**fields)


def test_logprobs_beyond_the_scheduler_width_are_refused():
  with pytest.raises(api.BadRequest, match="at most 2 logprobs"):
    api.parse_completion(dict(prompt="x", logprobs=3), served="m", max_logprobs=2)


def test_chat_requests_are_checked():
  parse = lambda **f: api.parse_chat(dict(dict(messages=[{"role": "user", "content": "x"}]),
                                          **f), served="m", max_logprobs=20)
  parsed, messages = parse(max_completion_tokens=5, logprobs=True, top_logprobs=3,
                           temperature=0)
  assert (parsed.max_tokens, parsed.logprobs, parsed.sampling.logprobs) == (5, 3, 3)
  parsed, _ = parse(logprobs=True)
  assert (parsed.logprobs, parsed.sampling.logprobs) == (0, 1)  # the sampled token's own
  assert parse()[0].max_tokens is None  # the rest of the context
  parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
  assert parse(messages=[{"role": "user", "content": parts}])[1][0]["content"] == "a\nb"
  for fields, message in [
      (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text"),
      (dict(messages=[{"content": "x"}]), "string role"),
      (dict(tools=[{"type": "function"}]), "tools is not supported"),
      (dict(response_format={"type": "json_object"}), "response_format"),
      (dict(top_logprobs=21, logprobs=True), r"top_logprobs must be an integer \[0, 20\]")]:
    with pytest.raises(api.BadRequest, match=message):
      parse(**fields)
  with pytest.raises(api.BadRequest, match="'other' does not exist") as err:
    parse(model="other")
  assert err.value.status == 404


def test_chat_template_renders_as_transformers_does(tmp_path):
  # Whitespace control, loop controls, tojson, raise_exception and the special tokens.
  source = ("{{ bos_token }}{% for m in messages %}\n"
            "  {% if loop.index0 > 2 %}{% break %}{% endif %}\n"
            "  {% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
            "{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(
      api.json.dumps({"chat_template": [{"name": "default", "template": source}],
                      "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
  template = api.ChatTemplate.from_dir(tmp_path)
  messages = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"},
              {"role": "user", "content": "c"}, {"role": "user", "content": "dropped"}]
  assert template.render(messages) == ('<s>user: "é"\nassistant: "b"\nuser: "c"\n'
                                       'assistant:')
  with pytest.raises(api.BadRequest, match="no bad roles"):
    template.render([{"role": "bad", "content": ""}])
  # The sandbox refuses what a template must not do.
  unsafe = api.ChatTemplate("{{ messages.__class__.__mro__ }}")
  with pytest.raises(api.BadRequest, match="chat template refused"):
    unsafe.render([])
  # chat_template.jinja wins over tokenizer_config.json; none at all gives None.
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
  assert api.ChatTemplate.from_dir(tmp_path).render([{"role": "u", "content": "z"}]) == "z"
  assert api.ChatTemplate.from_dir(tmp_path / "nothing-here") is None


class FakeEngine:
  """An `Engine`'s surface: each request emits one token per step, then finishes."""

  def __init__(self, fail_at_step: int | None = None, gate=None):
    self.live: dict = {}
    self.steps = 0
    self.fail_at_step = fail_at_step
    self.gate = gate if gate is not None else threading.Event()
    self.gate.set()

  @property
  def has_work(self):
    return bool(self.live)

  def add(self, prompt, sampling, *, max_tokens, request_id, index, detokenize=True,
          final_only=False):
    del prompt, sampling, detokenize
    if max_tokens > 100:
      raise api.InvalidArgument("too many")
    self.live[request_id] = [index, max_tokens, 0, final_only]

  def abort(self, rid):
    if rid not in self.live:
      return None
    index, _, n, final_only = self.live.pop(rid)
    return CompletionChunk(rid, index, "t" * n if final_only else "", (7,) * n if final_only
                           else (), None, True, "abort", n)

  def step(self):
    self.gate.wait()
    self.steps += 1
    if self.fail_at_step == self.steps:
      raise RuntimeError("device lost")
    out = []
    for rid, state in list(self.live.items()):
      state[2] += 1
      done = state[2] == state[1]
      if done:
        del self.live[rid]
      if state[3] and done:  # final_only: one chunk with everything
        out.append(CompletionChunk(rid, state[0], "t" * state[2], (7,) * state[2], None, True,
                                   "length", state[2]))
      elif not state[3]:
        out.append(CompletionChunk(rid, state[0], "t", (7,), None, done,
                                   "length" if done else None, state[2]))
    return out


def _collector():
  items, done = [], threading.Event()

  def sink(item):
    items.append(item)
    if isinstance(item, RequestFailed) or item.finished:
      done.set()
  return items, done, sink


def test_engine_thread_serves_bounds_and_aborts():
  engine = FakeEngine()
  thread = EngineThread(engine, max_queued=2, idle_wait_s=0.01).start()
  try:
    engine.gate.clear()  # hold the steps: requests stay outstanding
    a, a_done, a_sink = _collector()
    b, b_done, b_sink = _collector()
    thread.submit("a", [1], None, 3, a_sink)
    thread.submit("b", [1], None, 50, b_sink)
    with pytest.raises(QueueFull, match="the limit is 2"):
      thread.submit("c", [1], None, 3, a_sink)
    thread.abort("b")
    engine.gate.set()
    assert a_done.wait(10) and b_done.wait(10)
    assert [c.token_ids for c in a] == [(7,), (7,), (7,)] and a[-1].finish_reason == "length"
    assert b[-1].finish_reason == "abort"
    assert thread.outstanding == 0
    # A request the engine refuses comes back as a RequestFailed; the slot is freed.
    c, c_done, c_sink = _collector()
    thread.submit("c", [1], None, 1000, c_sink)
    assert c_done.wait(10) and isinstance(c[0], RequestFailed)
    assert "too many" in str(c[0].error) and thread.outstanding == 0
    assert thread.call(lambda e: e.steps) >= 3
    # final_only: one chunk, when the request finishes.
    f, f_done, f_sink = _collector()
    thread.submit("f", [1], None, 3, f_sink, final_only=True)
    assert f_done.wait(10) and [c.token_ids for c in f] == [(7, 7, 7)]
  finally:
    thread.stop()
  assert not thread.running
  with pytest.raises(EngineStopped, match="not running"):
    thread.submit("d", [1], None, 1, lambda item: None)


def test_an_engine_failure_ends_every_request_and_stops_the_thread():
  engine = FakeEngine(fail_at_step=2)
  thread = EngineThread(engine, idle_wait_s=0.01)
  items, done, sink = _collector()
  engine.gate.clear()
  thread.start()
  thread.submit("a", [1], None, 5, sink)
  engine.gate.set()
  assert done.wait(10)
  thread.stop()
  assert isinstance(thread.error, RuntimeError)
  assert isinstance(items[-1], RequestFailed) and "device lost" in str(items[-1].error)
  assert thread.outstanding == 0
  with pytest.raises(EngineStopped, match="device lost"):
    thread.submit("b", [1], None, 1, sink)


@pytest.mark.slow
def test_python_m_paged_kv_serve(tmp_path):
  """The command line: a missing directory is a user error (exit 2); a checkpoint is
  served until the process is stopped."""
  import os  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import socket  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  from paged_kv import serve  # pylint: disable=import-outside-toplevel
  for module in ("fastapi", "uvicorn", "flax", "safetensors", "tokenizers", "httpx"):
    pytest.importorskip(module, reason="the server, hf and test extras")
  import httpx  # pylint: disable=import-outside-toplevel
  from tests.entrypoints.llm_files import write_chat_checkpoint  # pylint: disable=import-outside-toplevel
  assert serve.main(["--checkpoint", str(tmp_path / "missing")]) == 2
  ckpt = write_chat_checkpoint(tmp_path / "tiny-chat")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  proc = subprocess.Popen(
      [sys.executable, "-m", "paged_kv.serve", "--checkpoint", str(ckpt), "--port", str(port),
       "--max-batch", "2", "--num-blocks", "64", "--block-size", "8", "--no-warmup",
       "--log-level", "warning"], cwd=root, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  try:
    deadline, url = time.monotonic() + 120, f"http://127.0.0.1:{port}"
    while True:
      assert proc.poll() is None, proc.stdout.read()
      try:
        if httpx.get(url + "/health").status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, "the server did not come up"
      time.sleep(0.2)
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json=dict(model="tiny-chat", prompt="the quick", max_tokens=3, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
  finally:
    proc.terminate()
    out = proc.communicate(timeout=60)[0]
  assert "serving tiny-chat (64 blocks of 8 tokens: num_blocks given)" in out, out


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029", "\n", "\r", "\x0b", "\x1c"])
def test_a_streamed_event_is_one_line_for_any_line_splitter(char):
  """Generated text may hold any character: an event stays one line for a client that
  splits lines as `str.splitlines` does (httpx's `aiter_lines`) and decodes to the text."""
  import json  # pylint: disable=import-outside-toplevel
  from paged_kv.entrypoints import api_server as server  # pylint: disable=import-outside-toplevel
  data = {"choices": [{"text": f"a{char}b é"}]}
  event = server._sse(data)  # pylint: disable=protected-access
  assert event.endswith("\n\n")
  lines = event[:-2].splitlines()
  assert len(lines) == 1 and lines[0].startswith("data: ")
  assert json.loads(lines[0][len("data: "):]) == data


class _LoopInThread:
  """An asyncio loop running in a thread of its own (the server's loop, for a test)."""

  def __init__(self):
    import asyncio  # pylint: disable=import-outside-toplevel
    self.asyncio = asyncio
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
    self.thread.start()

  def run(self, coro_fn, timeout=10):
    return self.asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

  def close(self):
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)
    self.loop.close()


def _started_task(engine, loop: _LoopInThread, **kwargs) -> EngineTask:
  task = EngineTask(engine, **kwargs)

  async def start():
    return task.start()
  return loop.run(start)


def test_engine_task_serves_bounds_and_aborts_like_the_thread():
  engine, loop = FakeEngine(), _LoopInThread()
  try:
    task = _started_task(engine, loop, max_queued=2)
    engine.gate.clear()  # hold the steps (and the loop): requests stay outstanding
    a, a_done, a_sink = _collector()
    b, b_done, b_sink = _collector()
    task.submit("a", [1], None, 3, a_sink)
    task.submit("b", [1], None, 50, b_sink)
    with pytest.raises(QueueFull, match="the limit is 2"):
      task.submit("c", [1], None, 3, a_sink)
    task.abort("b")
    engine.gate.set()
    assert a_done.wait(10) and b_done.wait(10)
    assert [c.token_ids for c in a] == [(7,), (7,), (7,)] and a[-1].finish_reason == "length"
    assert b[-1].finish_reason == "abort" and task.outstanding == 0
    c, c_done, c_sink = _collector()
    task.submit("c", [1], None, 1000, c_sink)
    assert c_done.wait(10) and isinstance(c[0], RequestFailed)
    assert "too many" in str(c[0].error) and task.outstanding == 0
    assert task.call(lambda e: e.steps) >= 3  # from another thread: between two steps

    async def on_loop():  # on the loop's own thread: at once, no deadlock
      return task.call(lambda e: e.steps)
    assert loop.run(on_loop) >= 3
    # Every sink ran on the loop's thread (no cross-thread hand-off).
    seen = []
    d_done = threading.Event()
    task.submit("d", [1], None, 1, lambda item: (seen.append(threading.get_ident()),
                                                  d_done.set()))
    assert d_done.wait(10) and seen == [loop.thread.ident]
  finally:
    task.stop()
    loop.close()
  assert not task.running
  with pytest.raises(EngineStopped, match="not running"):
    task.submit("e", [1], None, 1, lambda item: None)


def test_an_engine_failure_ends_every_request_and_stops_the_task():
  engine, loop = FakeEngine(fail_at_step=2), _LoopInThread()
  try:
    engine.gate.clear()
    task = _started_task(engine, loop)
    items, done, sink = _collector()
    task.submit("a", [1], None, 5, sink)
    engine.gate.set()
    assert done.wait(10)
    task.stop()
    assert isinstance(task.error, RuntimeError) and not task.running
    assert isinstance(items[-1], RequestFailed) and "device lost" in str(items[-1].error)
    assert task.outstanding == 0
    with pytest.raises(EngineStopped, match="device lost"):
      task.submit("b", [1], None, 1, sink)
  finally:
    loop.close()


# ---------------------------------------------------- the engine in its own process
def _spawn_event():
  import multiprocessing  # pylint: disable=import-outside-toplevel
  return multiprocessing.get_context("spawn").Event()


def _started_process(make, loop: _LoopInThread, **kwargs) -> EngineProcess:
  proc = EngineProcess(make, **kwargs)

  async def start():
    return proc.start()
  return loop.run(start)


def _steps(engine) -> int:
  return engine.steps


def _refuse():
  raise api.InvalidArgument("no such checkpoint")


def _crash():
  raise RuntimeError("out of memory")


# The engine process over a fake engine (a spawn each, ~2 s of imports); `make test` keeps the real
# server over an engine process.
@pytest.mark.long
def test_engine_process_serves_bounds_and_aborts_like_the_thread():
  """The fake engine built in the engine process (its gate a process-shared event):
  the queue bound, an abort, a refused request, `call` and `acall`, sinks on the loop,
  a clean stop that reaps the process."""
  gate, loop = _spawn_event(), _LoopInThread()
  proc = None
  try:
    proc = _started_process(functools.partial(FakeEngine, gate=gate), loop, max_queued=2)
    assert proc.served is None and proc.running
    gate.clear()  # hold the steps: requests stay outstanding
    a, a_done, a_sink = _collector()
    b, b_done, b_sink = _collector()
    proc.submit("a", [1], None, 3, a_sink)
    proc.submit("b", [1], None, 50, b_sink)
    with pytest.raises(QueueFull, match="the limit is 2"):
      proc.submit("c", [1], None, 3, a_sink)
    proc.abort("b")
    gate.set()
    assert a_done.wait(10) and b_done.wait(10)
    assert [c.token_ids for c in a] == [(7,), (7,), (7,)] and a[-1].finish_reason == "length"
    assert [c.text for c in a] == ["t", "t", "t"]  # no tokenizer here: the engine's text
    assert b[-1].finish_reason == "abort" and proc.outstanding == 0
    c, c_done, c_sink = _collector()
    proc.submit("c", [1], None, 1000, c_sink)
    assert c_done.wait(10) and isinstance(c[0], RequestFailed)
    assert isinstance(c[0].error, api.InvalidArgument) and "too many" in str(c[0].error)
    assert proc.outstanding == 0
    assert proc.call(_steps) >= 3
    with pytest.raises(api.InvalidArgument, match="picklable fn"):
      proc.call(lambda e: e.steps)  # refused here, nothing sent

    async def on_loop():
      with pytest.raises(api.InvalidArgument, match="await acall"):
        proc.call(_steps)
      return await proc.acall(_steps)
    assert loop.run(on_loop) >= 3
    seen, d_done = [], threading.Event()
    proc.submit("d", [1], None, 1, lambda item: (seen.append(threading.get_ident()),
                                                  d_done.set()))
    assert d_done.wait(10) and seen == [loop.thread.ident]
    # A live request at stop ends as aborted; the process exits and is reaped.
    gate.clear()
    e, e_done, e_sink = _collector()
    proc.submit("e", [1], None, 50, e_sink)
    stop_sent, send = threading.Event(), proc._send  # pylint: disable=protected-access

    def send_and_note(message):
      send(message)
      if message[0] == "stop":
        stop_sent.set()
    proc._send = send_and_note  # pylint: disable=protected-access
    stopper = threading.Thread(target=proc.stop)
    stopper.start()
    assert stop_sent.wait(10)  # the steps resume once the stop is on its way, not before
    gate.set()
    stopper.join(30)
    assert e_done.wait(10) and e[-1].finish_reason == "abort"
  finally:
    if proc is not None:
      proc.stop()
    loop.close()
  assert not proc.running and proc.outstanding == 0
  assert proc._process.exitcode == 0  # pylint: disable=protected-access
  with pytest.raises(EngineStopped, match="not running"):
    proc.submit("f", [1], None, 1, lambda item: None)


@pytest.mark.long
def test_an_engine_failure_ends_every_request_and_stops_the_process():
  """A step that raises, then an engine process killed: each ends every live request
  with a RequestFailed and the engine says why."""
  loop = _LoopInThread()
  try:
    proc = _started_process(functools.partial(FakeEngine, fail_at_step=2), loop)
    items, done, sink = _collector()
    proc.submit("a", [1], None, 5, sink)
    assert done.wait(10)
    assert isinstance(items[-1], RequestFailed) and "device lost" in str(items[-1].error)
    assert isinstance(proc.error, RuntimeError) and not proc.running
    assert proc.outstanding == 0
    with pytest.raises(EngineStopped, match="device lost"):
      proc.submit("b", [1], None, 1, sink)
    proc.stop()
    assert proc._process.exitcode == 0  # pylint: disable=protected-access
    # The process itself gone (killed, as by the OOM killer) while a request runs.
    gate = _spawn_event()
    proc = _started_process(functools.partial(FakeEngine, gate=gate), loop)
    gate.clear()  # its steps wait: the request stays live
    items, done, sink = _collector()
    proc.submit("a", [1], None, 50, sink)
    os.kill(proc.pid, signal.SIGKILL)
    assert done.wait(10) and isinstance(items[-1], RequestFailed)
    assert "exit code -9" in str(items[-1].error) and not proc.running
    with pytest.raises(EngineStopped, match="exit code -9"):
      proc.call(_steps)
    proc.stop()
  finally:
    loop.close()


@pytest.mark.long
def test_engine_process_start_failures_leave_no_process():
  """`make` refusing (InvalidArgument, raised as is) or failing (EngineStartError with
  the traceback); a callable is required (an `LLM` object is not sent); an engine
  never started stops at once."""
  import multiprocessing  # pylint: disable=import-outside-toplevel
  before = set(multiprocessing.active_children())
  with pytest.raises(api.InvalidArgument, match="no such checkpoint"):
    EngineProcess(_refuse)
  with pytest.raises(EngineStartError, match="out of memory"):
    EngineProcess(_crash)
  with pytest.raises(api.InvalidArgument, match="picklable callable"):
    EngineProcess("not callable")
  # Built, never started (no event loop read it): stop ends the process at once.
  proc = EngineProcess(FakeEngine)
  proc.stop(timeout=20)
  assert proc._process.exitcode == 0 and not proc.running  # pylint: disable=protected-access
  assert set(multiprocessing.active_children()) == before
