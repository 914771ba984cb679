"""Replays a Mooncake trace over N data-parallel replicas: routers vs one global cache.

Usage:
  .venv/bin/python examples/replay_routing.py                      # 8 replicas, 4 capacities
  .venv/bin/python examples/replay_routing.py --max_requests=200   # smoke run
  .venv/bin/python examples/replay_routing.py --num_replicas=8 \
      --capacity_tokens=1000000 --routers=round_robin,cache_aware,prefix_only \
      --tokens_per_s=10000

Every replica is ``examples/replay_trace.py``'s simulation (``SimState`` +
``serve_request``: a prefix cache over a capacity-limited ``HostBlockPool`` of
``--capacity_tokens`` tokens, LRU eviction, the trace's clock). The routers and the
load model are ``paged_kv.serving.routing``; see its docstring for the routing rule. For each
per-replica capacity the script runs:

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
``--progress`` are ``replay_trace.py``'s own, shared by import.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import numpy as np
from absl import app, flags

_EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_EXAMPLES))
sys.path.insert(0, _EXAMPLES)

import replay_trace  # noqa: E402  (defines the shared replay flags)
from replay_trace import (
    ReplayConfig,
    ReplayResult,
    Request,
    SimState,
    TokenSource,  # noqa: E402
    exact_hit_bound,
    load_trace,
    serve_request,
)

from paged_kv.serving.routing import (
    CacheAwareRouter,
    ClusterStats,
    GlobalCache,  # noqa: E402
    LeastLoadRouter,
    ReplicaCluster,
    RoundRobinRouter,
    RoutedRequest,
    Router,
    ServeOutcome,
)
from radix.cache import PrefixCache  # noqa: E402

ROUTERS = ("round_robin", "least_load", "cache_aware", "prefix_only")
_DEFAULT_CAPACITIES = ["500000", "1000000", "3000000", "0"]

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

flags.FLAGS.set_default("capacity_tokens", _DEFAULT_CAPACITIES)


class SimReplica:
  """A ``paged_kv.serving.routing.ReplicaBackend`` over ``replay_trace``'s simulation.

  ``serve`` runs ``replay_trace.serve_request`` on the request's trace row
  (``RoutedRequest.payload``) and reports what changed in its ``ReplayResult``.
  """

  def __init__(self, requests: list[Request], config: ReplayConfig):
    self.sim = SimState(requests, config)
    self.result = ReplayResult(config.label, config.capacity_tokens)

  @property
  def cache(self) -> PrefixCache:
    return self.sim.cache

  def serve(self, request: RoutedRequest) -> ServeOutcome:
    if not isinstance(request.payload, Request):
      raise TypeError("SimReplica needs the trace Request as RoutedRequest.payload")
    if request.namespace != self.sim.config.namespace:
      raise ValueError(
          f"namespace {request.namespace!r} != replica namespace " f"{self.sim.config.namespace!r}"
      )
    r = self.result
    hit, rejected, ev_tokens, ev_nodes = (
        r.hit_tokens,
        r.rejected,
        r.evicted_tokens,
        r.evicted_nodes,
    )
    serve_request(self.sim, request.payload, r)
    return ServeOutcome(
        admitted=r.rejected == rejected,
        hit_tokens=r.hit_tokens - hit,
        evicted_tokens=r.evicted_tokens - ev_tokens,
        evicted_nodes=r.evicted_nodes - ev_nodes,
    )

  def check_accounting(self) -> None:
    """Raises if the pool's ref counts drifted from the cache's references."""
    pool = self.sim.pool
    if not np.array_equal(self.sim.cache.tree_ref_counts(pool.num_blocks), pool.ref_count):
      raise RuntimeError("pool ref_count != cache segment references after replay")


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


def routed_requests(
    requests: list[Request], namespace: str, *, progress: bool = False, desc: str = ""
) -> Iterator[RoutedRequest]:
  """Expands trace rows into token ids lazily (the whole trace is ~580 MB of tokens)."""
  source = TokenSource(requests)
  for r in replay_trace._progress(requests, progress, desc):
    yield RoutedRequest(
        tokens=source.prompt(r),
        arrival_s=r.arrival_s,
        num_output_tokens=r.output_length,
        namespace=namespace,
        payload=r,
    )


def run_cluster(
    cluster: ReplicaCluster | GlobalCache,
    requests: list[Request],
    backends: list[SimReplica],
    *,
    namespace: str,
    progress: bool,
) -> tuple[ClusterStats, float]:
  """Submits every request; returns the statistics and the wall time (s)."""
  t0 = time.perf_counter()
  for request in routed_requests(requests, namespace, progress=progress, desc=cluster.stats.name):
    cluster.submit(request)
  for backend in backends:
    backend.check_accounting()
  return cluster.stats, time.perf_counter() - t0


def run_capacity(
    requests: list[Request],
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
  progress = base_config["progress"]
  shared = SimReplica(
      requests,
      ReplayConfig(capacity_tokens=capacity * num_replicas, label="global_cache", **base_config),
  )
  global_cluster = GlobalCache(shared, num_replicas=num_replicas, **load)
  global_stats, wall = run_cluster(
      global_cluster, requests, [shared], namespace=ns, progress=progress
  )
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
    stats, wall = run_cluster(cluster, requests, backends, namespace=ns, progress=progress)
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


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  fl = flags.FLAGS
  if len(fl.trace) != 1:
    raise app.UsageError(f"--trace takes exactly one trace here, got {fl.trace}")
  capacities = replay_trace.parse_capacities(fl.capacity_tokens)
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
  if fl.block_size < 1:
    raise app.UsageError("--block_size must be >= 1")
  path = fl.trace[0]
  if not path.endswith(".jsonl"):
    raise app.UsageError(
        f"routing needs prefix information: a Mooncake .jsonl trace, " f"got {path}"
    )

  requests = load_trace(path, fl.max_requests)
  bound_hit, bound_total = exact_hit_bound(requests)
  print(
      f"{os.path.basename(path)}: {len(requests):,} requests, "
      f"{bound_total:,} prompt tokens, exact unlimited hit rate "
      f"{bound_hit / max(bound_total, 1):.4f}; N={_NUM_REPLICAS.value}, "
      f"tokens_per_s={_TOKENS_PER_S.value:g}, load_weight={load_weights}, "
      f"tie_tokens={_TIE_TOKENS.value:g}",
      flush=True,
  )
  base_config = dict(
      block_size=fl.block_size,
      policy=fl.policy,
      insert_output=fl.insert_output,
      namespace=fl.namespace,
      progress=fl.progress,
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


if __name__ == "__main__":
  app.run(main)
