"""Replays a Mooncake trace over N data-parallel replicas: routers vs one global cache.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/replay_routing.py                      # 8 replicas, 4 capacities
  PYTHONPATH=. .venv/bin/python benchmarks/replay_routing.py --max_requests=200   # smoke run
  PYTHONPATH=. .venv/bin/python benchmarks/replay_routing.py --num_replicas=8 \
      --capacity_tokens=1000000 --routers=round_robin,cache_aware,prefix_only \
      --tokens_per_s=10000

Every replica is a ``paged_kv.sim.replay.SimReplica`` (a prefix cache over a
capacity-limited ``BlockAccounting`` of ``--capacity_tokens`` tokens, LRU eviction, the
trace's clock). The routers and the load model are ``paged_kv.cluster.routing``; see
its docstring for the routing rule. For each per-replica capacity the script runs:

* ``global_cache``: one cache of ``N x capacity`` tokens that every request sees (its
  compute goes to the least loaded replica): the reference hit rate;
* each router of ``--routers`` over ``N`` independent caches of ``capacity`` tokens:
  ``round_robin``, ``least_load``, ``cache_aware`` (``--load_weight``,
  ``--tie_tokens``) and ``prefix_only`` (cache-aware with load weight 0).

It prints one table: hit rate, ratio to the global cache's hit rate, load imbalance
(max / mean prompt tokens assigned per replica, and the same for work = uncached prompt
+ output tokens), queueing delay in the load model, and cache evictions. With unlimited
capacity the global cache's hit tokens must equal the exact bound computed from the
hash ids (the script fails otherwise). A capacity of 0 means unlimited.

The flags ``--trace``, ``--capacity_tokens`` (here: per replica), ``--block_size``,
``--max_requests``, ``--policy``, ``--insert_output``, ``--namespace`` and
``--progress`` mean what they mean in ``replay_trace.py``. The default ``--trace`` is
the Mooncake conversation trace in ``../shared/traces/`` beside the repository (from
github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/conversation_trace.jsonl``);
the script says so in one line and exits when it is missing.
"""

from __future__ import annotations

import functools
import os
import sys

from absl import app, flags

from benchmarks import records, shared_flags
from paged_kv.sim import replay, traces
from paged_kv.sim.replay import ReplayConfig, SimReplica, replay_cluster
from paged_kv.cluster.routing import (
    CacheAwareRouter,
    ClusterStats,
    GlobalCache,
    LeastLoadRouter,
    ReplicaCluster,
    RoundRobinRouter,
    Router,
)

try:
  import tqdm as _tqdm
except ImportError:  # progress bars are optional
  _tqdm = None

ROUTERS = ("round_robin", "least_load", "cache_aware", "prefix_only")
DEFAULT_TRACE = shared_flags.default_trace(__file__)

_TRACE = flags.DEFINE_string(
    "trace",
    DEFAULT_TRACE,
    "A Mooncake .jsonl trace. Default: the Mooncake conversation trace in "
    "../shared/traces/ beside the repository.",
)
_CAPACITY = flags.DEFINE_list(
    "capacity_tokens",
    ["500000", "1000000", "3000000", "0"],
    "Capacities per replica in tokens (comma-separated); 0 = unlimited.",
)
_BLOCK_SIZE = shared_flags.define_block_size("Tokens per pool block.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 0, "Replay only the first N (0 = all).")
_POLICY = flags.DEFINE_enum("policy", "lru", ["lru", "cost"], "Eviction policy.")
_INSERT_OUTPUT = flags.DEFINE_bool(
    "insert_output", False, "Also cache each request's output tokens (unique ids)."
)
_PROGRESS = shared_flags.define_progress()
_NAMESPACE = flags.DEFINE_string("namespace", "default", "Cache namespace of all requests.")
_NUM_REPLICAS = flags.DEFINE_integer("num_replicas", 8, "Data-parallel replicas N.")
_ROUTERS = flags.DEFINE_list(
    "routers", ["round_robin", "least_load", "cache_aware"], f"Routers to compare, from {ROUTERS}."
)
_TOKENS_PER_S = flags.DEFINE_float(
    "tokens_per_s",
    10000.0,
    "Load model: tokens of work (uncached prompt + output) one replica does per second.",
)
_OUTPUT_WEIGHT = flags.DEFINE_float(
    "output_weight", 1.0, "Load model: work per output token, in prompt tokens."
)
_LOAD_WEIGHT = flags.DEFINE_list(
    "load_weight",
    ["0.1", "1.0"],
    "cache_aware: tokens of cached prefix worth one token of backlog; one cache_aware "
    "row per value (comma-separated).",
)
_TIE_TOKENS = flags.DEFINE_float(
    "tie_tokens", 0.0, "cache_aware: score tolerance for near-ties (tokens)."
)
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()


def make_routers(name: str, *, load_weights: list[float], tie_tokens: float) -> list[Router]:
  """Builds the router(s) of one ``--routers`` entry (one of ``ROUTERS``).

  ``cache_aware`` gives one router per load weight, named ``cache_aware w=<weight>``.
  """
  if name == "round_robin":
    return [RoundRobinRouter()]
  if name == "least_load":
    return [LeastLoadRouter()]
  if name == "cache_aware":
    return [
        CacheAwareRouter(load_weight=w, tie_tokens=tie_tokens, name=f"cache_aware w={w:g}")
        for w in load_weights
    ]
  if name == "prefix_only":
    return [CacheAwareRouter(load_weight=0.0, tie_tokens=tie_tokens, name="prefix_only")]
  raise ValueError(f"unknown router {name!r}; choose from {ROUTERS}")


def _progress(desc: str):
  """A progress-bar wrapper for the replays, or None."""
  if _PROGRESS.value and _tqdm is not None:
    return functools.partial(_tqdm.tqdm, desc=desc, unit="req", mininterval=1.0, leave=False)
  return None


def run_capacity(
    requests: list[traces.TraceRequest],
    capacity: int,
    *,
    num_replicas: int,
    routers: list[str],
    load_weights: list[float],
    base_config: dict,
    bound_hit: int,
) -> list[tuple]:
  """Global cache plus every router at one per-replica capacity (0 = unlimited)."""
  ns = base_config["namespace"]
  load = dict(tokens_per_s=_TOKENS_PER_S.value, output_weight=_OUTPUT_WEIGHT.value)
  shared = SimReplica(
      requests,
      ReplayConfig(capacity_tokens=capacity * num_replicas, label="global_cache", **base_config),
  )
  global_cluster = GlobalCache(shared, num_replicas=num_replicas, **load)
  wall = replay_cluster(
      global_cluster, requests, [shared], namespace=ns, progress=_progress("global_cache")
  )
  global_stats = global_cluster.stats
  if capacity == 0 and global_stats.rejected == 0 and global_stats.hit_tokens != bound_hit:
    raise SystemExit(
        f"unlimited global cache hit {global_stats.hit_tokens} tokens != "
        f"exact bound {bound_hit}"
    )
  rows = [(capacity, global_stats, wall)]
  _print_run(capacity, global_stats, global_stats, wall)
  all_routers = [
      r
      for name in routers
      for r in make_routers(name, load_weights=load_weights, tie_tokens=_TIE_TOKENS.value)
  ]
  for router in all_routers:
    backends = [
        SimReplica(
            requests,
            ReplayConfig(capacity_tokens=capacity, label=f"{router.name}[{i}]", **base_config),
        )
        for i in range(num_replicas)
    ]
    cluster = ReplicaCluster(backends, router, **load)
    wall = replay_cluster(
        cluster, requests, backends, namespace=ns, progress=_progress(router.name)
    )
    stats = cluster.stats
    rows.append((capacity, stats, wall))
    _print_run(capacity, stats, global_stats, wall)
  return [(cap, st, global_stats, wall) for cap, st, wall in rows]


def _ratio(stats: ClusterStats, reference: ClusterStats) -> float:
  return stats.hit_rate / reference.hit_rate if reference.hit_rate else float("nan")


def _cap_text(capacity: int) -> str:
  return "unlimited" if capacity == 0 else f"{capacity:,}"


def _print_run(capacity: int, stats: ClusterStats, reference: ClusterStats, wall: float) -> None:
  print(
      f"capacity/replica={_cap_text(capacity)} {stats.name}: hit rate "
      f"{stats.hit_rate:.4f} ({_ratio(stats, reference):.3f} of global), token "
      f"imbalance {stats.token_imbalance:.2f}, evicted {stats.evicted_tokens:,} tokens, "
      f"{wall:.1f} s",
      flush=True,
  )


def format_table(rows: list[tuple], num_replicas: int) -> str:
  """Markdown table; rows are (capacity per replica, stats, global stats, wall s)."""
  head = (
      "| capacity / replica (tokens) | global capacity | router | hit rate | "
      "ratio to global | imbalance: tokens (max/mean) | imbalance: work (max/mean) | "
      "wait p50 / p99 (s) | evicted tokens | rejected | wall (s) |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for cap, st, ref, wall in rows:
    glob = _cap_text(cap * num_replicas)
    lines.append(
        f"| {_cap_text(cap)} | {glob} | {st.name} | {st.hit_rate:.4f} | "
        f"{_ratio(st, ref):.3f} | {st.token_imbalance:.2f} | {st.work_imbalance:.2f} | "
        f"{st.wait_percentile(50):.2f} / {st.wait_percentile(99):.2f} | "
        f"{st.evicted_tokens:,} | {st.rejected} | {wall:.1f} |"
    )
  return "\n".join(lines)


def parse_capacities(values: list[str]) -> list[int]:
  """``--capacity_tokens`` as ints >= 0 (0 = unlimited); a usage error otherwise."""
  try:
    return replay.parse_capacities(values)
  except ValueError as e:
    raise app.UsageError(f"--capacity_tokens: {e}") from None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _COMPILE_CACHE.enable()
  path = _TRACE.value
  if not path.endswith(".jsonl"):
    raise app.UsageError(f"routing needs prefix information: a Mooncake .jsonl trace, got {path}")
  try:
    traces.check_trace_files([path])
  except FileNotFoundError as e:
    sys.exit(f"replay_routing.py: {e}; pass --trace=PATH")
  capacities = parse_capacities(_CAPACITY.value)
  if _NUM_REPLICAS.value < 1:
    raise app.UsageError("--num_replicas must be >= 1")
  unknown = [r for r in _ROUTERS.value if r not in ROUTERS]
  if unknown:
    raise app.UsageError(f"unknown --routers {unknown}; choose from {ROUTERS}")
  try:
    load_weights = [float(w) for w in _LOAD_WEIGHT.value]
  except ValueError as e:
    raise app.UsageError(f"--load_weight must be numbers: {e}") from None
  if not load_weights or any(not w >= 0 for w in load_weights):
    raise app.UsageError("--load_weight needs values >= 0")
  if not _TOKENS_PER_S.value > 0:
    raise app.UsageError("--tokens_per_s must be > 0")
  if _BLOCK_SIZE.value < 1:
    raise app.UsageError("--block_size must be >= 1")

  rec = records.Recorder(_RECORD.value, "replay_routing", flag_values=records.script_flags())
  requests = traces.load_trace(path, _MAX_REQUESTS.value)
  bound_hit, bound_total = traces.exact_hit_bound(requests)
  print(
      f"{os.path.basename(path)}: {len(requests):,} requests, "
      f"{bound_total:,} prompt tokens, exact unlimited hit rate "
      f"{bound_hit / max(bound_total, 1):.4f}; N={_NUM_REPLICAS.value}, "
      f"tokens_per_s={_TOKENS_PER_S.value:g}, load_weight={load_weights}, "
      f"tie_tokens={_TIE_TOKENS.value:g}",
      flush=True,
  )
  base_config = dict(
      block_size=_BLOCK_SIZE.value,
      policy=_POLICY.value,
      insert_output=_INSERT_OUTPUT.value,
      namespace=_NAMESPACE.value,
  )
  rows = []
  for cap in capacities:
    rows.extend(
        run_capacity(
            requests,
            cap,
            num_replicas=_NUM_REPLICAS.value,
            routers=list(_ROUTERS.value),
            load_weights=load_weights,
            base_config=base_config,
            bound_hit=bound_hit,
        )
    )
  print()
  print(format_table(rows, _NUM_REPLICAS.value))
  for cap, st, ref, _ in rows:
    if st.name.startswith("cache_aware"):
      ratio = _ratio(st, ref)
      verdict = "met" if ratio >= 0.9 else "NOT met"
      print(
          f"goal (cache_aware >= 0.90 of global) at {_cap_text(cap)} tokens per "
          f"replica, {st.name}: {ratio:.3f} -> {verdict}"
      )
  rec.write({"trace": os.path.basename(path), "requests": len(requests),
             "exact_bound": bound_hit / max(bound_total, 1), "num_replicas": _NUM_REPLICAS.value,
             "rows": [dict(capacity_per_replica=cap, router=st.name, hit_rate=st.hit_rate,
                           global_hit_rate=ref.hit_rate, ratio_to_global=_ratio(st, ref),
                           token_imbalance=st.token_imbalance, work_imbalance=st.work_imbalance,
                           wait_p50_s=st.wait_percentile(50), wait_p99_s=st.wait_percentile(99),
                           evicted_tokens=st.evicted_tokens, rejected=st.rejected, wall_s=wall)
                      for cap, st, ref, wall in rows]})


if __name__ == "__main__":
  app.run(main)
