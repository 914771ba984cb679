"""Hit rate of N real replica processes behind the router vs one global cache.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_replicas.py                       # N=2,4; 3 slices
  PYTHONPATH=. .venv/bin/python benchmarks/bench_replicas.py --num_requests=200 --offsets=0 --replicas=2
  PYTHONPATH=. .venv/bin/python benchmarks/bench_replicas.py --json_out=/tmp/bench_replicas.json

The requests of a slice of the Mooncake conversation trace (`--num_requests` rows from
each of `--offsets`, arrival times from the slice's first row) go end to end through
`paged_kv.cluster.replicas.ReplicaSet`: real processes, each a `Scheduler` with a
`DryExecutor` on its own `BlockPool` and prefix cache, fed over pipes; the router
(`routing.CacheAwareRouter`, `--load_weight`) probes every replica's cache and
backlog per request. Nothing about the caches is simulated: the hit tokens are what
each scheduler matched at admission.

For each slice and each N of `--replicas` the script runs:

* **global**: one process whose pool holds N x `--capacity_tokens` and which does
  N times one replica's work per step (N x `--max_batch` rows, N x the prefill
  budget): one shared cache in front of N replicas' compute, the comparison
  `benchmarks/replay_routing.py` makes (its `GlobalCache`);
* **routed**: N processes of `--capacity_tokens` each behind the router;
* **sim** (`--sim`): the same two in `replay_routing.py`'s simulation
  (`routing.ReplicaCluster` / `GlobalCache` over prefix caches on host block
  accounting), on the same scaled tokens and capacities, so the real and the
  simulated ratios can be read side by side.

Scale: every length is divided by `--token_scale` (16: a 512-token hash block becomes
32 tokens, two 16-token blocks) so an hour-long trace fits a CPU run, as in
`replay_trace.py --engine`; `--capacity_tokens` is given in trace tokens and scaled
the same way. Time: the trace clock (`ReplicaSpec.clock="trace"`): every scheduler
step is `--step_ms` of trace time and the front end advances every replica to each
request's arrival, so the results do not depend on the machine's load. Compute:
`--cluster_tokens_per_s` trace tokens of prefill per second over the whole cluster
(default 80,000: `replay_routing.py`'s 8 replicas x 10,000), so one replica's prefill
budget per step is `cluster_tokens_per_s / N * step_s / token_scale`; every running
sequence decodes one token per step. Output tokens are unique ids (the trace has
lengths only) and are cached with the prompt when a request finishes, as the
scheduler does (the simulation does the same, `insert_output`).

Hit rate = prompt tokens served from a cache / prompt tokens. The table gives, per
slice and N, both hit rates, their ratio (routed / global), the simulated ratio and
the wall times; then, per N, the median ratio over the slices with [min-max], against
the goal (>= 0.95). `--json_out` writes all of it with the command, flags, git
commit, date, machine and JAX version. The default `--trace` is the Mooncake
conversation trace in `../shared/traces/` beside the repository (from
github.com/kvcache-ai/Mooncake, `FAST25-release/traces/conversation_trace.jsonl`);
the script says so in one line and exits when it is missing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from benchmarks import shared_flags
from paged_kv.core.config import PoolConfig
from paged_kv.sim import traces
from paged_kv.sim.replay import ReplayConfig, ReplayResult, SimState, serve_tokens
from paged_kv.cluster.replicas import ReplicaRequest, ReplicaSet, ReplicaSpec
from paged_kv.cluster.routing import (CacheAwareRouter, GlobalCache, ReplicaCluster,
                                      RoutedRequest, ServeOutcome)
from paged_kv.scheduler.scheduler import SchedulerConfig
from radix.cache import PrefixCache

GOAL = 0.95
DEFAULT_TRACE = shared_flags.default_trace(__file__)

_TRACE = flags.DEFINE_string("trace", DEFAULT_TRACE, "A Mooncake .jsonl trace. Default: the "
                             "Mooncake conversation trace in ../shared/traces/.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 1000, "Requests per slice.")
_OFFSETS = flags.DEFINE_list("offsets", ["0", "4000", "8000"],
                             "First trace row of each slice (one run per slice).")
_REPLICAS = flags.DEFINE_list("replicas", ["2", "4"], "Replica counts N to compare.")
_CAPACITY = flags.DEFINE_integer("capacity_tokens", 1_000_000,
                                 "Cache capacity per replica, in trace tokens (the global "
                                 "cache gets N times this).")
_TOKEN_SCALE = flags.DEFINE_integer("token_scale", 16, "Every length is divided by this.")
_BLOCK_SIZE = shared_flags.define_block_size("Tokens per pool block (after scaling).")
_STEP_MS = flags.DEFINE_float("step_ms", 100.0, "Trace milliseconds per scheduler step.")
_CLUSTER_RATE = flags.DEFINE_float("cluster_tokens_per_s", 80_000.0,
                                   "Prefill trace tokens per second, all replicas together.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 32, "Sequences per step, per replica.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens per sequence per "
                                      "step (one width for every N: one set of programs).")
_LOAD_WEIGHT = flags.DEFINE_float("load_weight", 0.1, "CacheAwareRouter: tokens of cached "
                                  "prefix one token of backlog is worth.")
_OUTPUT_WEIGHT = flags.DEFINE_float("output_weight", 0.0, "Backlog per output token still "
                                     "to come, in prompt tokens (ReplicaSpec.output_weight; "
                                     "the simulation's load model uses the same weight).")
_SIM = flags.DEFINE_bool("sim", True, "Also run the simulation on the same slices.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Replicas compile every serving program before "
                            "the clock starts.")
_REPLY_TIMEOUT = flags.DEFINE_float("reply_timeout_s", 300.0, "A replica silent this long "
                                    "is marked down.")
_START_TIMEOUT = flags.DEFINE_float("start_timeout_s", 900.0, "The longest wait for the "
                                    "replicas to be ready.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
_COMPILE_CACHE = shared_flags.define_compile_cache(
    "Replicas use JAX's persistent compilation cache.")
_FLAG_HOLDERS = (_TRACE, _NUM_REQUESTS, _OFFSETS, _REPLICAS, _CAPACITY, _TOKEN_SCALE,
                 _BLOCK_SIZE, _STEP_MS, _CLUSTER_RATE, _MAX_BATCH, _PREFILL_CHUNK, _LOAD_WEIGHT,
                 _OUTPUT_WEIGHT, _SIM, _WARMUP, _REPLY_TIMEOUT, _START_TIMEOUT, _JSON_OUT,
                 _COMPILE_CACHE.on, _COMPILE_CACHE.dir)


@dataclasses.dataclass(frozen=True)
class Setup:
  """What one slice's runs share: the requests, scaled, and the replica's shapes."""

  offset: int
  rows: list  # TraceRequest, arrival from the slice's start
  requests: list  # ReplicaRequest
  max_segments: int


@dataclasses.dataclass
class Run:
  """One real or simulated run."""

  offset: int
  num_replicas: int
  kind: str  # "global" or "routed"
  num_requests: int
  prompt_tokens: int
  hit_tokens: int
  wall_s: float = 0.0
  start_s: float = 0.0
  rejected: int = 0
  per_replica_requests: tuple = ()
  preemptions: int = 0

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# ----------------------------------------------------------------------------- inputs
def longest_request(rows: list, scale: int) -> int:
  """Scaled prompt + output tokens of the trace's longest request (one pool shape for
  every slice, so the replicas' programs compile once and load from the cache after)."""
  return max(-(-r.input_length // scale) + max(1, -(-r.output_length // scale)) for r in rows)


def make_setup(all_rows: list, offset: int, num: int, scale: int, block_size: int,
               longest: int) -> Setup:
  """Rows `[offset, offset + num)`, rebased to start at 0, as scaled `ReplicaRequest`s."""
  rows = all_rows[offset:offset + num]
  if not rows:
    raise app.UsageError(f"--offsets: {offset} is past the trace's {len(all_rows)} rows")
  t0 = rows[0].arrival_s
  rows = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rows]
  tokens = traces.TokenSource(rows)
  requests = []
  for i, r in enumerate(rows):
    prompt = traces.scaled_prompt(r, tokens, scale)
    out = max(1, -(-r.output_length // scale))
    requests.append(ReplicaRequest(i, prompt, out, arrival_s=r.arrival_s,
                                   forced_output=tokens.unique(out)))
  return Setup(offset, rows, requests, longest // block_size + 8)


def replica_spec(setup: Setup, *, capacity_tokens: int, share: int, num_replicas: int,
                 cache_dir: str | None) -> ReplicaSpec:
  """One process's spec: `share` replicas' worth of capacity and compute (global: N)."""
  scale, bs = _TOKEN_SCALE.value, _BLOCK_SIZE.value
  step_s = _STEP_MS.value / 1000.0
  budget = max(1, round(_CLUSTER_RATE.value / num_replicas * step_s / scale)) * share
  num_blocks = capacity_tokens * share // scale // bs
  max_batch = _MAX_BATCH.value * share
  pool = PoolConfig(num_blocks=num_blocks, block_size=bs, num_layers=1, num_kv_heads=1,
                    head_dim=2, dtype="bfloat16", max_seqs=max_batch,
                    max_segments=setup.max_segments)
  sched = SchedulerConfig(max_batch=max_batch, prefill_token_budget=budget,
                          prefill_chunk=_PREFILL_CHUNK.value, compaction=None, stats_every=0,
                          snapshot_every=0)
  return ReplicaSpec(pool, sched, step_s=step_s, output_weight=_OUTPUT_WEIGHT.value,
                     warmup=_WARMUP.value, compile_cache_dir=cache_dir)


# ----------------------------------------------------------------------------- real
def run_real(setup: Setup, specs: list[ReplicaSpec], kind: str, num_replicas: int) -> Run:
  """Replays the slice through `specs` (one process each) behind the router."""
  router = CacheAwareRouter(load_weight=_LOAD_WEIGHT.value)
  t0 = time.perf_counter()
  with ReplicaSet(specs, router, reply_timeout_s=_REPLY_TIMEOUT.value,
                  start_timeout_s=_START_TIMEOUT.value) as rs:
    t1 = time.perf_counter()
    for request in setup.requests:
      rs.submit(request)
    rs.drain()
    wall = time.perf_counter() - t1
    stats = rs.replica_stats()
    summary = rs.summary()
  if summary.down:
    raise RuntimeError(f"replicas went down during the run: {summary.down}")
  if summary.num_requests != len(setup.requests):
    raise RuntimeError(f"{summary.num_requests} results for {len(setup.requests)} requests")
  counted = sum(s["hit_tokens"] for s in stats.values())
  if counted != summary.hit_tokens:  # the schedulers' own counters must agree
    raise RuntimeError(f"hit tokens: results {summary.hit_tokens} != schedulers {counted}")
  return Run(setup.offset, num_replicas, kind, summary.num_requests, summary.prompt_tokens,
             summary.hit_tokens, wall, t1 - t0, summary.rejected,
             summary.per_replica_requests, sum(s["preemptions"] for s in stats.values()))


# ----------------------------------------------------------------------------- sim
class ScaledSimReplica:
  """A `routing.ReplicaBackend` over `replay.SimState`, fed the scaled token ids.

  `serve` caches the prompt and the request's output (unique ids), as the scheduler
  does when a request finishes.
  """

  def __init__(self, rows: list, capacity_tokens: int):
    self.sim = SimState(rows, ReplayConfig(capacity_tokens=capacity_tokens,
                                           block_size=_BLOCK_SIZE.value))
    self.result = ReplayResult("sim", capacity_tokens)

  @property
  def cache(self) -> PrefixCache:
    return self.sim.cache

  def serve(self, request: RoutedRequest) -> ServeOutcome:
    self.sim.now = request.arrival_s
    r = self.result
    hit, rejected = r.hit_tokens, r.rejected
    tokens = np.concatenate([request.tokens, self.sim.tokens.unique(request.num_output_tokens)])
    serve_tokens(self.sim, request.tokens, tokens, r)
    return ServeOutcome(admitted=r.rejected == rejected, hit_tokens=r.hit_tokens - hit)


def run_sim(setup: Setup, num_replicas: int, kind: str) -> Run:
  """The simulation of `replay_routing.py` on the slice's scaled tokens."""
  scale = _TOKEN_SCALE.value
  cap = _CAPACITY.value // scale
  rate = _CLUSTER_RATE.value / num_replicas / scale
  t0 = time.perf_counter()
  if kind == "global":
    backend = ScaledSimReplica(setup.rows, cap * num_replicas)
    cluster = GlobalCache(backend, num_replicas=num_replicas, tokens_per_s=rate,
                          output_weight=_OUTPUT_WEIGHT.value)
  else:
    backends = [ScaledSimReplica(setup.rows, cap) for _ in range(num_replicas)]
    cluster = ReplicaCluster(backends, CacheAwareRouter(load_weight=_LOAD_WEIGHT.value),
                             tokens_per_s=rate, output_weight=_OUTPUT_WEIGHT.value)
  for q in setup.requests:
    cluster.submit(RoutedRequest(q.prompt, q.arrival_s, q.max_new_tokens))
  st = cluster.stats
  return Run(setup.offset, num_replicas, "sim " + kind, st.num_requests, st.prompt_tokens,
             st.hit_tokens, time.perf_counter() - t0, rejected=st.rejected,
             per_replica_requests=tuple(int(x) for x in st.assigned_requests))


# ----------------------------------------------------------------------------- report
def _ratio(a: Run, b: Run) -> float:
  return a.hit_rate / b.hit_rate if b.hit_rate else float("nan")


def _spread(values: list[float]) -> str:
  if not values:
    return "n/a"
  return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def format_table(pairs: list[tuple]) -> str:
  """Markdown; `pairs` are (global, routed, sim global or None, sim routed or None)."""
  head = ("| slice (first row) | replicas | requests | prompt tokens | global hit rate | "
          "routed hit rate | ratio vs global | sim ratio | global wall (s) | "
          "routed wall (s) | requests per replica |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for g, r, sg, sr in pairs:
    sim = f"{_ratio(sr, sg):.3f}" if sg is not None else "-"
    lines.append(
        f"| {g.offset} | {r.num_replicas} | {r.num_requests:,} | {r.prompt_tokens:,} | "
        f"{g.hit_rate:.4f} | {r.hit_rate:.4f} | {_ratio(r, g):.3f} | {sim} | {g.wall_s:.1f} | "
        f"{r.wall_s:.1f} | {'/'.join(str(x) for x in r.per_replica_requests)} |")
  return "\n".join(lines)


def _git(*args: str) -> str:
  try:
    return subprocess.run(["git", *args], cwd=shared_flags.REPO, capture_output=True, text=True,
                          timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def _machine() -> dict:
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), "")
  except OSError:
    pass
  load = os.getloadavg() if hasattr(os, "getloadavg") else ()
  return dict(platform=platform.platform(), machine=platform.machine(), cpu=model,
              cpu_count=os.cpu_count(), load_average=list(load),
              python=platform.python_version())


def write_json(path: str, pairs: list[tuple], summary: dict, started: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  record = dict(
      command=" ".join([sys.executable] + sys.argv),
      flags={h.name: h.value for h in _FLAG_HOLDERS},
      git_commit=_git("rev-parse", "HEAD"), git_dirty=bool(_git("status", "--porcelain")),
      date=started, finished=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      machine=_machine(), jax_version=jax.__version__,
      runs=[dict(dataclasses.asdict(x), hit_rate=x.hit_rate)
            for pair in pairs for x in pair if x is not None],
      summary=summary)
  with open(path, "w") as f:
    json.dump(record, f, indent=2, default=str)
  print(f"wrote {path}")


# ----------------------------------------------------------------------------- main
def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  started = datetime.datetime.now(datetime.timezone.utc).isoformat()
  path = _TRACE.value
  if not path.endswith(".jsonl"):
    raise app.UsageError(f"routing needs prefix information: a Mooncake .jsonl trace, got {path}")
  try:
    traces.check_trace_files([path])
  except FileNotFoundError as e:
    sys.exit(f"bench_replicas.py: {e}; pass --trace=PATH")
  try:
    offsets = [int(x) for x in _OFFSETS.value]
    replica_counts = [int(x) for x in _REPLICAS.value]
  except ValueError as e:
    raise app.UsageError(f"--offsets and --replicas take integers: {e}") from None
  if any(n < 1 for n in replica_counts) or any(o < 0 for o in offsets):
    raise app.UsageError("--replicas must be >= 1 and --offsets >= 0")
  for name, value in (("num_requests", _NUM_REQUESTS.value), ("token_scale", _TOKEN_SCALE.value),
                      ("block_size", _BLOCK_SIZE.value), ("max_batch", _MAX_BATCH.value),
                      ("prefill_chunk", _PREFILL_CHUNK.value)):
    if value < 1:
      raise app.UsageError(f"--{name} must be >= 1")
  if not (_STEP_MS.value > 0 and _CLUSTER_RATE.value > 0):
    raise app.UsageError("--step_ms and --cluster_tokens_per_s must be > 0")
  cache_dir = _COMPILE_CACHE.directory()
  all_rows = traces.load_trace(path)
  longest = longest_request(all_rows, _TOKEN_SCALE.value)
  print(f"{os.path.basename(path)}: {len(all_rows):,} rows; slices of {_NUM_REQUESTS.value} "
        f"from rows {offsets}; N={replica_counts}; {_CAPACITY.value:,} trace tokens per "
        f"replica; token_scale={_TOKEN_SCALE.value}, step={_STEP_MS.value:g} ms, cluster "
        f"{_CLUSTER_RATE.value:,.0f} tokens/s; load_weight={_LOAD_WEIGHT.value:g}", flush=True)

  pairs = []
  for offset in offsets:
    setup = make_setup(all_rows, offset, _NUM_REQUESTS.value, _TOKEN_SCALE.value,
                       _BLOCK_SIZE.value, longest)
    for n in replica_counts:
      common = dict(capacity_tokens=_CAPACITY.value, num_replicas=n, cache_dir=cache_dir)
      one = replica_spec(setup, share=1, **common)
      largest = max(q.prompt.size + q.max_new_tokens for q in setup.requests)
      if -(-largest // one.pool_config.block_size) + 2 > one.pool_config.num_blocks:
        raise app.UsageError(f"--capacity_tokens: a replica's {one.pool_config.num_blocks} "
                             f"blocks cannot hold the slice's largest request ({largest} "
                             f"scaled tokens)")
      g = run_real(setup, [replica_spec(setup, share=n, **common)], "global", n)
      print(f"slice {offset} N={n} global: hit rate {g.hit_rate:.4f}, {g.wall_s:.1f} s "
            f"(+{g.start_s:.1f} s start)", flush=True)
      r = run_real(setup, [one] * n, "routed", n)
      print(f"slice {offset} N={n} routed: hit rate {r.hit_rate:.4f} "
            f"({_ratio(r, g):.3f} of global), {r.wall_s:.1f} s (+{r.start_s:.1f} s start), "
            f"requests per replica {r.per_replica_requests}", flush=True)
      sg = sr = None
      if _SIM.value:
        sg, sr = run_sim(setup, n, "global"), run_sim(setup, n, "routed")
        print(f"slice {offset} N={n} sim: global {sg.hit_rate:.4f}, routed {sr.hit_rate:.4f} "
              f"({_ratio(sr, sg):.3f})", flush=True)
      pairs.append((g, r, sg, sr))

  print()
  print(format_table(pairs))
  summary = {}
  for n in replica_counts:
    real = [_ratio(r, g) for g, r, _, _ in pairs if r.num_replicas == n]
    sim = [_ratio(sr, sg) for _, _, sg, sr in pairs if sg is not None and sr.num_replicas == n]
    verdict = "met" if real and statistics.median(real) >= GOAL else "NOT met"
    summary[f"N={n}"] = dict(real_ratios=real, sim_ratios=sim,
                             median=statistics.median(real) if real else None,
                             min=min(real, default=None), max=max(real, default=None),
                             goal=GOAL, met=verdict == "met")
    print(f"N={n}: routed / global hit rate, median over {len(real)} slices "
          f"{_spread(real)} (sim {_spread(sim)}); goal >= {GOAL} -> {verdict}")
  if _JSON_OUT.value:
    write_json(_JSON_OUT.value, pairs, summary, started)


if __name__ == "__main__":
  app.run(main)
