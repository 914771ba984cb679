"""Soak the OpenAI-compatible server: a mixed, misbehaving client load for a fixed time.

One `paged_kv.LLM` (a random tiny Llama checkpoint with a byte-level BPE tokenizer,
or `--checkpoint DIR`), warmed up, behind `paged_kv.entrypoints.api_server` on 127.0.0.1;
a client process keeps `--concurrency` connections busy for `--seconds`
(`PAGED_KV_SOAK_SECONDS` overrides it), each drawing its next request from:

  * whole: a `/v1/completions` request, 1..`--max_tokens` tokens;
  * stream: the same streamed (server-sent events) to `[DONE]`;
  * disconnect: a stream the client closes after 1-3 chunks (the server aborts it);
  * slow reader: a stream read one chunk per `--slow_read_ms`;
  * give up: a whole request the client abandons after `--give_up_ms`;
  * malformed: a body that is not JSON (400);
  * oversize: a prompt longer than the context or `max_tokens` past it (400).

A full queue answers 429 (allowed, counted). Anything else (a 5xx, an unexpected
status, a broken stream, a stream without `[DONE]`) is an error. A third party
scrapes `/metrics` every `--scrape_every_s` on the clock, on its own connection (the
client process, as Prometheus would); their latencies are reported.
The server process samples its resident memory every second.

At the end feeding stops, the server drains, and the script checks: no request
outstanding, no live sequence, 0 blocks held by sequences, the pool and cache
invariants, 0 compiles after the warm-up, and the resident memory over the last
`--flat_window` of the run (growth = the window's largest sample over its first).
Exit status 1 if any check fails. `--record` writes the JSON record.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/soak_server.py --seconds=1800 --concurrency=128 \\
      --record=docs/records/soak_server/
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from absl import app, flags

from benchmarks import records, shared_flags

_SECONDS = flags.DEFINE_float("seconds", 60.0, "Wall seconds of load "
                              "(PAGED_KV_SOAK_SECONDS overrides).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 64, "Client connections kept busy.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "The scheduler's max_batch.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Most tokens a request asks for.")
_MAX_QUEUED = flags.DEFINE_integer("max_queued", 96, "Requests the server queues before 429.")
_SLOW_READ_MS = flags.DEFINE_float("slow_read_ms", 200.0, "A slow reader's pause per chunk.")
_GIVE_UP_MS = flags.DEFINE_float("give_up_ms", 50.0, "A giving-up client's timeout.")
_SCRAPE = flags.DEFINE_float("scrape_every_s", 1.0, "Seconds between /metrics scrapes.")
_FLAT_WINDOW = flags.DEFINE_float("flat_window", 2 / 3, "Trailing share of the run whose "
                                  "resident memory must stay flat.")
_MAX_GROWTH = flags.DEFINE_float("max_rss_growth", 0.05, "Largest allowed growth of the "
                                 "resident memory over the window.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A checkpoint directory (default: a "
                                  "random tiny Llama with a byte-level BPE tokenizer).")
_SEED = shared_flags.define_seed("The client's seed.")
_RECORD = shared_flags.define_record()
_CLIENT = flags.DEFINE_string("client_url", None, "Internal: run as the client process of "
                              "this URL (its parameters as JSON on stdin, counts on stdout).")

KINDS = {"whole": 6, "stream": 6, "disconnect": 2, "slow_reader": 1, "give_up": 1,
         "malformed": 1, "oversize": 1}
"""Each client request's kind, with its weight."""
WORDS = "paged kv cache blocks keys values tokens scheduler prompt decode step".split()


# ---------------------------------------------------------------------- the client
class _Unexpected(Exception):
  """A response the kind does not allow."""


async def _one(client, kind: str, rng: random.Random, p: dict) -> str:
  """Runs one request of `kind`; returns its outcome (raises `_Unexpected`)."""
  import httpx  # pylint: disable=import-outside-toplevel
  prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
  body = dict(model=p["model"], prompt=prompt, max_tokens=rng.randint(1, p["max_tokens"]),
              temperature=rng.choice([0, 0.7]), seed=rng.randint(0, 1 << 20))
  if kind == "malformed":
    r = await client.post("/v1/completions", content=b'{"prompt": "x", max_tok',
                          headers={"content-type": "application/json"})
    if r.status_code != 400:
      raise _Unexpected(f"malformed body: {r.status_code} {r.text[:200]}")
    return "400"
  if kind == "oversize":
    if rng.random() < 0.5:
      body["prompt"] = " ".join(["tokens"] * (2 * p["context"]))
    else:
      body["max_tokens"] = 2 * p["context"]
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 400 or "context" not in r.text:
      raise _Unexpected(f"oversize: {r.status_code} {r.text[:200]}")
    return "400"
  if kind == "whole":
    r = await client.post("/v1/completions", json=body)
    if r.status_code == 429:
      return "429"
    if r.status_code != 200 or not r.json()["choices"]:
      raise _Unexpected(f"whole: {r.status_code} {r.text[:200]}")
    return "200"
  if kind == "give_up":
    try:
      r = await client.post("/v1/completions", json=dict(body, max_tokens=p["max_tokens"]),
                            timeout=p["give_up_ms"] / 1000)
    except httpx.TimeoutException:
      return "gave up"
    if r.status_code not in (200, 429):
      raise _Unexpected(f"give up: {r.status_code} {r.text[:200]}")
    return str(r.status_code)
  # Streams: read to [DONE], stop early (disconnect) or read slowly.
  cut = rng.randint(1, 3) if kind == "disconnect" else None
  chunks = 0
  async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
    if r.status_code == 429:
      return "429"
    if r.status_code != 200:
      raise _Unexpected(f"{kind}: {r.status_code} {(await r.aread())[:200]!r}")
    async for line in r.aiter_lines():
      if not line.startswith("data: "):
        continue
      if line == "data: [DONE]":
        return "200"
      json.loads(line[6:])  # every chunk is JSON
      chunks += 1
      if cut is not None and chunks >= cut:
        return "disconnected"
      if kind == "slow_reader":
        await asyncio.sleep(p["slow_read_ms"] / 1000)
  if cut is not None:
    return "disconnected"  # the stream ended before the cut
  raise _Unexpected(f"{kind}: the stream ended without [DONE] after {chunks} chunks")


async def _client_run(url: str, p: dict) -> dict:
  import httpx  # pylint: disable=import-outside-toplevel
  outcomes: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
  errors: list[str] = []
  scrapes = collections.Counter()
  deadline = time.monotonic() + p["seconds"]
  kinds, weights = list(KINDS), list(KINDS.values())

  async def worker(w: int, client) -> None:
    rng = random.Random(p["seed"] * 100_003 + w)
    while time.monotonic() < deadline:
      kind = rng.choices(kinds, weights)[0]
      try:
        outcomes[kind][await _one(client, kind, rng, p)] += 1
      except (_Unexpected, httpx.HTTPError, ValueError, KeyError) as e:
        outcomes[kind]["error"] += 1
        if len(errors) < 20:
          errors.append(f"{kind}: {type(e).__name__}: {e}")

  latencies: list[float] = []

  async def scrape(client) -> None:
    t0 = time.monotonic()
    try:
      r = await client.get("/metrics")
      ok = r.status_code == 200 and "paged_kv_" in r.text
      scrapes["ok" if ok else f"status {r.status_code}"] += 1
    except httpx.HTTPError as e:
      scrapes[type(e).__name__] += 1
    latencies.append(time.monotonic() - t0)

  async def scraper(client) -> None:
    """A scrape every `scrape_every_s` on the clock, however long the last one took
    (as Prometheus does), on its own connection."""
    tasks = []
    tick = time.monotonic()
    while tick < deadline:
      tasks.append(asyncio.create_task(scrape(client)))
      tick += p["scrape_every_s"]
      await asyncio.sleep(max(0.0, tick - time.monotonic()))
    await asyncio.gather(*tasks)

  n = p["concurrency"]
  # Idle connections expire on the client before the server's keep-alive timeout
  # (uvicorn's 5 s), so a request never goes out on a connection the server closes.
  limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
  async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client, \
      httpx.AsyncClient(base_url=url, timeout=600) as metrics_client:
    await asyncio.gather(scraper(metrics_client), *(worker(w, client) for w in range(n)))
  latencies.sort()
  pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies \
      else None
  return {"outcomes": {k: dict(v) for k, v in outcomes.items()}, "errors": errors,
          "scrapes": dict(scrapes), "scrape_s": {"p50": pick(0.5), "p99": pick(0.99),
                                                 "max": latencies[-1] if latencies else None}}


def _client_main(url: str) -> None:
  params = json.loads(sys.stdin.readline())
  print(json.dumps(asyncio.run(_client_run(url, params))), flush=True)


# ---------------------------------------------------------------------- the server side
def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler(threading.Thread):
  """This process's resident memory, once a second: `samples` of (seconds, bytes)."""

  def __init__(self):
    super().__init__(daemon=True)
    self.samples: list[tuple[float, int]] = []
    self.stop = threading.Event()
    self._t0 = time.monotonic()

  def run(self) -> None:
    self.samples.append((0.0, _rss_bytes()))
    while not self.stop.wait(1.0):
      self.samples.append((time.monotonic() - self._t0, _rss_bytes()))


def _write_tiny(path: Path) -> Path:
  """A random tiny Llama checkpoint with a byte-level BPE tokenizer, no eos token."""
  from paged_kv.model import random_checkpoint  # pylint: disable=import-outside-toplevel
  hf = random_checkpoint.hf_config("tiny", dtype="float32", eos_token_id=None,
                                   max_position_embeddings=1024)
  random_checkpoint.write_random_checkpoint(path, hf, seed=0)
  random_checkpoint.write_byte_level_tokenizer(path, hf["vocab_size"])
  return path


def soak(seconds: float) -> dict:
  """Serves the client load for `seconds`; returns the results (checks included)."""
  # pylint: disable=import-outside-toplevel
  from paged_kv.entrypoints.llm import LLM
  from paged_kv.scheduler.scheduler_config import SchedulerConfig
  from paged_kv.entrypoints.api_server import BackgroundServer, Server
  batch, max_tokens = _MAX_BATCH.value, _MAX_TOKENS.value
  context = 256
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(_CHECKPOINT.value) if _CHECKPOINT.value else _write_tiny(Path(tmp) / "tiny")
    config = SchedulerConfig(max_batch=batch, prefill_token_budget=512)
    llm = LLM(ckpt, scheduler_config=config, num_blocks=batch * (context // 16) + 1,
              eos_token_ids=(), max_seq_len=context, warmup=True)
    server = Server(llm, max_queued=_MAX_QUEUED.value)
    rss = _RssSampler()
    with BackgroundServer(server) as bg:
      engine = server.engine
      compiles0 = engine.call(lambda e: e.scheduler.runtime.backend_compiles)
      steps0 = engine.call(lambda e: e.scheduler.stats.steps)
      params = dict(seconds=seconds, concurrency=_CONCURRENCY.value, max_tokens=max_tokens,
                    model=server.model_name, context=context, seed=_SEED.value,
                    slow_read_ms=_SLOW_READ_MS.value, give_up_ms=_GIVE_UP_MS.value,
                    scrape_every_s=_SCRAPE.value)
      rss.start()
      client = subprocess.run(
          shared_flags.rerun_command(__file__) + [f"--client_url={bg.url}"],
          cwd=shared_flags.REPO,
          input=json.dumps(params) + "\n", capture_output=True, text=True,
          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=seconds + 600, check=False)
      if client.returncode != 0:
        raise SystemExit(f"the client failed:\n{client.stderr[-3000:]}")
      load = json.loads(client.stdout.strip().splitlines()[-1])
      deadline = time.monotonic() + 120
      while engine.outstanding and time.monotonic() < deadline:
        time.sleep(0.05)

      def final(e):
        e.scheduler.cached_pool.check_invariants()
        return dict(outstanding=engine.outstanding, live=e.num_live, idle=e.scheduler.idle,
                    used_blocks=e.scheduler.take_stats().used_blocks,
                    compiles=e.scheduler.runtime.backend_compiles - compiles0,
                    steps=e.scheduler.stats.steps - steps0,
                    aborted=e.scheduler.stats.aborted, finished=e.scheduler.stats.finished)

      end = engine.call(final)
      server_errors = server.num_server_errors
      disconnects = server.num_client_disconnects
    rss.stop.set()
    rss.join()
  samples = rss.samples
  start = (1 - _FLAT_WINDOW.value) * seconds
  window = [b for t, b in samples if start <= t <= seconds] or [b for _, b in samples]
  growth = max(window) / window[0] - 1 if window else 0.0
  errors = sum(v.get("error", 0) for v in load["outcomes"].values())
  checks = {
      "no client error": errors == 0,
      "no server error": server_errors == 0,
      "every scrape answered": set(load["scrapes"]) == {"ok"},
      "drained (nothing outstanding or live)": (end["outstanding"], end["live"], end["idle"])
      == (0, 0, True),
      "0 blocks held by sequences": end["used_blocks"] == 0,
      "0 compiles after warm-up": end["compiles"] == 0,
      f"resident memory flat (<= {_MAX_GROWTH.value:.0%})": growth <= _MAX_GROWTH.value,
  }
  return dict(seconds=seconds, concurrency=_CONCURRENCY.value, max_batch=batch,
              outcomes=load["outcomes"], client_errors=load["errors"], scrapes=load["scrapes"],
              scrape_s=load["scrape_s"], client_disconnects=disconnects,
              server_errors=server_errors, end=end,
              rss_mib=dict(first=samples[0][1] / 2**20 if samples else None,
                           window_first=window[0] / 2**20 if window else None,
                           window_max=max(window) / 2**20 if window else None,
                           median=statistics.median(b for _, b in samples) / 2**20
                           if samples else None),
              rss_growth=growth, checks=checks)


def main(argv):
  del argv
  if _CLIENT.value is not None:
    _client_main(_CLIENT.value)
    return
  seconds = float(os.environ.get("PAGED_KV_SOAK_SECONDS") or _SECONDS.value)
  if seconds <= 0 or _CONCURRENCY.value < 1 or not 0 < _FLAT_WINDOW.value <= 1:
    raise app.UsageError("--seconds and --concurrency must be positive, --flat_window in (0, 1]")
  rec = records.Recorder(_RECORD.value, "soak_server", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  res = soak(seconds)
  print(f"\n{seconds:.0f} s, {res['concurrency']} connections, max_batch {res['max_batch']}: "
        f"{res['end']['steps']} steps, {res['end']['finished']} finished, "
        f"{res['end']['aborted']} aborted, {res['client_disconnects']} left before their "
        f"body arrived; scrapes {res['scrapes']}, latency p50 {res['scrape_s']['p50']:.3f} s, "
        f"p99 {res['scrape_s']['p99']:.3f} s\n")
  print("| kind | outcomes |\n|---|---|")
  for kind, out in res["outcomes"].items():
    print(f"| {kind} | {', '.join(f'{k}: {v}' for k, v in sorted(out.items()))} |")
  mib = res["rss_mib"]
  print(f"\nresident memory: {mib['window_first']:.0f} -> max {mib['window_max']:.0f} MiB over "
        f"the last {_FLAT_WINDOW.value:.0%} ({res['rss_growth']:+.1%})")
  for e in res["client_errors"]:
    print("client error:", e)
  print("\n| check | result |\n|---|---|")
  for name, ok in res["checks"].items():
    print(f"| {name} | {'ok' if ok else 'FAILED'} |")
  rec.write(res)
  if not all(res["checks"].values()):
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
