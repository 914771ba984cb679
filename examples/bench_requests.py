"""Per-request cost and hit rate of the cache-bound pool against a host baseline (and peers).

Usage:
  .venv/bin/python examples/bench_requests.py                     # chat + Mooncake, all rows
  .venv/bin/python examples/bench_requests.py --workloads=chat --chat_conversations=16
  .venv/bin/python examples/bench_requests.py --workloads=mooncake --max_requests=500
  .venv/bin/python examples/bench_requests.py --compile_only --compile_cache_dir=/tmp/jaxcache

One request is the path the scheduler takes on `CachedPool`: `match` (locked, split at
the match point) + `open` (the matched segments; a continuable partial tail is copied
into a fresh block) + `reserve_tokens` for every token not matched (with
`ensure_free` evicting first) + `insert` + `release` (+ `unlock`), 16-token blocks, one
request at a time. The same requests go through:

* **ours**: `CachedPool` over the jitted `BlockPool` (the real pool; CPU here);
* **host**: the same `radix.PrefixCache` over `HostBlockPool` (numpy block accounting,
  vectorised; `paged_kv.serving.replay.serve_tokens`): the bookkeeping alone;
* **vLLM / SGLang**: not timed yet. The script reports whether they import (their
  `--no-deps` installs pull in their server stacks; see WORKSPACE_NOTES.md); adapters
  replaying these requests through their prefix-cache + block-pool code are to do.

Workloads: (a) a synthetic multi-turn chat pool (`--chat_conversations` interleaved
conversations over 4 shared system prompts, each turn's prompt is the conversation so
far) at `--chat_capacity_tokens` (20k), and (b) the
Mooncake conversation trace at `--mooncake_capacity_tokens` (500k), from
`../shared/traces/conversation_trace.jsonl` beside the repository (from
github.com/kvcache-ai/Mooncake, `FAST25-release/traces/`); when it is missing the
script says so in one line and skips it.

Every row is timed on a warm run (a first, untimed pass over the same requests
compiles every shape), p50 and p99 per operation and per request, with the ratio to
the host baseline of the same run. The hit rate (matched / prompt tokens) at the
bounded capacity is reported for each, and with `--variants` for the host path without
tail continuation, with whole-leaf eviction, both (the behaviour before), and with the
cost policy. The last table is the compile time of the
serving path: the first request's latency and the cold pass's extra time, without and
with JAX's persistent compilation cache (in a fresh directory of its own):

    from paged_kv.runtime.compile_cache import enable_compilation_cache
    enable_compilation_cache("/path/to/cache")  # min compile time 0, min entry size 0

The script itself uses the cache (`--compile_cache`, on by default; `--compile_cache_dir`,
default `$PAGED_KV_COMPILE_CACHE` or `~/.cache/paged_kv/jax`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.normpath(
    os.path.join(_REPO, "..", "shared", "traces", "conversation_trace.jsonl"))

_WORKLOADS = flags.DEFINE_list("workloads", ["chat", "mooncake"], "chat and/or mooncake.")
_TRACE = flags.DEFINE_string("trace", DEFAULT_TRACE, "The Mooncake conversation trace (.jsonl).")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 2000,
                                     "Mooncake: the first N requests (0 = all).")
_CHAT_CAPACITY = flags.DEFINE_integer("chat_capacity_tokens", 20_000, "Chat pool size (tokens).")
_MOONCAKE_CAPACITY = flags.DEFINE_integer("mooncake_capacity_tokens", 500_000,
                                          "Mooncake pool size (tokens).")
_CHAT_CONVERSATIONS = flags.DEFINE_integer("chat_conversations", 10, "Chat conversations.")
_CHAT_TURNS = flags.DEFINE_integer("chat_turns", 8, "Turns per chat conversation.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_SEED = flags.DEFINE_integer("seed", 0, "Chat workload seed.")
_VARIANTS = flags.DEFINE_bool("variants", True,
                              "Also the hit rate of the host path without tail continuation / "
                              "with whole-leaf eviction / with the cost policy.")
_COMPILE = flags.DEFINE_bool("compile", True, "Measure compile time (subprocesses).")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False,
                                  "Only time a cold pass over the chat workload (used by "
                                  "the compile-time rows); prints one JSON line.")
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "Use JAX's persistent compilation "
                                   "cache (restarts skip XLA compiles).")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "The cache's directory "
                                         "(default: $PAGED_KV_COMPILE_CACHE, else "
                                         "~/.cache/paged_kv/jax).")

OPS = ("match", "open", "reserve", "insert", "release")


@dataclasses.dataclass
class Req:
  """One request: prompt token ids and the ids to insert (prompt, then its output)."""

  prompt: np.ndarray
  tokens: np.ndarray


def chat_requests(conversations: int, turns: int, seed: int) -> list[Req]:
  """Multi-turn chat: 4 shared system prompts, turns interleaved across conversations.

  Each turn's prompt is the conversation so far plus a user message (20-200 tokens);
  its output (20-300 tokens) joins the conversation, so the next turn's prompt
  extends this turn's inserted tokens exactly.
  """
  rng = np.random.default_rng(seed)
  next_id = [1_000_000]

  def fresh(n: int) -> np.ndarray:
    out = np.arange(next_id[0], next_id[0] + n, dtype=np.int32)
    next_id[0] += n
    return out

  systems = [fresh(int(rng.integers(100, 600))) for _ in range(4)]
  history = [systems[i % 4].copy() for i in range(conversations)]
  out = []
  for _ in range(turns):
    for c in rng.permutation(conversations):
      prompt = np.concatenate([history[c], fresh(int(rng.integers(20, 201)))])
      tokens = np.concatenate([prompt, fresh(int(rng.integers(20, 301)))])
      history[c] = tokens
      out.append(Req(prompt, tokens))
  return out


def mooncake_requests(path: str, max_requests: int) -> list[Req]:
  from paged_kv.serving import traces
  rows = traces.load_mooncake(path, max_requests)
  src = traces.TokenSource(rows)
  return [Req(p, p) for p in (src.prompt(r) for r in rows)]


# ---------------------------------------------------------------------------- ours
def make_ours(capacity: int, max_len: int, block_size: int):
  import paged_kv
  from paged_kv.serving import CachedPool
  num_blocks = capacity // block_size
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=block_size, num_layers=1,
                               num_kv_heads=1, head_dim=8, dtype="float32", max_seqs=8,
                               max_segments=max(64, -(-max_len // block_size) + 8))
  clock = [0.0]
  cp = CachedPool(paged_kv.BlockPool(config), clock=lambda: clock[0])
  return cp, clock


def serve_ours(cp, clock, req: Req, timings: dict | None) -> int:
  """One request through `CachedPool`; returns the matched tokens (-1: rejected).

  In the scheduler's order: match, make room (`ensure_free` for the rest plus one
  block, as its admission does), open, reserve, insert, release, unlock.
  """
  t = time.perf_counter
  bs = cp.config.block_size
  clock[0] += 1.0
  t0 = t()
  m = cp.match("default", req.prompt[:-1])
  t1 = t()
  rest = int(req.tokens.shape[0]) - m.length
  if not cp.ensure_free(-(-rest // bs) + 1):
    if m.node is not None:
      cp.unlock(m.node)
    return -1
  t2 = t()
  seq = cp.open(m.segments)
  t3 = t()
  slots = cp.pool.reserve_tokens([seq], [rest])
  t4 = t()
  cp.insert("default", req.tokens, seq)
  t5 = t()
  cp.release([seq])
  if m.node is not None:
    cp.unlock(m.node)
  t6 = t()
  del slots
  if timings is not None:
    for name, dt in zip(OPS, (t1 - t0, t3 - t2, (t2 - t1) + (t4 - t3), t5 - t4, t6 - t5)):
      timings.setdefault(name, []).append(dt)
  return m.length


def run_ours(reqs: list[Req], capacity: int, block_size: int, timed: bool):
  max_len = max(int(r.tokens.shape[0]) for r in reqs)
  cp, clock = make_ours(capacity, max_len, block_size)
  timings: dict = {}
  hit = total = 0
  for r in reqs:
    got = serve_ours(cp, clock, r, timings if timed else None)
    hit += max(got, 0)
    total += int(r.prompt.shape[0])
  cp.check_invariants()
  return timings, hit / total


# ---------------------------------------------------------------------------- host
def run_host(reqs: list[Req], capacity: int, block_size: int, **config_kw):
  from paged_kv.serving.replay import ReplayConfig, ReplayResult, SimState, serve_tokens
  config = ReplayConfig(capacity, block_size=block_size, **config_kw)
  sim = SimState([], config)
  result = ReplayResult("host", capacity)
  timings: dict = {}
  for i, r in enumerate(reqs):
    sim.now = float(i + 1)
    # The scheduler matches prompt[:-1] (one token left to compute): the same here.
    serve_tokens(sim, r.prompt[:-1], r.tokens, result, timings)
    result.prompt_tokens += 1  # the last prompt token counts as asked, never hit
  sim.check_accounting()
  return timings, result.hit_rate


# ---------------------------------------------------------------------------- peers
def peers_available() -> dict[str, str]:
  """Which peer libraries import here (name -> version or the import error)."""
  out = {}
  for name, mod in (("vLLM", "vllm"), ("SGLang", "sglang")):
    try:
      m = __import__(mod)
      out[name] = getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
      out[name] = f"not importable ({type(e).__name__}: {str(e)[:60]})"
  return out


# ---------------------------------------------------------------------------- report
def pct(xs, q) -> float:
  return float(np.percentile(np.asarray(xs), q)) * 1e6 if len(xs) else float("nan")


def per_request(timings: dict) -> list[float]:
  return list(np.sum([np.asarray(timings[op]) for op in OPS], axis=0))


def compile_rows() -> list[tuple[str, float, float]]:
  """(label, first request s, cold pass extra s) in fresh processes."""
  import tempfile
  rows = []
  cache = tempfile.mkdtemp(prefix="paged_kv_jax_cache_")
  for label, cache_args in (("no persistent cache", ["--nocompile_cache"]),
                            ("persistent cache, empty", [f"--compile_cache_dir={cache}"]),
                            ("persistent cache, filled", [f"--compile_cache_dir={cache}"])):
    cmd = [sys.executable, os.path.abspath(__file__), "--compile_only",
           *cache_args, f"--chat_conversations={_CHAT_CONVERSATIONS.value}",
           f"--chat_turns={_CHAT_TURNS.value}", f"--block_size={_BLOCK_SIZE.value}",
           f"--chat_capacity_tokens={_CHAT_CAPACITY.value}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=_REPO)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    rows.append((label, d["first_request_s"], d["cold_extra_s"], d["import_s"]))
  return rows


def compile_only() -> None:
  t0 = time.perf_counter()
  # Imported in every row (with the cache or without), so the import column compares.
  from paged_kv.runtime.compile_cache import enable_compilation_cache
  if _COMPILE_CACHE.value:
    enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  reqs = chat_requests(_CHAT_CONVERSATIONS.value, _CHAT_TURNS.value, _SEED.value)
  max_len = max(int(r.tokens.shape[0]) for r in reqs)
  t1 = time.perf_counter()
  cp, clock = make_ours(_CHAT_CAPACITY.value, max_len, _BLOCK_SIZE.value)
  ta = time.perf_counter()
  serve_ours(cp, clock, reqs[0], None)
  first = time.perf_counter() - ta
  for r in reqs[1:]:
    serve_ours(cp, clock, r, None)
  cold = time.perf_counter() - t1
  cp, clock = make_ours(_CHAT_CAPACITY.value, max_len, _BLOCK_SIZE.value)
  t2 = time.perf_counter()
  for r in reqs:
    serve_ours(cp, clock, r, None)
  warm = time.perf_counter() - t2
  print(json.dumps({"first_request_s": first, "cold_extra_s": cold - warm,
                    "import_s": t1 - t0}))


def main(argv):
  del argv
  if _COMPILE_ONLY.value:
    compile_only()
    return
  if _COMPILE_CACHE.value:
    from paged_kv.runtime.compile_cache import enable_compilation_cache
    enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  workloads = []
  for w in _WORKLOADS.value:
    if w == "chat":
      reqs = chat_requests(_CHAT_CONVERSATIONS.value, _CHAT_TURNS.value, _SEED.value)
      workloads.append((f"chat {_CHAT_CAPACITY.value // 1000}k", reqs, _CHAT_CAPACITY.value))
    elif w == "mooncake":
      if not os.path.exists(_TRACE.value):
        from paged_kv.serving import traces
        print(f"skipping mooncake: {_TRACE.value} not found; it is "
              f"{traces.describe_trace(_TRACE.value)}")
        continue
      reqs = mooncake_requests(_TRACE.value, _MAX_REQUESTS.value)
      workloads.append((f"mooncake {_MOONCAKE_CAPACITY.value // 1000}k", reqs,
                        _MOONCAKE_CAPACITY.value))
    else:
      raise app.UsageError(f"unknown workload {w!r}")
  peers = peers_available()
  for name, status in peers.items():
    print(f"{name}: {status}")
  bs = _BLOCK_SIZE.value
  cost_rows, hit_rows = [], []
  for label, reqs, cap in workloads:
    print(f"{label}: {len(reqs)} requests, {sum(int(r.prompt.shape[0]) for r in reqs)} prompt "
          f"tokens", flush=True)
    run_ours(reqs, cap, bs, timed=False)  # compiles every shape
    ours_t, ours_hit = run_ours(reqs, cap, bs, timed=True)
    host_t, host_hit = run_host(reqs, cap, bs)
    for name, t in (("ours (CachedPool)", ours_t), ("host (numpy)", host_t)):
      cost_rows.append((label, name, t, host_t))
    hit_rows.append((label, "ours (CachedPool)", ours_hit))
    hit_rows.append((label, "host: continue tails, block LRU", host_hit))
    if _VARIANTS.value:
      for name, kw in (("host: no tail continuation", dict(continue_tails=False)),
                       ("host: whole-leaf eviction", dict(granularity="node")),
                       ("host: both off (before issue L)",
                        dict(continue_tails=False, granularity="node")),
                       ("host: cost policy", dict(policy="cost"))):
        hit_rows.append((label, name, run_host(reqs, cap, bs, **kw)[1]))
  compile_table = compile_rows() if _COMPILE.value else []

  print("\nPer request (us, warm; ratio = p50 / host p50 of the same run)")
  head = f"{'workload':<14} {'path':<20}" + "".join(f" {op + ' p50/p99':>18}" for op in OPS)
  print(head + f" {'request p50/p99':>18} {'ratio':>6}")
  for label, name, t, base in cost_rows:
    cells = "".join(f" {pct(t[op], 50):>8.1f}/{pct(t[op], 99):<9.1f}" for op in OPS)
    req, ref = per_request(t), per_request(base)
    print(f"{label:<14} {name:<20}{cells} {pct(req, 50):>8.1f}/{pct(req, 99):<9.1f}"
          f" {pct(req, 50) / pct(ref, 50):>6.2f}")
  print("\nHit rate at bounded capacity (matched / prompt tokens, same requests)")
  for label, name, hit in hit_rows:
    print(f"{label:<14} {name:<36} {hit:.4f}")
  if compile_table:
    print("\nCompile time of the serving path (chat workload, fresh processes, s)")
    print(f"{'':<26} {'first request':>14} {'cold extra':>11} {'import':>7}")
    for label, first, extra, imp in compile_table:
      print(f"{label:<26} {first:>14.2f} {extra:>11.2f} {imp:>7.2f}")


if __name__ == "__main__":
  app.run(main)
