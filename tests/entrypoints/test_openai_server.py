"""The OpenAI-compatible server on 127.0.0.1, driven by the real `openai` client:
completion, chat (the checkpoint's template), streaming, a client that disconnects
mid-stream (its request aborted, its blocks back in the pool), 64 concurrent
streaming clients with nothing lost, 400 / 404 / 429 / 503; the same with the
scheduler on the event loop (`engine="loop"`) and in a process of its own
(`engine="process"`). One server per engine kind for the module (a tiny random
checkpoint, no end-of-sequence token, so every request runs to `max_tokens`).
What runs on the engine (`Server.engine.call`) is a module-level function: it is
pickled into the engine process."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import socket
import threading
import time
from unittest import mock

import pytest

pytest.importorskip("flax", reason="the model extra (pip install 'paged-kv[model]')")
pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")
pytest.importorskip("safetensors", reason="the hf extra (pip install 'paged-kv[hf]')")
pytest.importorskip("fastapi", reason="the server extra (pip install 'paged-kv[server]')")
pytest.importorskip("uvicorn", reason="the server extra (pip install 'paged-kv[server]')")
pytest.importorskip("jinja2", reason="the server extra (pip install 'paged-kv[server]')")
openai = pytest.importorskip("openai", reason="the test extra (pip install 'paged-kv[test]')")
httpx = pytest.importorskip("httpx", reason="the test extra (pip install 'paged-kv[test]')")

# pylint: disable=wrong-import-position
from paged_kv.entrypoints import openai_api
from paged_kv.entrypoints.engine_process import served_llm
from paged_kv.entrypoints.engine_thread import EngineStopped
from paged_kv.entrypoints.llm import LLM
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.entrypoints.api_server import BackgroundServer, Server, build_app
from tests.entrypoints.llm_files import MAX_POSITIONS, write_chat_checkpoint


pytestmark = pytest.mark.slow


MODEL = "tiny-chat"
PROMPTS = ["the quick brown fox", "paged attention keeps", "a tiny tokenizer", "héllo",
           "jumps over the lazy dog", "kv cache in blocks", "trained in memory", "round trip"]


def _serve(tmp_path_factory, engine: str, max_batch: int = 16):
  ckpt = write_chat_checkpoint(tmp_path_factory.mktemp("server") / MODEL)
  llm = functools.partial(LLM, str(ckpt), max_batch=max_batch, num_blocks=512, block_size=8,
                          eos_token_ids=(), prompt_logprobs=True)
  server = Server(llm, max_queued=128, template=openai_api.ChatTemplate.from_dir(ckpt),
                  engine=engine)
  with BackgroundServer(server) as bg:
    client = openai.OpenAI(base_url=bg.url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)  # warm-up
    yield server, bg, client


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  yield from _serve(tmp_path_factory, "thread")


@pytest.fixture(scope="module")
def served_on_loop(tmp_path_factory):
  """A second server whose scheduler is a task of the event loop (`engine="loop"`)."""
  yield from _serve(tmp_path_factory, "loop")


@pytest.fixture(scope="module")
def served_in_process(tmp_path_factory):
  """A third server whose engine runs in a process of its own (`engine="process"`);
  4 rows a step, so it compiles fewer step shapes (its compiles are its own)."""
  yield from _serve(tmp_path_factory, "process", max_batch=4)


# ------------------------------------------------------ run on the engine (`call`)
def _pool_state(engine):
  engine.scheduler.cached_pool.check_invariants()
  return engine.num_live, engine.scheduler.idle, engine.scheduler.take_stats().used_blocks


def _aborted(engine) -> int:
  return engine.scheduler.stats.aborted


def _used_blocks(engine) -> int:
  return engine.scheduler.take_stats().used_blocks


def _generate(prompt, max_tokens, _engine):
  return served_llm().generate(prompt, max_tokens=max_tokens)[0]


def _sleep(seconds, _engine):
  time.sleep(seconds)


def _exit_now(_engine):
  os._exit(3)  # pylint: disable=protected-access


def _idle(server: Server) -> None:
  """Nothing outstanding, no block held by a sequence, the pool and cache consistent."""
  deadline = time.monotonic() + 30
  while server.engine.outstanding and time.monotonic() < deadline:
    time.sleep(0.02)
  assert server.engine.outstanding == 0
  assert server.engine.call(_pool_state) == (0, True, 0)


def _on_engine(server, prompt, max_tokens):
  """Greedy `generate` through the facade, run on the engine's thread or in its process
  (while the server serves nothing else: its steps would take other requests' chunks)."""
  if server.llm is None:
    return server.engine.call(functools.partial(_generate, prompt, max_tokens))
  return server.engine.call(lambda _: server.llm.generate(prompt, max_tokens=max_tokens)[0])


def test_models_health_and_metrics(served):
  server, bg, client = served
  assert [m.id for m in client.models.list().data] == [MODEL]
  health = httpx.get(bg.url + "/health")
  assert health.status_code == 200 and health.json()["status"] == "ok"
  metrics = httpx.get(bg.url + "/metrics")
  assert metrics.status_code == 200
  assert "paged_kv_time_to_first_token_seconds_bucket" in metrics.text
  assert 'model="tiny-chat"' in metrics.text


def test_completion_equals_the_facade(served):
  server, _, client = served
  want = _on_engine(server, PROMPTS[0], 8)
  r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                logprobs=2)
  choice = r.choices[0]
  assert choice.text == want.text and choice.finish_reason == "length"
  assert r.usage.prompt_tokens == len(want.prompt_token_ids)
  assert r.usage.completion_tokens == 8
  assert len(choice.logprobs.token_logprobs) == 8
  assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
  # Token-id prompts, several in one request: one choice each, in order.
  ids = list(want.prompt_token_ids)
  r = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=8, temperature=0)
  assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == want.text
  assert r.usage.prompt_tokens == len(ids) + 4
  _idle(server)


def test_chat_renders_the_template(served):
  server, _, client = served
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi  "}]
  text = ("<s><|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n")
  assert server.template.render(messages) == text
  ids = server.served.tokenizer.encode(text, add_special_tokens=False)
  want = _on_engine(server, ids, 6)
  r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=2)
  choice = r.choices[0]
  assert choice.message.role == "assistant" and choice.message.content == want.text
  assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6
  assert len(choice.logprobs.content) == 6
  assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
  with pytest.raises(openai.BadRequestError, match="unknown role tool"):
    client.chat.completions.create(model=MODEL, max_tokens=2,
                                   messages=[{"role": "tool", "content": "x"}])
  _idle(server)


def test_streams_add_up_to_the_whole_response(served):
  server, _, client = served
  with mock.patch.object(server.engine, "submit", wraps=server.engine.submit) as submit:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                      temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
  # A whole response takes its request's one last chunk; a stream takes every step's.
  assert [c.kwargs["final_only"] for c in submit.call_args_list] == [True, False]
  assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
  assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
  assert parts[-1].usage.completion_tokens == 12
  chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=10,
              temperature=0)
  whole = client.chat.completions.create(**chat)
  parts = list(client.chat.completions.create(**chat, stream=True))
  assert parts[0].choices[0].delta.role == "assistant"
  assert "".join(p.choices[0].delta.content or "" for p in parts) == \
      whole.choices[0].message.content
  assert parts[-1].choices[0].finish_reason == "length"
  _idle(server)


def test_n_choices_per_prompt_streamed_or_not(served):
  server, _, client = served
  want = [_on_engine(server, p, 6).text for p in PROMPTS[:2]]
  r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0,
                                n=2)
  assert [(c.index, c.text) for c in r.choices] == [(0, want[0]), (1, want[0]),
                                                    (2, want[1]), (3, want[1])]
  assert r.usage.completion_tokens == 4 * 6
  texts = ["", "", "", ""]
  for part in client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6,
                                        temperature=0, n=2, stream=True):
    texts[part.choices[0].index] += part.choices[0].text
  assert texts == [want[0], want[0], want[1], want[1]]
  # Seeded: choice i draws what one request with seed + i draws.
  hot = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0)
  alone = [client.completions.create(**hot, seed=5 + i).choices[0].text for i in range(3)]
  r = client.completions.create(**hot, seed=5, n=3)
  assert [c.text for c in r.choices] == alone
  chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
              temperature=0)
  one = client.chat.completions.create(**chat).choices[0].message.content
  r = client.chat.completions.create(**chat, n=2)
  assert [(c.index, c.message.content) for c in r.choices] == [(0, one), (1, one)]
  assert r.usage.completion_tokens == 10
  texts = ["", ""]
  for part in client.chat.completions.create(**chat, n=2, stream=True):
    texts[part.choices[0].index] += part.choices[0].delta.content or ""
  assert texts == [one, one]
  _idle(server)


def test_prompt_logprobs_are_vllms_extra_field(served):
  server, _, client = served
  want = server.engine.call(lambda _: server.llm.generate(
      PROMPTS[3], SamplingParams(prompt_logprobs=1), max_tokens=2)[0])
  r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2, temperature=0,
                                n=2, extra_body=dict(prompt_logprobs=1))
  for choice in r.choices:
    got = choice.model_extra["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for entry, lp in zip(got[1:], want.prompt_logprobs[1:]):
      assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob)
      assert entry[str(lp.token_id)]["rank"] == lp.rank
      assert {int(k) for k in entry} == {lp.token_id, lp.top[0][0]}
  chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                "content": "hi"}],
                                        max_tokens=2, extra_body=dict(prompt_logprobs=0))
  assert chat.model_extra["prompt_logprobs"][0] is None
  assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
  with pytest.raises(openai.BadRequestError, match="not available when stream=true"):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                              extra_body=dict(prompt_logprobs=1))
  _idle(server)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served):
  _check_disconnect_mid_stream(served)


def _check_disconnect_mid_stream(served) -> None:
  server, _, client = served
  aborted = server.engine.call(_aborted)
  stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=100,
                                     temperature=0, stream=True)
  got = 0
  for part in stream:
    got += 1
    if got == 3:
      held = server.engine.call(_used_blocks)
      assert held > 0  # the request holds blocks while it streams
      break
  stream.close()
  _idle(server)  # waits until the server has noticed, then checks every block is back
  assert server.engine.call(_aborted) == aborted + 1


def test_a_client_that_gives_up_on_a_whole_response_frees_its_blocks(served):
  server, bg, _ = served
  aborted = server.engine.call(_aborted)
  outcome = []

  def ask():
    try:
      httpx.post(bg.url + "/v1/completions", timeout=0.5,
                 json=dict(model=MODEL, prompt="x", max_tokens=120, temperature=0))
      outcome.append("answered")
    except httpx.TimeoutException:
      outcome.append("gave up")

  client = threading.Thread(target=ask)
  client.start()
  deadline = time.monotonic() + 30
  while server.engine.outstanding == 0 and time.monotonic() < deadline:
    time.sleep(0.005)
  # Hold the engine (between two steps) past the client's timeout: the handler sees
  # the disconnect and aborts; the abort is applied before the next step.
  server.engine.call(functools.partial(_sleep, 1.0))
  client.join()
  assert outcome == ["gave up"]
  _idle(server)
  assert server.engine.call(_aborted) == aborted + 1


def test_a_client_that_leaves_before_its_body_arrives_is_no_server_error(served):
  server, bg, _ = served
  errors, gone = server.num_server_errors, server.num_client_disconnects
  with socket.create_connection((bg.host, bg.port)) as conn:
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    time.sleep(0.2)  # the handler is reading the body
  deadline = time.monotonic() + 30
  while server.num_client_disconnects == gone and time.monotonic() < deadline:
    time.sleep(0.02)
  assert server.num_client_disconnects == gone + 1
  assert server.num_server_errors == errors
  assert server.engine.outstanding == 0


def test_64_concurrent_streaming_clients_lose_nothing(served):
  _check_concurrent_streams(served, 64)


def _check_concurrent_streams(served, num_clients: int) -> None:
  """`num_clients` streaming clients at once: each text equals its non-streamed one,
  every usage counts all tokens, no server error, every block back afterwards."""
  server, bg, client = served
  max_tokens = 8
  want = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                       temperature=0).choices[0].text for p in PROMPTS}
  errors_before = server.num_server_errors

  async def one(aclient, prompt):
    text, finish, usage = [], None, None
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    async for part in stream:
      if part.choices:
        text.append(part.choices[0].text)
        finish = part.choices[0].finish_reason or finish
      if part.usage is not None:
        usage = part.usage
    return prompt, "".join(text), finish, usage

  async def run():
    async with openai.AsyncOpenAI(base_url=bg.url + "/v1", api_key="none", max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(
                                      limits=httpx.Limits(max_connections=64))) as aclient:
      return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)])
                                    for i in range(num_clients)))

  results = asyncio.run(run())
  assert len(results) == num_clients
  for prompt, text, finish, usage in results:
    assert text == want[prompt] and finish == "length"
    assert usage.completion_tokens == max_tokens
  assert server.num_server_errors == errors_before == 0
  _idle(server)


@pytest.mark.parametrize("fields, status, message", [
    (dict(prompt="x", max_tokens=MAX_POSITIONS), 400, "maximum context length is 128"),
    (dict(prompt="x", temperature=3), 400, r"temperature must be a number in \[0, 2\]"),
    (dict(prompt="x", logprobs=9), 400, r"logprobs must be an integer \[0, 5\]"),
    (dict(prompt="x", presence_penalty=2.5), 400, r"presence_penalty must be a number in \[-2.0, 2.0\]"),
    (dict(prompt="x", n=2, best_of=3), 400, "best_of=3 is not supported"),
    (dict(prompt="x", n=0), 400, r"n must be an integer \[1, 128\]"),
    (dict(prompt="x", echo=True), 400, "echo is not supported"),
    (dict(prompt="x", wat=1), 400, "unknown field: wat"),
    (dict(prompt=[[]]), 400, "prompt must be"),
    (dict(prompt=[1, 999]), 400, r"must lie in \[0, 320\)"),
    (dict(prompt="x", model="gpt-4"), 404, "'gpt-4' does not exist"),
])
def test_bad_requests_get_clear_errors(served, fields, status, message):
  server, bg, _ = served
  body = dict(dict(model=MODEL, max_tokens=4), **fields)
  r = httpx.post(bg.url + "/v1/completions", json=body)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert re.search(message, err["message"]), err
  assert server.engine.outstanding == 0


def test_malformed_bodies_and_the_client_errors(served):
  _, bg, client = served
  r = httpx.post(bg.url + "/v1/completions", content=b"{not json",
                 headers={"content-type": "application/json"})
  assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
  r = httpx.post(bg.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
  with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   top_logprobs=2)


def test_a_full_queue_answers_429(served):
  server, _, client = served
  limit = server.engine.max_queued
  server.engine.max_queued = 0
  try:
    with pytest.raises(openai.RateLimitError, match="retry later"):
      client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    server.engine.max_queued = 2
    with pytest.raises(openai.BadRequestError, match="n=3 samples exceed the 2 requests"):
      client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3)
  finally:
    server.engine.max_queued = limit
  assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


def test_a_stopped_engine_answers_503(served):
  server, _, _ = served
  # A second front for the same LLM whose engine thread never started.
  idle = Server(server.llm, metrics=False, template=server.template)
  transport = httpx.ASGITransport(app=build_app(idle))

  async def run():
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
      health = await c.get("/health")
      done = await c.post("/v1/completions", json=dict(model=MODEL, prompt="x", max_tokens=2))
      return health, done

  health, done = asyncio.run(run())
  assert health.status_code == 503 and done.status_code == 503
  assert "not running" in json.loads(done.text)["error"]["message"]


def test_the_engine_on_the_event_loop_serves_the_same(served_on_loop):
  """`Server(engine="loop")`: the same answers as the facade, concurrent streams lose
  nothing, a client gone mid-stream frees its blocks."""
  server, _, client = served_on_loop
  want = _on_engine(server, PROMPTS[1], 8)
  r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
  assert r.choices[0].text == want.text
  _check_concurrent_streams(served_on_loop, 16)
  _check_disconnect_mid_stream(served_on_loop)


def test_the_engine_in_its_own_process_serves_the_same(served_in_process):
  """`Server(engine="process")`: the same answers as the facade (in the engine process),
  logprobs across the pipe, concurrent streams lose nothing, a client gone mid-stream
  frees its blocks, /health and /metrics come from the engine process; once it is
  gone, 503s with the reason."""
  server, bg, client = served_in_process
  assert server.llm is None and server.engine.pid != os.getpid()
  want = _on_engine(server, PROMPTS[1], 8)
  r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                logprobs=2)
  assert r.choices[0].text == want.text and len(r.choices[0].logprobs.tokens) == 8
  # n samples and prompt logprobs cross the pipe: each sample its own chunks and text.
  r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                n=2, extra_body=dict(prompt_logprobs=1))
  assert [c.text for c in r.choices] == [want.text] * 2
  for choice in r.choices:
    got = choice.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
  texts = ["", ""]
  for part in client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                        temperature=0, n=2, stream=True):
    texts[part.choices[0].index] += part.choices[0].text
  assert texts == [want.text] * 2
  assert httpx.get(bg.url + "/health").json()["status"] == "ok"
  assert 'model="tiny-chat"' in httpx.get(bg.url + "/metrics").text
  _check_concurrent_streams(served_in_process, 8)  # twice the rows: some wait their turn
  _check_disconnect_mid_stream(served_in_process)
  # The engine process gone: /health and new requests answer 503 with the reason.
  with pytest.raises(EngineStopped):
    server.engine.call(_exit_now)
  health = httpx.get(bg.url + "/health")
  assert health.status_code == 503 and "exit code 3" in health.json()["error"]["message"]
  with pytest.raises(openai.InternalServerError, match="exit code 3"):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
