"""Per-request cost and hit rate of the cache-bound pool against a host baseline (and peers).

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_requests.py                     # chat + Mooncake, all rows
  PYTHONPATH=. .venv/bin/python benchmarks/bench_requests.py --workloads=chat --chat_conversations=16
  PYTHONPATH=. .venv/bin/python benchmarks/bench_requests.py --workloads=mooncake --max_requests=500
  PYTHONPATH=. .venv/bin/python benchmarks/bench_requests.py --workloads=chat --repeats=5 --seed=1
  PYTHONPATH=. .venv/bin/python benchmarks/bench_requests.py --compile_only --compile_cache_dir=/tmp/jaxcache

One request is the path the scheduler takes on `CachedPool`: `match` (locked, split at
the match point) + `open` (the matched segments; a continuable partial tail is copied
into a fresh block) + `reserve_tokens` for every token not matched (with
`ensure_free` evicting first) + `insert` + `release` (+ `unlock`), 16-token blocks, one
request at a time. The same requests go through:

* **ours**: `CachedPool` over the jitted `BlockPool` (the real pool; CPU here). The
  pool decides every call on its host mirror and queues the change; each request
  ends with `pool.flush()`, so the device receives the request's bookkeeping as one
  `commit` program and its dispatch is in the timing (column `flush`). The
  `pool.runtime` counters, read before and after each request, give its device
  dispatches by kind (`disp/req`) and its blocking host reads (`reads/req`): mean and
  max over the timed requests; the serving path is meant to make at most one
  dispatch and no blocking read per request (a request touching more blocks than one
  commit carries, `CommitWidths.block_width`, takes one per chunk);
* **host**: the same `radix.PrefixCache` over `BlockAccounting` (numpy block accounting,
  vectorised; `paged_kv.sim.replay.serve_tokens`): the bookkeeping alone;
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

Every row is timed on warm runs (a first, untimed pass of each path over the same
requests compiles every shape). The two paths are timed in the same process,
interleaved so that machine noise hits both: `--repeats` runs, each over fresh pools,
alternate the paths in blocks of `--interleave_requests` requests (which path goes
first alternates by block and by run). A request's time is the median over the runs;
the table gives p50 and p99 over requests per operation and per request, the ratio
ours / host of the per-request p50s, and the median of the paired per-request ratios
(`paired`); a second table gives the p50 ratio of each run, ours' dispatches and
blocking reads by kind, and the XLA compiles during the timed runs (0 when warm).
Ours must match the same tokens in every run as in its warm pass (the script stops
otherwise). The hit rate (matched / prompt tokens) at the bounded capacity is
reported for each, and with `--variants` for the host path without tail
continuation, with whole-leaf eviction, both (the behaviour before), and with the
cost policy. The last table is the compile time of the serving path: the first
request's latency (its flush included, so the compile of its commit program) and
the cold pass's extra time, without and with JAX's persistent compilation cache (in
a fresh directory of its own):

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
import time

import numpy as np
from absl import app, flags

from benchmarks import records, shared_flags

DEFAULT_TRACE = shared_flags.default_trace(__file__)

_WORKLOADS = flags.DEFINE_list("workloads", ["chat", "mooncake"], "chat and/or mooncake.")
_TRACE = flags.DEFINE_string("trace", DEFAULT_TRACE, "The Mooncake conversation trace (.jsonl).")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 2000,
                                     "Mooncake: the first N requests (0 = all).")
_CHAT_CAPACITY = flags.DEFINE_integer("chat_capacity_tokens", 20_000, "Chat pool size (tokens).")
_MOONCAKE_CAPACITY = flags.DEFINE_integer("mooncake_capacity_tokens", 500_000,
                                          "Mooncake pool size (tokens).")
_CHAT_CONVERSATIONS = flags.DEFINE_integer("chat_conversations", 10, "Chat conversations.")
_CHAT_TURNS = flags.DEFINE_integer("chat_turns", 8, "Turns per chat conversation.")
_BLOCK_SIZE = shared_flags.define_block_size()
_SEED = shared_flags.define_seed("Chat workload seed (and the order of the interleaved "
                                 "blocks: the first path alternates from it).")
_REPEATS = shared_flags.define_repeats(3, "Timed runs of each path (interleaved); a "
                                       "request's time is its median over them.")
_INTERLEAVE = flags.DEFINE_integer("interleave_requests", 8, "Requests per block when "
                                   "alternating the two paths in a run.", lower_bound=1)
_VARIANTS = flags.DEFINE_bool("variants", True,
                              "Also the hit rate of the host path without tail continuation / "
                              "with whole-leaf eviction / with the cost policy.")
_FLUSH_EVERY = flags.DEFINE_integer("flush_every", 1, "Ours flushes (one commit) after every "
                                    "k-th request: 1 is a request at a time; k > 1 is what a "
                                    "scheduler step admitting k requests does (one commit for "
                                    "all). Compare 'mean' ratios then: the commit's cost lands "
                                    "on every k-th request.")
_COMPILE = flags.DEFINE_bool("compile", True, "Measure compile time (subprocesses).")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False,
                                  "Only time a cold pass over the chat workload (used by "
                                  "the compile-time rows); prints one JSON line.")
_RECORD = shared_flags.define_record()  # paged_kv is imported lazily here (it is timed)
_COMPILE_CACHE = shared_flags.define_compile_cache()

OPS = ("match", "open", "reserve", "insert", "release", "flush")  # host: no flush
OURS, HOST = "ours (CachedPool)", "host (numpy)"


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
  from paged_kv.sim import traces
  rows = traces.load_mooncake(path, max_requests)
  src = traces.TokenSource(rows)
  return [Req(p, p) for p in (src.prompt(r) for r in rows)]


# ---------------------------------------------------------------------------- ours
def make_ours(capacity: int, max_len: int, block_size: int):
  import paged_kv
  from paged_kv.cache import CachedPool
  num_blocks = capacity // block_size
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=block_size, num_layers=1,
                               num_kv_heads=1, head_dim=8, dtype="float32", max_seqs=8,
                               max_segments=max(64, -(-max_len // block_size) + 8))
  clock = [0.0]
  cp = CachedPool(paged_kv.BlockPool(config), clock=lambda: clock[0])
  return cp, clock


_SERVED = [0]  # requests served by ours (the flush cadence)


def serve_ours(cp, clock, req: Req, timings: dict | None) -> int:
  """One request through `CachedPool`; returns the matched tokens (-1: rejected).

  In the scheduler's order: match, make room (`ensure_free` for the rest plus one
  block, as its admission does), open, reserve, insert, release, unlock, then
  `pool.flush()` (every `--flush_every`-th request): the bookkeeping goes to the
  device (one `commit`). A rejected request records no timings (it flushes too).
  """
  _SERVED[0] += 1
  flush = _SERVED[0] % max(_FLUSH_EVERY.value, 1) == 0
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
    cp.pool.flush()
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
  if flush:
    cp.pool.flush()
  t7 = t()
  del slots
  if timings is not None:
    for name, dt in zip(OPS, (t1 - t0, t3 - t2, (t2 - t1) + (t4 - t3), t5 - t4, t6 - t5,
                              t7 - t6)):
      timings.setdefault(name, []).append(dt)
  return m.length


class OursPath:
  """`CachedPool` over a fresh `BlockPool`, served one request at a time."""

  def __init__(self, capacity: int, max_len: int, block_size: int):
    self.cp, self.clock = make_ours(capacity, max_len, block_size)

  def serve(self, req: Req, timings: dict | None) -> int:
    return serve_ours(self.cp, self.clock, req, timings)

  def counters(self):
    return self.cp.pool.runtime.snapshot()

  def check(self) -> None:
    self.cp.check_invariants()


# ---------------------------------------------------------------------------- host
class HostPath:
  """The same `radix.PrefixCache` over `BlockAccounting` (`replay.serve_tokens`)."""

  def __init__(self, capacity: int, block_size: int, **config_kw):
    from paged_kv.sim.replay import ReplayConfig, ReplayResult, SimState, serve_tokens
    self._serve_tokens = serve_tokens
    config = ReplayConfig(capacity, block_size=block_size, **config_kw)
    self.sim = SimState([], config)
    self.result = ReplayResult("host", capacity)

  def serve(self, req: Req, timings: dict | None) -> int:
    self.sim.now += 1.0
    hit = self.result.hit_tokens
    # The scheduler matches prompt[:-1] (one token left to compute): the same here.
    ok = self._serve_tokens(self.sim, req.prompt[:-1], req.tokens, self.result, timings)
    self.result.prompt_tokens += 1  # the last prompt token counts as asked, never hit
    return self.result.hit_tokens - hit if ok else -1

  def counters(self):
    return None

  def check(self) -> None:
    self.sim.check_accounting()


def run_host(reqs: list[Req], capacity: int, block_size: int, **config_kw) -> float:
  """The host path's hit rate over `reqs` (untimed)."""
  path = HostPath(capacity, block_size, **config_kw)
  for r in reqs:
    path.serve(r, None)
  path.check()
  return path.result.hit_rate


# ---------------------------------------------------------------------------- timing
@dataclasses.dataclass
class Measured:
  """Both paths over one workload.

  Attributes:
    times: path -> f64[repeats, num_requests, len(OPS)] seconds (NaN: not run,
      e.g. the host's flush or a rejected request).
    hit: path -> hit rate (matched / prompt tokens) of its warm pass.
    dispatches: kind -> i64[repeats * num_requests], ours' dispatches per request.
    reads: kind -> i64[repeats * num_requests], ours' blocking reads per request.
    compiles: XLA compiles during the timed runs (all of them; 0 when warm).
  """

  times: dict
  hit: dict
  dispatches: dict
  reads: dict
  compiles: int


def hit_rate(got: list[int], reqs: list[Req]) -> float:
  return sum(max(g, 0) for g in got) / sum(int(r.prompt.shape[0]) for r in reqs)


def measure(reqs: list[Req], capacity: int, block_size: int, *, repeats: int,
            interleave: int, seed: int) -> Measured:
  """Warm passes, then `repeats` timed runs of both paths interleaved in blocks."""
  from paged_kv.runtime.counters import READ_KINDS
  max_len = max(int(r.tokens.shape[0]) for r in reqs)
  n = len(reqs)

  def fresh():
    return {OURS: OursPath(capacity, max_len, block_size), HOST: HostPath(capacity, block_size)}

  warm_got = {}
  for name, path in fresh().items():  # ours: compiles every shape
    warm_got[name] = [path.serve(r, None) for r in reqs]
    path.check()
  times = {name: np.full((repeats, n, len(OPS)), np.nan) for name in warm_got}
  dispatches: dict[str, list[int]] = {}
  # Blocking reads: every kind but an executor's sampled tokens (`RuntimeCounters`).
  reads: dict[str, list[int]] = {k: [] for k in READ_KINDS if k != "tokens"}
  compiles = 0
  for rep in range(repeats):
    paths = fresh()
    got = {name: [0] * n for name in paths}
    for b, start in enumerate(range(0, n, interleave)):
      order = (OURS, HOST) if (b + rep + seed) % 2 == 0 else (HOST, OURS)
      for name in order:
        path = paths[name]
        for i in range(start, min(start + interleave, n)):
          timings: dict = {}
          before = path.counters()
          got[name][i] = path.serve(reqs[i], timings)
          if before is not None:
            delta = path.counters().since(before)
            for kind in delta.dispatches:
              dispatches.setdefault(kind, [0] * (rep * n + i))
            for kind in dispatches:
              dispatches[kind].append(delta.dispatches.get(kind, 0))
            for kind in reads:
              reads[kind].append(delta.host_reads.get(kind, 0))
            compiles += delta.backend_compiles
          for j, op in enumerate(OPS):
            if op in timings:
              times[name][rep, i, j] = timings[op][0]
    for name, path in paths.items():
      path.check()
      if got[name] != warm_got[name]:
        diff = sum(a != b for a, b in zip(got[name], warm_got[name]))
        raise RuntimeError(f"{name}: run {rep} matched other lengths than the warm pass "
                           f"in {diff} of {n} requests")
  return Measured(times=times, hit={k: hit_rate(v, reqs) for k, v in warm_got.items()},
                  dispatches={k: np.asarray(v) for k, v in dispatches.items()},
                  reads={k: np.asarray(v) for k, v in reads.items()}, compiles=compiles)


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
  """The q-th percentile of `xs` (seconds, NaN ignored) in microseconds."""
  xs = np.asarray(xs, np.float64)
  xs = xs[~np.isnan(xs)]
  return float(np.percentile(xs, q)) * 1e6 if xs.size else float("nan")


def per_request(times: np.ndarray) -> np.ndarray:
  """f64[repeats, num_requests]: each request's total (NaN: rejected)."""
  run = ~np.isnan(times).all(axis=2)
  return np.where(run, np.nansum(times, axis=2), np.nan)


def median_over_runs(x: np.ndarray) -> np.ndarray:
  """The median over the leading (repeats) axis, NaN where every run is NaN."""
  ok = ~np.isnan(x).all(axis=0)
  out = np.full(x.shape[1:], np.nan)
  out[ok] = np.nanmedian(x[:, ok], axis=0)
  return out


def mean_max(counts: np.ndarray) -> str:
  return f"{counts.mean():.2f}/{int(counts.max())}" if counts.size else "-"


def by_kind(counts: dict) -> str:
  parts = [f"{k} {v.mean():.2f}" for k, v in counts.items() if v.size and v.any()]
  return ", ".join(parts) or "none"


def compile_rows() -> list[tuple[str, float, float]]:
  """(label, first request s, cold pass extra s, import s) in fresh processes.

  The first request includes its `flush`: the compile of its commit program.
  """
  import tempfile
  rows = []
  with tempfile.TemporaryDirectory(prefix="paged_kv_jax_cache_") as cache:
    for label, cache_args in (("no persistent cache", ["--nocompile_cache"]),
                              ("persistent cache, empty", [f"--compile_cache_dir={cache}"]),
                              ("persistent cache, filled", [f"--compile_cache_dir={cache}"])):
      cmd = [*shared_flags.rerun_command(__file__), "--compile_only",
             *cache_args, f"--chat_conversations={_CHAT_CONVERSATIONS.value}",
             f"--chat_turns={_CHAT_TURNS.value}", f"--block_size={_BLOCK_SIZE.value}",
             f"--chat_capacity_tokens={_CHAT_CAPACITY.value}", f"--seed={_SEED.value}"]
      out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                           cwd=shared_flags.REPO)
      d = json.loads(out.stdout.strip().splitlines()[-1])
      rows.append((label, d["first_request_s"], d["cold_extra_s"], d["import_s"]))
  return rows


def compile_only() -> None:
  t0 = time.perf_counter()
  # Imported in every row (with the cache or without), so the import column compares.
  import paged_kv.runtime.compile_cache  # pylint: disable=unused-import
  _COMPILE_CACHE.enable()
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
  _COMPILE_CACHE.enable()
  rec = records.Recorder(_RECORD.value, "bench_requests", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  result = {"workloads": [], "hit_rates": [], "compile": []}
  workloads = []
  for w in _WORKLOADS.value:
    if w == "chat":
      reqs = chat_requests(_CHAT_CONVERSATIONS.value, _CHAT_TURNS.value, _SEED.value)
      workloads.append((f"chat {_CHAT_CAPACITY.value // 1000}k", reqs, _CHAT_CAPACITY.value))
    elif w == "mooncake":
      if not os.path.exists(_TRACE.value):
        from paged_kv.sim import traces
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
  measured, hit_rows = [], []
  for label, reqs, cap in workloads:
    print(f"{label}: {len(reqs)} requests, {sum(int(r.prompt.shape[0]) for r in reqs)} prompt "
          f"tokens", flush=True)
    m = measure(reqs, cap, bs, repeats=_REPEATS.value, interleave=_INTERLEAVE.value,
                seed=_SEED.value)
    measured.append((label, m))
    hit_rows.append((label, OURS, m.hit[OURS]))
    hit_rows.append((label, "host: continue tails, block LRU", m.hit[HOST]))
    if _VARIANTS.value:
      for name, kw in (("host: no tail continuation", dict(continue_tails=False)),
                       ("host: whole-leaf eviction", dict(granularity="node")),
                       ("host: both off (before issue L)",
                        dict(continue_tails=False, granularity="node")),
                       ("host: cost policy", dict(policy="cost"))):
        hit_rows.append((label, name, run_host(reqs, cap, bs, **kw)))
  compile_table = compile_rows() if _COMPILE.value else []

  print(f"\nPer request (us, warm; a request's time is its median over {_REPEATS.value} "
        f"runs interleaved with the host's in blocks of {_INTERLEAVE.value}; p50/p99 over "
        "requests)")
  print("ratio = request p50 / host request p50; paired = median over requests of "
        "ours / host; disp/req, reads/req = device dispatches, blocking host reads per "
        "request (mean/max over the timed requests)")
  head = f"{'workload':<14} {'path':<18}" + "".join(f" {op + ' p50/p99':>17}" for op in OPS)
  print(head + f" {'request p50/p99':>19} {'ratio':>6} {'paired':>6} {'disp/req':>8} "
        f"{'reads/req':>9}")
  for label, m in measured:
    ref = median_over_runs(per_request(m.times[HOST]))
    for name in (OURS, HOST):
      t = m.times[name]
      cells = ""
      for j in range(len(OPS)):
        op = median_over_runs(t[:, :, j])
        cells += (f" {pct(op, 50):>8.1f}/{pct(op, 99):<8.1f}" if not np.isnan(op).all()
                  else f" {'-':>8} {'':<8}")
      req = median_over_runs(per_request(t))
      paired = np.nanmedian(req / ref)
      if name == OURS:
        disp = mean_max(sum(m.dispatches.values()))
        reads = mean_max(sum(m.reads.values()))
      else:
        disp = reads = "-"
      print(f"{label:<14} {name:<18}{cells} {pct(req, 50):>9.1f}/{pct(req, 99):<9.1f}"
            f" {pct(req, 50) / pct(ref, 50):>6.2f} {paired:>6.2f} {disp:>8} {reads:>9}")
  print("\nOurs / host per run (request p50 / host request p50 of the same run), and "
        "ours' device traffic by kind (mean per request, all runs)")
  print("(disp>1: share of requests with more than one dispatch: a commit carries at "
        "most `CommitWidths.block_width` touched blocks, and a call whose window passes "
        "4x that flushes at once)")
  print("('mean': ours' total time / the host's over the requests both served, median "
        f"over runs: the amortized cost; ours flushes every {_FLUSH_EVERY.value} request(s))")
  print(f"{'workload':<14} {'ratio by run':<24} {'median':>6} {'mean':>6}  {'dispatches':<14} "
        f"{'disp>1':>7}  {'blocking reads':<16} {'compiles':>8}")
  for label, m in measured:
    ours, host = per_request(m.times[OURS]), per_request(m.times[HOST])
    runs = [pct(o, 50) / pct(h, 50) for o, h in zip(ours, host)]
    both = ~np.isnan(ours) & ~np.isnan(host)
    means = [o[b].sum() / h[b].sum() for o, h, b in zip(ours, host, both)]
    multi = float(np.mean(sum(m.dispatches.values()) > 1)) if m.dispatches else 0.0
    print(f"{label:<14} {' '.join(f'{r:.2f}' for r in runs):<24} {np.median(runs):>6.2f} "
          f"{np.median(means):>6.2f}  {by_kind(m.dispatches):<14} {multi:>7.1%}  "
          f"{by_kind(m.reads):<16} {m.compiles:>8}")
    ops = {}
    for name in (OURS, HOST):
      ops[name] = {op: pct(median_over_runs(m.times[name][:, :, j]), 50)
                   for j, op in enumerate(OPS)}
    result["workloads"].append(dict(
        label=label, ratio_by_run=runs, mean_ratio_by_run=means,
        ours_request_p50_us=pct(median_over_runs(ours), 50),
        host_request_p50_us=pct(median_over_runs(host), 50), op_p50_us=ops,
        dispatches_per_request=float(np.mean(sum(m.dispatches.values()))) if m.dispatches
        else 0.0, multi_dispatch_share=multi,
        blocking_reads_per_request=float(np.mean(sum(m.reads.values()))) if m.reads else 0.0,
        compiles=m.compiles))
  print("\nHit rate at bounded capacity (matched / prompt tokens, same requests)")
  for label, name, hit in hit_rows:
    print(f"{label:<14} {name:<36} {hit:.4f}")
    result["hit_rates"].append(dict(workload=label, path=name, hit_rate=hit))
  if compile_table:
    print("\nCompile time of the serving path (chat workload, fresh processes, s)")
    print(f"{'':<26} {'first request':>14} {'cold extra':>11} {'import':>7}")
    for label, first, extra, imp in compile_table:
      print(f"{label:<26} {first:>14.2f} {extra:>11.2f} {imp:>7.2f}")
      result["compile"].append(dict(cache=label, first_request_s=first, cold_extra_s=extra,
                                    import_s=imp))
  rec.write(result)


if __name__ == "__main__":
  app.run(main)
