"""Data-parallel replicas and cache-aware request routing (host side; numpy + radix).

A data-parallel deployment runs ``N`` independent replicas, each with its own block pool
and prefix cache. A router picks, for every request, the replica that serves it. This
module holds the routing decisions and a small cluster simulation around them; it uses
no JAX (importing it through ``paged_kv`` still loads the package's JAX modules).

Replicas
--------
A replica is anything with a ``cache`` (a ``radix.PrefixCache``) and a
``serve(request) -> ServeOutcome`` method that matches, allocates (evicting under
capacity pressure), inserts and releases the request on its own pool: see
``ReplicaBackend``. The trace replays use ``paged_kv.sim.replay.SimReplica``
(``SimState`` and ``serve_request`` over a capacity-limited ``HostBlockPool``); a serving
deployment would wrap a ``Scheduler``. The router only *reads* a replica's cache, with a
probe ``cache.match(namespace, tokens, lock=False, record=False)`` that changes neither
hit statistics, access times (LRU order) nor locks.

Load model
----------
Each replica is one FIFO server that works through ``tokens_per_s`` tokens of work per
second of trace time (``ReplicaLoad``). A request's work is its uncached prompt tokens
(prefill) plus ``output_weight`` times its output tokens (decode). The replica's *load*
at time ``t`` is its backlog: work assigned and not yet done,
``backlog(t) = max(0, backlog(t0) - tokens_per_s * (t - t0))`` plus each new request's
work. A request's queueing delay is ``backlog / tokens_per_s`` at its arrival. The
model ignores batching and memory; it is there so that "balanced by load" means
something: sending every request of a hot prefix to one replica makes its queue grow.

Routers
-------
* ``RoundRobinRouter``: replica ``i mod N`` for the ``i``-th request (no probe).
* ``LeastLoadRouter``: the smallest backlog (no probe); ties rotate.
* ``CacheAwareRouter(load_weight, tie_tokens)``: probes every replica and picks

      argmax_i  matched_i - load_weight * backlog_i        (both in tokens)

  Scores within ``tie_tokens`` of the best are near-ties; among them the smallest
  backlog wins, then rotation. A request whose prefix no replica holds beyond what all
  of them hold (e.g. only the shared system prompt) therefore goes to the least loaded
  replica, and a session sticks to the replica holding its history until that
  replica's backlog exceeds the history's length divided by ``load_weight``.

  Choosing ``load_weight``: with ``load_weight = 1`` the rule minimizes the request's
  own finish time in the load model (on replica ``i`` it waits ``backlog_i`` and
  computes ``L - matched_i`` tokens). That is myopic: a prefix kept on its replica
  also serves the session's later turns, and a request moved away duplicates its
  history on a second replica. On the Mooncake conversation trace (8 replicas, 1M
  tokens each, 10k tokens/s each) ``load_weight = 1`` reaches 0.85 of the global
  cache's hit rate and ``0.1`` reaches 0.98, for a p99 queueing delay of 2.8 s instead
  of 1.6 s (median 0 for both); so the default is ``0.1``.
  ``load_weight = 0`` is pure longest-prefix routing and collapses: once one replica
  holds the shared system prompt, every new session matches there and nowhere else.

Baseline
--------
``GlobalCache``: one cache of the total capacity (the backend is built with ``N`` times
one replica's capacity) shared by ``N`` compute replicas, as in Mooncake's global KV
store; every request sees the whole cache, and compute goes to the least loaded
replica. Its hit rate is what the routers are measured against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from radix.cache import PrefixCache

__all__ = [
    "CacheAwareRouter",
    "ClusterStats",
    "GlobalCache",
    "LeastLoadRouter",
    "ReplicaBackend",
    "ReplicaCluster",
    "ReplicaLoad",
    "ReplicaView",
    "RoundRobinRouter",
    "RouteDecision",
    "RoutedRequest",
    "Router",
    "ServeOutcome",
    "load_imbalance",
]


@dataclasses.dataclass(frozen=True)
class RoutedRequest:
  """One request as the router and the replicas see it.

  Attributes:
    tokens: int32[n] prompt token ids (what the probe matches).
    arrival_s: arrival time in seconds; non-decreasing across a cluster's requests.
    num_output_tokens: tokens the request will generate (decode work).
    namespace: cache namespace of the request.
    payload: opaque, passed unchanged to ``ReplicaBackend.serve`` (e.g. the trace row).
  """

  tokens: np.ndarray
  arrival_s: float
  num_output_tokens: int = 0
  namespace: Hashable = "default"
  payload: Any = None

  @property
  def num_prompt_tokens(self) -> int:
    return int(self.tokens.shape[0])


@dataclasses.dataclass(frozen=True)
class ServeOutcome:
  """What serving one request did to a replica.

  Attributes:
    admitted: False when the request could not fit even with an empty cache.
    hit_tokens: prompt tokens served from the replica's cache (0 when not admitted).
    evicted_tokens: tokens the replica's cache evicted to make room.
    evicted_nodes: cache nodes evicted to make room.
  """

  admitted: bool
  hit_tokens: int
  evicted_tokens: int = 0
  evicted_nodes: int = 0


@runtime_checkable
class ReplicaBackend(Protocol):
  """One replica's prefix cache plus capacity-limited block accounting."""

  @property
  def cache(self) -> PrefixCache:
    """The replica's prefix cache (the router probes it read-only)."""
    ...

  def serve(self, request: RoutedRequest) -> ServeOutcome:
    """Matches, allocates (evicting as needed), inserts and releases ``request``."""
    ...


# ----------------------------------------------------------------------------- load
class ReplicaLoad:
  """Backlog of one replica: a FIFO server doing ``tokens_per_s`` tokens of work per s.

  Args:
    tokens_per_s: service rate, tokens of work per second (> 0).
  """

  def __init__(self, tokens_per_s: float):
    if not tokens_per_s > 0:
      raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s!r}")
    self.tokens_per_s = float(tokens_per_s)
    self.backlog_tokens = 0.0
    self.now_s = 0.0

  def advance(self, now_s: float) -> None:
    """Drains the backlog up to time ``now_s`` (which must not go backwards)."""
    if now_s < self.now_s:
      raise ValueError(f"time went backwards: {now_s} < {self.now_s}")
    drained = self.tokens_per_s * (now_s - self.now_s)
    self.backlog_tokens = max(0.0, self.backlog_tokens - drained)
    self.now_s = float(now_s)

  def add(self, work_tokens: float) -> float:
    """Queues ``work_tokens``; returns the queueing delay (s) of that work."""
    if work_tokens < 0:
      raise ValueError(f"work_tokens must be >= 0, got {work_tokens!r}")
    wait_s = self.backlog_tokens / self.tokens_per_s
    self.backlog_tokens += float(work_tokens)
    return wait_s


# ----------------------------------------------------------------------------- routers
@dataclasses.dataclass(frozen=True)
class ReplicaView:
  """What a router sees of one replica when it routes a request.

  Attributes:
    index: replica index in ``[0, N)``.
    matched_tokens: cached prefix length of the request on this replica (0 when the
      router does not probe).
    backlog_tokens: outstanding work of the replica (``ReplicaLoad``).
  """

  index: int
  matched_tokens: int
  backlog_tokens: float


class Router(Protocol):
  """Picks a replica for each request.

  Attributes:
    name: label used in reports.
    needs_probe: True when ``choose`` reads ``ReplicaView.matched_tokens`` (the
      cluster then probes every replica's cache; otherwise it does not).
  """

  name: str
  needs_probe: bool

  def choose(self, request: RoutedRequest, views: Sequence[ReplicaView]) -> int:
    """Returns the index of the replica that serves ``request``."""
    ...


class _Rotation:
  """Deterministic tie-breaking: the first candidate at or after a rotating pointer."""

  def __init__(self):
    self._next = 0

  def pick(self, candidates: np.ndarray, num_replicas: int) -> int:
    order = (candidates - self._next) % num_replicas
    chosen = int(candidates[int(np.argmin(order))])
    self._next = (chosen + 1) % num_replicas
    return chosen


class RoundRobinRouter:
  """Replica ``i mod N`` for the ``i``-th request; ignores caches and load."""

  needs_probe = False

  def __init__(self, name: str = "round_robin"):
    self.name = name
    self._count = 0

  def choose(self, request: RoutedRequest, views: Sequence[ReplicaView]) -> int:
    del request
    _check_views(views)
    index = self._count % len(views)
    self._count += 1
    return index


class LeastLoadRouter:
  """The replica with the smallest backlog; ties rotate. Ignores caches."""

  needs_probe = False

  def __init__(self, name: str = "least_load"):
    self.name = name
    self._rotation = _Rotation()

  def choose(self, request: RoutedRequest, views: Sequence[ReplicaView]) -> int:
    del request
    _check_views(views)
    backlog = np.array([v.backlog_tokens for v in views], np.float64)
    return self._rotation.pick(np.flatnonzero(backlog == backlog.min()), len(views))


class CacheAwareRouter:
  """Longest cached prefix across replicas, balanced by load.

  Picks ``argmax_i matched_i - load_weight * backlog_i`` (tokens); scores within
  ``tie_tokens`` of the best are near-ties, resolved by the smallest backlog and then
  by rotation. See the module docstring for the choice of ``load_weight``.

  Args:
    load_weight: tokens of cached prefix one token of backlog is worth (>= 0);
      0 routes by prefix alone (ties by load).
    tie_tokens: score tolerance (tokens, >= 0) under which replicas count as tied.
    name: label used in reports.
  """

  needs_probe = True

  def __init__(
      self, *, load_weight: float = 0.1, tie_tokens: float = 0.0, name: str = "cache_aware"
  ):
    if not load_weight >= 0:
      raise ValueError(f"load_weight must be >= 0, got {load_weight!r}")
    if not tie_tokens >= 0:
      raise ValueError(f"tie_tokens must be >= 0, got {tie_tokens!r}")
    self.load_weight = float(load_weight)
    self.tie_tokens = float(tie_tokens)
    self.name = name
    self._rotation = _Rotation()

  def scores(self, views: Sequence[ReplicaView]) -> np.ndarray:
    """float64[N]: ``matched - load_weight * backlog`` per replica."""
    matched = np.array([v.matched_tokens for v in views], np.float64)
    backlog = np.array([v.backlog_tokens for v in views], np.float64)
    return matched - self.load_weight * backlog

  def choose(self, request: RoutedRequest, views: Sequence[ReplicaView]) -> int:
    del request
    _check_views(views)
    score = self.scores(views)
    near = np.flatnonzero(score >= score.max() - self.tie_tokens)
    backlog = np.array([views[i].backlog_tokens for i in near], np.float64)
    return self._rotation.pick(near[backlog == backlog.min()], len(views))


def _check_views(views: Sequence[ReplicaView]) -> None:
  if not views:
    raise ValueError("a router needs at least one replica")


# ----------------------------------------------------------------------------- clusters
@dataclasses.dataclass(frozen=True)
class RouteDecision:
  """Where one request went and what it got.

  Attributes:
    replica: compute replica that served the request.
    matched_tokens: int64[N] probe results at routing time (zeros without a probe).
    outcome: what the serving cache did.
    wait_s: queueing delay in the load model.
  """

  replica: int
  matched_tokens: np.ndarray
  outcome: ServeOutcome
  wait_s: float


def load_imbalance(values: np.ndarray) -> float:
  """max / mean of per-replica totals (1.0 = perfectly even; 1.0 when all are 0)."""
  values = np.asarray(values, np.float64)
  mean = float(values.mean()) if values.size else 0.0
  return float(values.max()) / mean if mean > 0 else 1.0


@dataclasses.dataclass
class ClusterStats:
  """Totals of a cluster run.

  Attributes:
    name: router (or baseline) label.
    num_replicas: compute replicas N.
    num_requests, rejected: requests seen, requests that did not fit.
    prompt_tokens, hit_tokens: prompt tokens seen and served from a cache.
    evicted_tokens, evicted_nodes: summed over the caches.
    assigned_tokens: int64[N] prompt tokens routed to each replica.
    assigned_requests: int64[N] requests routed to each replica.
    work_tokens: float64[N] work (load model) done by each replica.
    waits_s: queueing delay of every admitted request.
  """

  name: str
  num_replicas: int
  assigned_tokens: np.ndarray
  assigned_requests: np.ndarray
  work_tokens: np.ndarray
  num_requests: int = 0
  rejected: int = 0
  prompt_tokens: int = 0
  hit_tokens: int = 0
  evicted_tokens: int = 0
  evicted_nodes: int = 0
  waits_s: list[float] = dataclasses.field(default_factory=list)

  @staticmethod
  def empty(name: str, num_replicas: int) -> ClusterStats:
    """Zeroed statistics for ``num_replicas`` replicas."""
    return ClusterStats(
        name,
        num_replicas,
        np.zeros(num_replicas, np.int64),
        np.zeros(num_replicas, np.int64),
        np.zeros(num_replicas, np.float64),
    )

  @property
  def hit_rate(self) -> float:
    """Token hit rate: cached prompt tokens / prompt tokens."""
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def token_imbalance(self) -> float:
    """max / mean of prompt tokens assigned per replica."""
    return load_imbalance(self.assigned_tokens)

  @property
  def work_imbalance(self) -> float:
    """max / mean of work (uncached prompt + weighted output tokens) per replica."""
    return load_imbalance(self.work_tokens)

  def wait_percentile(self, q: float) -> float:
    """Queueing delay percentile (s); NaN before any admitted request."""
    return float(np.percentile(self.waits_s, q)) if self.waits_s else float("nan")


class _ClusterBase:
  """Shared bookkeeping: loads, time order, statistics."""

  def __init__(self, name: str, num_replicas: int, *, tokens_per_s: float, output_weight: float):
    if num_replicas < 1:
      raise ValueError(f"need at least one replica, got {num_replicas}")
    if not output_weight >= 0:
      raise ValueError(f"output_weight must be >= 0, got {output_weight!r}")
    self.loads = [ReplicaLoad(tokens_per_s) for _ in range(num_replicas)]
    self.output_weight = float(output_weight)
    self.stats = ClusterStats.empty(name, num_replicas)
    self._now_s = float("-inf")

  @property
  def num_replicas(self) -> int:
    return len(self.loads)

  def _start(self, request: RoutedRequest) -> None:
    if request.arrival_s < self._now_s:
      raise ValueError(
          f"requests must arrive in time order: {request.arrival_s} " f"after {self._now_s}"
      )
    self._now_s = request.arrival_s
    for load in self.loads:
      load.advance(request.arrival_s)

  def _finish(
      self, request: RoutedRequest, replica: int, matched: np.ndarray, outcome: ServeOutcome
  ) -> RouteDecision:
    st = self.stats
    st.num_requests += 1
    st.prompt_tokens += request.num_prompt_tokens
    st.evicted_tokens += outcome.evicted_tokens
    st.evicted_nodes += outcome.evicted_nodes
    wait_s = 0.0
    if outcome.admitted:
      st.hit_tokens += outcome.hit_tokens
      st.assigned_tokens[replica] += request.num_prompt_tokens
      st.assigned_requests[replica] += 1
      work = (
          request.num_prompt_tokens
          - outcome.hit_tokens
          + self.output_weight * request.num_output_tokens
      )
      st.work_tokens[replica] += work
      wait_s = self.loads[replica].add(work)
      st.waits_s.append(wait_s)
    else:
      st.rejected += 1
    return RouteDecision(replica, matched, outcome, wait_s)


class ReplicaCluster(_ClusterBase):
  """``N`` independent replicas (one cache each) behind a router.

  Args:
    backends: the replicas, one ``ReplicaBackend`` each.
    router: picks the replica of every request.
    tokens_per_s: service rate of one replica (load model).
    output_weight: work per output token, in prompt-token units.
  """

  def __init__(
      self,
      backends: Sequence[ReplicaBackend],
      router: Router,
      *,
      tokens_per_s: float,
      output_weight: float = 1.0,
  ):
    super().__init__(
        router.name, len(backends), tokens_per_s=tokens_per_s, output_weight=output_weight
    )
    for i, b in enumerate(backends):
      if not isinstance(b, ReplicaBackend):
        raise TypeError(f"backend {i} has no cache/serve: {type(b).__name__}")
    self.backends = list(backends)
    self.router = router

  def probe(self, request: RoutedRequest) -> np.ndarray:
    """int64[N]: cached prefix of ``request`` on every replica (read-only)."""
    return np.array(
        [
            b.cache.match(request.namespace, request.tokens, lock=False, record=False).length
            for b in self.backends
        ],
        np.int64,
    )

  def submit(self, request: RoutedRequest) -> RouteDecision:
    """Routes and serves one request (requests must come in arrival order)."""
    self._start(request)
    n = self.num_replicas
    matched = self.probe(request) if self.router.needs_probe else np.zeros(n, np.int64)
    views = [ReplicaView(i, int(matched[i]), self.loads[i].backlog_tokens) for i in range(n)]
    replica = self.router.choose(request, views)
    if not (isinstance(replica, (int, np.integer)) and 0 <= replica < n):
      raise ValueError(
          f"router {self.router.name!r} chose replica {replica!r}, " f"not in [0, {n})"
      )
    replica = int(replica)
    outcome = self.backends[replica].serve(request)
    return self._finish(request, replica, matched, outcome)


class GlobalCache(_ClusterBase):
  """Baseline: one shared cache of the total capacity and ``N`` compute replicas.

  Every request is served by ``backend`` (build it with ``N`` times one replica's
  capacity); its compute goes to the least loaded replica (ties rotate).

  Args:
    backend: the single, shared cache and its block accounting.
    num_replicas: compute replicas N.
    tokens_per_s, output_weight: load model, as in ``ReplicaCluster``.
    name: label used in reports.
  """

  def __init__(
      self,
      backend: ReplicaBackend,
      *,
      num_replicas: int,
      tokens_per_s: float,
      output_weight: float = 1.0,
      name: str = "global_cache",
  ):
    super().__init__(name, num_replicas, tokens_per_s=tokens_per_s, output_weight=output_weight)
    if not isinstance(backend, ReplicaBackend):
      raise TypeError(f"backend has no cache/serve: {type(backend).__name__}")
    self.backend = backend
    self._placement = LeastLoadRouter(name)

  def submit(self, request: RoutedRequest) -> RouteDecision:
    """Serves one request from the shared cache; compute goes to the least loaded."""
    self._start(request)
    views = [ReplicaView(i, 0, load.backlog_tokens) for i, load in enumerate(self.loads)]
    replica = self._placement.choose(request, views)
    outcome = self.backend.serve(request)
    matched = np.full(self.num_replicas, outcome.hit_tokens, np.int64)
    return self._finish(request, replica, matched, outcome)
