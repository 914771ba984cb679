"""Data-parallel replicas and cache-aware request routing (host side; numpy + radix).

``N`` replicas each hold their own pool and prefix cache; a router picks the replica
of every request. A replica is a ``ReplicaBackend``; the router only reads its cache
with a probe (``match(..., lock=False, record=False)``) that changes no statistics,
LRU order or locks.

Load model: each replica is one FIFO server doing ``tokens_per_s`` tokens of work per
second of trace time; a request's work is its uncached prompt tokens plus
``output_weight`` times its output tokens, and its queueing delay is the replica's
backlog over ``tokens_per_s`` at arrival. It ignores batching and memory; it makes
"balanced by load" mean something.

Routers: ``RoundRobinRouter``, ``LeastLoadRouter`` (no probe) and
``CacheAwareRouter`` (``argmax_i matched_i - load_weight * backlog_i``, in tokens).
``GlobalCache`` is the baseline: one cache of ``N`` times the capacity (Mooncake's
global KV store). Why ``load_weight = 0.1``: docs/scaling.md.
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
    arrival_s: seconds; non-decreasing across a cluster's requests.
    payload: opaque, passed unchanged to ``ReplicaBackend.serve``.
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
  """What serving one request did to a replica (`admitted` False: it could not fit
  even in an empty cache; `hit_tokens` 0 then)."""

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
  """Backlog of one replica: a FIFO server doing ``tokens_per_s`` (> 0) tokens of work per s."""

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
  """What a router sees of one replica (`matched_tokens` 0 when it does not probe)."""

  index: int
  matched_tokens: int
  backlog_tokens: float


class Router(Protocol):
  """Picks a replica for each request; `needs_probe`: whether ``choose`` reads
  ``matched_tokens`` (only then are the caches probed)."""

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

  Picks ``argmax_i matched_i - load_weight * backlog_i`` (tokens, ``load_weight >=
  0``); scores within ``tie_tokens`` of the best tie, resolved by the smallest backlog,
  then by rotation. A session thus sticks to its replica until that backlog exceeds
  its history's length over ``load_weight``.
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
    matched_tokens: int64[N] probe results at routing time (zeros without a probe).
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
  """``N`` independent replicas (one cache each) behind a router; ``tokens_per_s`` and
  ``output_weight`` (work per output token, in prompt tokens) set the load model."""

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
