"""Simulated trace replay: a radix prefix cache over host block accounting.

No device: requests are served one at a time in arrival order (match, open, allocate
the rest evicting as needed, insert, release) over a ``BlockAccounting`` that applies
exactly the reference deltas the cache returns; the cache's clock is trace time. With
unlimited capacity the hits equal ``traces.exact_hit_bound``. ``SimReplica`` makes one
simulation a ``routing.ReplicaBackend`` for ``replay_cluster``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable, Iterator

import numpy as np

from paged_kv.sim.block_accounting import BlockAccounting
from paged_kv.cluster.routing import GlobalCache, ReplicaCluster, RoutedRequest, ServeOutcome
from paged_kv.sim.traces import TokenSource, TraceRequest
from radix.cache import PrefixCache

__all__ = [
    "ReplayConfig",
    "ReplayResult",
    "SimReplica",
    "SimState",
    "replay_cluster",
    "replay_sim",
    "routed_requests",
    "serve_request",
    "serve_tokens",
]

Progress = Callable[[Iterable], Iterable]
"""Wraps the request iterable (e.g. ``tqdm.tqdm``); the identity when None."""


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """One simulated replay.

  Attributes:
    capacity_tokens: pool size in tokens (0 = unlimited).
    insert_output: also cache each request's output tokens as unique ids (off by
      default: the next turn's hash ids already cover them).
    continue_tails: a match ending in a cached partial block copies that tail into
      a fresh block and continues there (``CachedPool.open``'s ``cow_split``).
    granularity: eviction by ``"block"`` (a leaf's tail blocks first) or ``"node"``.
  """

  capacity_tokens: int
  block_size: int = 16
  policy: str = "lru"
  insert_output: bool = False
  namespace: Hashable = "default"
  label: str = ""
  continue_tails: bool = True
  granularity: str = "block"

  def __post_init__(self):
    if self.capacity_tokens < 0:
      raise ValueError(f"capacity_tokens must be >= 0 (0 = unlimited), got {self.capacity_tokens}")
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclasses.dataclass
class ReplayResult:
  """Totals of one replay; times in seconds.

  ``rejected`` counts requests that did not fit even with an empty cache;
  ``match_s`` / ``insert_s`` hold the wall time of each call.
  """

  label: str
  capacity_tokens: int
  num_requests: int = 0
  prompt_tokens: int = 0
  hit_tokens: int = 0
  rejected: int = 0
  evicted_nodes: int = 0
  evicted_tokens: int = 0
  eviction_calls: int = 0
  peak_blocks: int = 0
  wall_s: float = 0.0
  match_s: list[float] = dataclasses.field(default_factory=list)
  insert_s: list[float] = dataclasses.field(default_factory=list)

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class SimState:
  """Everything one simulated replay holds: clock (``now``), cache, pool, token source."""

  def __init__(self, requests: list[TraceRequest], config: ReplayConfig):
    self.config = config
    self.now = 0.0
    cap = config.capacity_tokens
    self.pool = BlockAccounting(cap // config.block_size if cap else None, config.block_size)
    self.cache = PrefixCache(
        block_size=config.block_size, policy=config.policy, clock=lambda: self.now,
        granularity=config.granularity,
    )
    self.tokens = TokenSource(requests)

  def make_room(self, num_blocks: int, result: ReplayResult) -> bool:
    """Evicts from the cache until ``num_blocks`` are free; False if impossible."""
    pool = self.pool
    while pool.num_free < num_blocks and not pool.unlimited:
      ev = self.cache.evict(num_blocks=num_blocks - pool.num_free, ref_count=pool.ref_count)
      pool.change_refs(ev.ref_deltas.block_ids, ev.ref_deltas.deltas)
      result.eviction_calls += 1
      result.evicted_nodes += len(ev.nodes)
      result.evicted_tokens += ev.num_tokens
      if not ev.nodes:
        return False
    return True

  def check_accounting(self) -> None:
    """Raises RuntimeError if the pool's counts differ from the cache's references
    (between requests every reference is the cache's)."""
    tree_refs = self.cache.tree_ref_counts(self.pool.num_blocks)
    if not np.array_equal(tree_refs, self.pool.ref_count):
      raise RuntimeError("pool ref_count != cache segment references after replay")


def serve_request(sim: SimState, request: TraceRequest, result: ReplayResult) -> None:
  """One request: match, open, allocate the rest (evicting), insert, release.

  Adds to ``result``'s totals; a request that cannot fit even with an empty cache is
  counted in ``result.rejected`` and changes nothing else.
  """
  sim.now = request.arrival_s
  prompt = sim.tokens.prompt(request)
  tokens = prompt
  if sim.config.insert_output:
    tokens = np.concatenate([prompt, sim.tokens.unique(request.output_length)])
  serve_tokens(sim, prompt, tokens, result)


def serve_tokens(sim: SimState, prompt: np.ndarray, tokens: np.ndarray, result: ReplayResult,
                 timings: dict[str, list[float]] | None = None) -> bool:
  """One request given its token ids: match ``prompt``, compute the rest of ``tokens``.

  ``tokens`` starts with ``prompt``. Returns False (and counts ``result.rejected``)
  when it cannot fit even with an empty cache. ``timings``: appends each phase's wall
  time under ``"match"``, ``"open"``, ``"reserve"``, ``"insert"``, ``"release"``.
  """
  clock = time.perf_counter
  ns = sim.config.namespace
  result.num_requests += 1
  result.prompt_tokens += int(prompt.shape[0])

  t0 = clock()
  m = sim.cache.match(ns, prompt)
  t1 = clock()
  result.match_s.append(t1 - t0)
  sim.pool.change_refs(m.segments[:, 0], 1)  # open_sequence: the sequence's refs
  t2 = clock()

  num_new = int(tokens.shape[0]) - m.length
  bs = sim.pool.block_size
  shared = m.segments
  fresh = None
  if sim.config.continue_tails and m.continuable and num_new > 0:
    # Copy the partial tail (b, s, l) into a fresh block and continue after it.
    tail = int(m.segments[-1, 2])
    if sim.make_room(-(-(num_new + tail) // bs), result):
      fresh = sim.pool.fresh_segments(num_new + tail)
    if fresh is not None:
      sim.pool.change_refs(m.segments[-1:, 0], -1)  # the copy replaces the shared tail
      shared = m.segments[:-1]
  if fresh is None:
    ok = sim.make_room(-(-num_new // bs), result)
    fresh = sim.pool.fresh_segments(num_new) if ok else None
  if fresh is None:  # cannot fit even with an empty cache
    result.rejected += 1
    sim.pool.change_refs(m.segments[:, 0], -1)
    if m.node is not None:
      sim.cache.unlock(m.node)
    return False
  result.hit_tokens += m.length
  segments = np.concatenate([shared, fresh])
  t3 = clock()

  out = sim.cache.insert(ns, tokens, segments)
  sim.pool.change_refs(out.ref_deltas.block_ids, out.ref_deltas.deltas)
  t4 = clock()
  result.insert_s.append(t4 - t3)
  if m.node is not None:
    sim.cache.unlock(m.node)
  sim.pool.change_refs(segments[:, 0], -1)  # release the sequence
  if timings is not None:
    t5 = clock()
    for name, dt in (("match", t1 - t0), ("open", t2 - t1), ("reserve", t3 - t2),
                     ("insert", t4 - t3), ("release", t5 - t4)):
      timings.setdefault(name, []).append(dt)
  return True


def replay_sim(
    requests: list[TraceRequest], config: ReplayConfig, *, progress: Progress | None = None
) -> ReplayResult:
  """Serves ``requests`` one at a time in arrival order; checks the accounting at the end."""
  sim = SimState(requests, config)
  result = ReplayResult(config.label, config.capacity_tokens)
  t0 = time.perf_counter()
  for request in progress(requests) if progress else requests:
    serve_request(sim, request, result)
  result.wall_s = time.perf_counter() - t0
  result.peak_blocks = sim.pool.peak_used
  sim.check_accounting()
  return result


class SimReplica:
  """A ``paged_kv.cluster.routing.ReplicaBackend`` over one simulated replay.

  ``serve`` runs ``serve_request`` on the trace row (``RoutedRequest.payload``).
  """

  def __init__(self, requests: list[TraceRequest], config: ReplayConfig):
    self.sim = SimState(requests, config)
    self.result = ReplayResult(config.label, config.capacity_tokens)

  @property
  def cache(self) -> PrefixCache:
    return self.sim.cache

  def serve(self, request: RoutedRequest) -> ServeOutcome:
    if not isinstance(request.payload, TraceRequest):
      raise TypeError("SimReplica needs the TraceRequest as RoutedRequest.payload")
    if request.namespace != self.sim.config.namespace:
      raise ValueError(
          f"namespace {request.namespace!r} != replica namespace {self.sim.config.namespace!r}"
      )
    r = self.result
    hit, rejected, ev_tokens, ev_nodes = r.hit_tokens, r.rejected, r.evicted_tokens, r.evicted_nodes
    serve_request(self.sim, request.payload, r)
    return ServeOutcome(
        admitted=r.rejected == rejected,
        hit_tokens=r.hit_tokens - hit,
        evicted_tokens=r.evicted_tokens - ev_tokens,
        evicted_nodes=r.evicted_nodes - ev_nodes,
    )

  def check_accounting(self) -> None:
    """Raises RuntimeError if the pool's ref counts drifted from the cache's references."""
    self.sim.check_accounting()


def routed_requests(
    requests: Iterable[TraceRequest], token_source: TokenSource, namespace: Hashable = "default"
) -> Iterator[RoutedRequest]:
  """Trace rows as ``RoutedRequest``s, token ids expanded lazily (the whole Mooncake
  trace is ~580 MB of ids); the row rides along as the payload."""
  for r in requests:
    yield RoutedRequest(
        tokens=token_source.prompt(r),
        arrival_s=r.arrival_s,
        num_output_tokens=r.output_length,
        namespace=namespace,
        payload=r,
    )


def replay_cluster(
    cluster: ReplicaCluster | GlobalCache,
    requests: list[TraceRequest],
    backends: list[SimReplica],
    *,
    namespace: Hashable = "default",
    progress: Progress | None = None,
) -> float:
  """Submits every request to ``cluster``, checks each backend's accounting; wall seconds."""
  t0 = time.perf_counter()
  rows = progress(requests) if progress else requests
  for request in routed_requests(rows, TokenSource(requests), namespace):
    cluster.submit(request)
  for backend in backends:
    backend.check_accounting()
  return time.perf_counter() - t0


def parse_capacities(values: Iterable[str]) -> list[int]:
  """Pool capacities in tokens from strings, each an int >= 0 (0 = unlimited); else ValueError."""
  try:
    capacities = [int(c) for c in values]
  except ValueError as e:
    raise ValueError(f"capacities must be integers: {e}") from None
  if any(c < 0 for c in capacities):
    raise ValueError(f"capacities must be >= 0 (0 = unlimited), got {capacities}")
  return capacities
