"""What does the HTTP server cost over the in-process facade? Paired runs, same requests.

One `paged_kv.LLM` (a random tiny Llama checkpoint with a byte-level BPE tokenizer,
written to a temporary directory, or `--checkpoint DIR`) serves `--batch` prompts of
`--prompt_tokens` token ids, `--max_tokens` greedy tokens each (no end-of-sequence
token, so every request runs to `--max_tokens`), three ways, in turn, `--repeats`
rounds:

  * facade: `LLM.generate(prompts)` on the engine's thread (the server idle);
  * server: the same prompts as `--batch` concurrent `/v1/completions` requests from
    a client process (httpx, one connection per request), the server on 127.0.0.1 in
    this process (`paged_kv.entrypoints.api_server.BackgroundServer`: uvicorn's event loop,
    and the engine on a thread of this process, `--engine=thread`; a task of the
    loop, `loop`; or a process of its own, `process`, where the facade runs too);
  * server, streamed: the same with `stream: true` (server-sent events, a chunk per
    request per step).

Each run's wall: the facade's `generate` call; the client's time from sending the
first request to the last response's end. The prefix cache is off (`--prefix_cache`),
so every run computes the same prompts. Every run's texts are checked against the
facade's before a number is printed. The table gives each path's median wall and the
median of its per-round ratio to the facade's (paired: the same round's runs).

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_server.py                     # batch 16, 64 tokens
  PYTHONPATH=. .venv/bin/python benchmarks/bench_server.py --engine=process --client=sockets
  PYTHONPATH=. .venv/bin/python benchmarks/bench_server.py --batch=16 --max_tokens=128 --repeats=7
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from benchmarks import shared_flags

_BATCH = flags.DEFINE_integer("batch", 16, "Concurrent requests (and the scheduler's max_batch).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 32, "Token ids per prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
_REPEATS = shared_flags.define_repeats(5, "Rounds (each runs the three paths once).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A checkpoint directory (default: a "
                                  "random tiny Llama with a byte-level BPE tokenizer).")
_PREFIX_CACHE = flags.DEFINE_bool("prefix_cache", False, "The scheduler's prefix cache.")
_METRICS = flags.DEFINE_bool("metrics", True, "Attach the Prometheus exporter to the server.")
_SEED = shared_flags.define_seed("Prompt seed.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every program of the serving path first "
                            "(`Scheduler.warmup()`: requests arriving one by one over HTTP "
                            "run step shapes the facade's batch does not).")
_ENGINE = flags.DEFINE_enum("engine", "thread", ["thread", "loop", "process"], "Where the "
                            "server runs the scheduler: its own thread (`EngineThread`), a "
                            "task of the event loop (`EngineTask`) or its own process "
                            "(`EngineProcess`).")
_SWITCH = flags.DEFINE_float("switch_interval_ms", None, "sys.setswitchinterval for this "
                             "process (default: Python's 5 ms).")
_CLIENT_KIND = flags.DEFINE_enum("client", "httpx", ["httpx", "sockets"], "The client process: "
                                 "httpx's AsyncClient (as an application would use), or "
                                 "asyncio sockets with a minimal parser (little client CPU: "
                                 "closer to the server path's own cost on a shared machine).")
_PIN = flags.DEFINE_bool("pin", False, "Linux, --engine=process: the engine process (and the "
                         "facade in it) on CPU 0, this process and the client on the others "
                         "(the engine with a core of its own, as in a deployment).")
_RAW = flags.DEFINE_bool("raw", False, "Also print every round's walls and CPU seconds as "
                         "one JSON line (to pool rounds over several runs).")
_CLIENT = flags.DEFINE_string("client_url", None, "Internal: run as the client process of "
                              "this URL (commands on stdin, results on stdout).")


def _write_tiny(path: Path) -> Path:
  """A random tiny Llama checkpoint plus a byte-level BPE tokenizer.json (specials
  <unk>, <s>, </s>; no eos in the config, so requests run to max_tokens)."""
  from paged_kv.model import random_checkpoint  # pylint: disable=import-outside-toplevel
  hf = random_checkpoint.hf_config("tiny", dtype="float32", eos_token_id=None,
                                   max_position_embeddings=1024)
  random_checkpoint.write_random_checkpoint(path, hf, seed=0)
  random_checkpoint.write_byte_level_tokenizer(path, hf["vocab_size"])
  return path


# ------------------------------------------------------- run on the engine (`call`)
_IN_PROCESS: dict = {}  # the LLM, when the engine is a thread or task of this process


def _facade(prompts: list, max_tokens: int, _engine) -> tuple[float, list[str]]:
  """`LLM.generate` of the prompts: its wall and texts."""
  from paged_kv.entrypoints.engine_process import served_llm  # pylint: disable=import-outside-toplevel
  llm = served_llm() or _IN_PROCESS["llm"]
  t0 = time.perf_counter()
  outs = llm.generate(prompts, max_tokens=max_tokens)
  return time.perf_counter() - t0, [o.text for o in outs]


def _engine_cpu(_engine) -> float:
  """CPU seconds of the engine: its process's (JAX's threads included), or its thread's."""
  from paged_kv.entrypoints.engine_process import served_llm  # pylint: disable=import-outside-toplevel
  return time.process_time() if served_llm() is not None else time.thread_time()


def _steps(engine) -> int:
  return engine.scheduler.stats.steps


def _compiles(engine) -> int:
  return engine.scheduler.runtime.backend_compiles


# ---------------------------------------------------------------------- the client
async def _client_run(url: str, prompts: list, max_tokens: int, stream: bool) -> dict:
  import httpx  # pylint: disable=import-outside-toplevel

  async def one(client, prompt):
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream)
    if not stream:
      r = await client.post("/v1/completions", json=body)
      r.raise_for_status()
      return r.json()["choices"][0]["text"]
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
      r.raise_for_status()
      async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
          parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)

  limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
  async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
    await asyncio.gather(*(client.get("/health") for _ in prompts))  # open the connections
    t0, cpu0 = time.perf_counter(), time.process_time()
    texts = await asyncio.gather(*(one(client, p) for p in prompts))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  return {"wall": wall, "texts": texts, "cpu": cpu}


async def _socket_client_run(url: str, prompts: list, max_tokens: int, stream: bool) -> dict:
  """`_client_run` with little client CPU: one asyncio connection per request, the
  requests' bytes built before the clock starts and written at once, the responses
  read with a minimal HTTP/1.1 parser (Content-Length, or chunked server-sent events)."""
  host, port = url.removeprefix("http://").rsplit(":", 1)
  conns = [await asyncio.open_connection(host, int(port)) for _ in prompts]
  requests = []
  for prompt in prompts:
    body = json.dumps(dict(prompt=prompt, max_tokens=max_tokens, temperature=0,
                           stream=stream)).encode()
    requests.append(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

  async def one(reader) -> str:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    if not head.startswith("http/1.1 200"):
      raise RuntimeError(head)
    if "content-length:" in head:
      size = int(head.split("content-length:")[1].split("\r\n")[0])
      return json.loads(await reader.readexactly(size))["choices"][0]["text"]
    parts, buffer = [], b""
    while True:  # chunked: size line, data, CRLF; events end with a blank line
      size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
      buffer += (await reader.readexactly(size + 2))[:-2]
      *events, buffer = buffer.split(b"\n\n")
      for event in events:
        if event == b"data: [DONE]":
          return "".join(parts)
        parts.append(json.loads(event[6:])["choices"][0]["text"])

  t0, cpu0 = time.perf_counter(), time.process_time()
  for (_, writer), request in zip(conns, requests):
    writer.write(request)
  texts = await asyncio.gather(*(one(reader) for reader, _ in conns))
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  for _, writer in conns:
    writer.close()
  return {"wall": wall, "texts": texts, "cpu": cpu}


def _client_main(url: str) -> None:
  """Reads one JSON command a line ({"prompts", "max_tokens", "stream"}), answers a line.
  httpx's per-request INFO log lines are off (absl's handler would print each one)."""
  import logging  # pylint: disable=import-outside-toplevel
  logging.getLogger("httpx").setLevel(logging.WARNING)
  for line in sys.stdin:
    cmd = json.loads(line)
    run = _socket_client_run if _CLIENT_KIND.value == "sockets" else _client_run
    out = asyncio.run(run(url, cmd["prompts"], cmd["max_tokens"], cmd["stream"]))
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------- the benchmark
_WHERE = {"thread": "its own thread", "loop": "the event loop", "process": "its own process"}


def main(argv):
  del argv
  if _CLIENT.value is not None:
    _client_main(_CLIENT.value)
    return
  if _SWITCH.value is not None:
    sys.setswitchinterval(_SWITCH.value / 1000)
  # pylint: disable=import-outside-toplevel
  from paged_kv.entrypoints.llm import LLM
  from paged_kv.scheduler.scheduler_config import SchedulerConfig
  from paged_kv.entrypoints.api_server import BackgroundServer, Server
  batch, max_tokens = _BATCH.value, _MAX_TOKENS.value
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(_CHECKPOINT.value) if _CHECKPOINT.value else _write_tiny(Path(tmp) / "tiny")
    config = SchedulerConfig(max_batch=batch, enable_prefix_cache=_PREFIX_CACHE.value,
                             prefill_token_budget=max(512, batch * _PROMPT_TOKENS.value))
    per_seq = -(-(_PROMPT_TOKENS.value + max_tokens) // 16)
    make_llm = functools.partial(LLM, str(ckpt), scheduler_config=config,
                                 num_blocks=2 * batch * per_seq + 1, eos_token_ids=(),
                                 max_seq_len=_PROMPT_TOKENS.value + max_tokens + 16,
                                 warmup=_WARMUP.value)
    server = Server(make_llm, max_queued=4 * batch, metrics=_METRICS.value,
                    engine=_ENGINE.value)
    _IN_PROCESS["llm"] = server.llm
    vocab = server.served.vocab_size
    rng = np.random.default_rng(_SEED.value)
    prompts = [rng.integers(3, vocab, _PROMPT_TOKENS.value).tolist() for _ in range(batch)]
    if _PIN.value:
      if _ENGINE.value != "process":
        raise SystemExit("--pin needs --engine=process")
      others = set(range(os.cpu_count())) - {0}
      for pid, cpus in ((server.engine.pid, {0}), ("self", others)):
        for thread_id in os.listdir(f"/proc/{pid}/task"):  # every thread of the process
          os.sched_setaffinity(int(thread_id), cpus)
    with BackgroundServer(server) as bg:
      client = subprocess.Popen(
          [*shared_flags.rerun_command(__file__), f"--client_url={bg.url}",
           f"--client={_CLIENT_KIND.value}"],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=shared_flags.REPO,
          env=dict(os.environ, JAX_PLATFORMS="cpu"))

      def facade() -> tuple[float, list[str], float]:
        return server.engine.call(functools.partial(_facade, prompts, max_tokens),
                                  timeout=600) + (0.0,)

      def over_http(stream: bool) -> tuple[float, list[str]]:
        client.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens,
                                           stream=stream)) + "\n")
        client.stdin.flush()
        out = json.loads(client.stdout.readline())
        return out["wall"], out["texts"], out["cpu"]

      try:
        _, want, _ = facade()  # warm-up: compiles every program the runs use
        over_http(False)
        over_http(True)
        walls: dict[str, list[float]] = {"facade": [], "server": [], "server, streamed": []}
        steps: dict[str, list[int]] = {name: [] for name in walls}
        cpu: dict[str, list[float]] = {name: [] for name in walls}  # this process, all threads
        engine_cpu: dict[str, list[float]] = {name: [] for name in walls}  # `_engine_cpu`
        client_cpu: dict[str, list[float]] = {name: [] for name in walls}  # the client's
        compiles = server.engine.call(_compiles)
        for _ in range(_REPEATS.value):
          for name, run in (("facade", facade), ("server", lambda: over_http(False)),
                            ("server, streamed", lambda: over_http(True))):
            before = server.engine.call(_steps)
            cpu_before = server.engine.call(_engine_cpu)
            process_cpu = time.process_time()
            wall, texts, run_client_cpu = run()
            client_cpu[name].append(run_client_cpu)
            cpu[name].append(time.process_time() - process_cpu)
            engine_cpu[name].append(server.engine.call(_engine_cpu) - cpu_before)
            steps[name].append(server.engine.call(_steps) - before)
            if texts != want:
              raise SystemExit(f"{name}: the texts differ from the facade's warm-up run")
            walls[name].append(wall)
        compiles = server.engine.call(_compiles) - compiles
      finally:
        client.stdin.close()
        client.wait(timeout=60)
      errors = server.num_server_errors
  generated = batch * max_tokens
  print(f"\nbatch {batch}, {_PROMPT_TOKENS.value} prompt tokens, {max_tokens} generated each "
        f"({generated} tokens a run), {_REPEATS.value} rounds, engine on "
        f"{_WHERE[_ENGINE.value]}, {_CLIENT_KIND.value} client, prefix cache "
        f"{'on' if _PREFIX_CACHE.value else 'off'}, metrics exporter "
        f"{'on' if _METRICS.value else 'off'}, {errors} server errors, {compiles} compiles "
        f"in the timed runs\n")
  print("| path | wall median [min-max] (s) | tokens/s | wall / facade's, paired median "
        "[min-max] | scheduler steps per run | CPU s of this process / of the engine "
        f"{'process' if _ENGINE.value == 'process' else 'thread'} / of the client "
        "(medians) |\n|---|---|---|---|---|---|")
  for name, ws in walls.items():
    ratios = [w / f for w, f in zip(ws, walls["facade"])]
    print(f"| {name} | {statistics.median(ws):.3f} [{min(ws):.3f}-{max(ws):.3f}] | "
          f"{generated / statistics.median(ws):.0f} | {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] | {statistics.median(steps[name]):.0f} | "
          f"{statistics.median(cpu[name]):.3f} / {statistics.median(engine_cpu[name]):.3f} / "
          f"{statistics.median(client_cpu[name]):.3f} |")
  if _RAW.value:
    print("raw " + json.dumps(dict(engine=_ENGINE.value, client=_CLIENT_KIND.value, walls=walls, steps=steps, cpu=cpu,
                                   engine_cpu=engine_cpu, client_cpu=client_cpu)))


if __name__ == "__main__":
  app.run(main)
