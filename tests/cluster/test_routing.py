"""Tests of paged_kv.cluster.routing: routers, load model, clusters, and the routing replay script.

Replicas are ``paged_kv.sim.replay.SimReplica`` (the simulated pool + prefix cache)
fed small synthetic Mooncake-style requests: block hash ``h`` is 512 tokens, and equal
leading hashes mean an equal prefix. The script test writes its own trace file.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
from absl.testing import absltest, parameterized
import pytest

from paged_kv.sim.replay import ReplayConfig, SimReplica, routed_requests
from paged_kv.cluster.routing import (
    CacheAwareRouter,
    GlobalCache,
    LeastLoadRouter,
    ReplicaCluster,
    ReplicaLoad,
    ReplicaView,
    RoundRobinRouter,
    RoutedRequest,
)
from paged_kv.sim.traces import TokenSource, TraceRequest, exact_hit_bound
from tests.sim.trace_files import BLOCK, session_trace, tmp_file, write_mooncake

_ROOT = pathlib.Path(__file__).resolve().parents[2]
RATE = 10_000.0


def req(t: float, hashes: list[int], output: int = 10) -> TraceRequest:
  """A synthetic trace row with full 512-token blocks."""
  return TraceRequest(float(t), BLOCK * len(hashes), output, np.asarray(hashes, np.int64))


def routed(requests: list[TraceRequest]) -> list[RoutedRequest]:
  return list(routed_requests(requests, TokenSource(requests), "default"))


def replicas(requests: list[TraceRequest], n: int, capacity: int = 0) -> list[SimReplica]:
  return [SimReplica(requests, ReplayConfig(capacity_tokens=capacity)) for _ in range(n)]


def random_trace(seed: int, num: int = 120, num_sessions: int = 12) -> list[TraceRequest]:
  """Multi-turn sessions: each turn extends the session's previous prompt."""
  return session_trace(seed, num, num_sessions)


class RouterTest(parameterized.TestCase):

  def test_round_robin_spreads_evenly(self):
    trace = [req(i, [0, 100 + i]) for i in range(16)]
    backends = replicas(trace, 4)
    cluster = ReplicaCluster(backends, RoundRobinRouter(), tokens_per_s=RATE)
    chosen = [cluster.submit(r).replica for r in routed(trace)]
    self.assertEqual(chosen, [0, 1, 2, 3] * 4)
    np.testing.assert_array_equal(cluster.stats.assigned_requests, [4, 4, 4, 4])
    self.assertAlmostEqual(cluster.stats.token_imbalance, 1.0)

  def test_cache_aware_follows_repeated_prefix(self):
    # Near-simultaneous arrivals: each replica's backlog outweighs its cached
    # system block (512 tokens), so the first four spread over the replicas.
    first = [req(0, [0, 1, 2]), req(0.001, [0, 5, 6]), req(0.002, [0, 7, 8]), req(0.003, [0, 9])]
    again = req(100, [0, 5, 6, 42])  # extends the second prompt, after queues drain
    trace = first + [again]
    backends = replicas(trace, 4)
    cluster = ReplicaCluster(backends, CacheAwareRouter(load_weight=1.0), tokens_per_s=RATE)
    decisions = [cluster.submit(r) for r in routed(trace)]
    holder = decisions[1].replica
    self.assertEqual(len({d.replica for d in decisions[:4]}), 4)  # spread by load
    self.assertEqual(decisions[4].replica, holder)
    self.assertEqual(decisions[4].outcome.hit_tokens, 3 * BLOCK)
    self.assertEqual(int(decisions[4].matched_tokens[holder]), 3 * BLOCK)
    others = np.delete(decisions[4].matched_tokens, holder)
    np.testing.assert_array_equal(others, BLOCK)  # only the shared system block

  def test_load_balancing_when_holder_overloaded(self):
    # Replica 0 caches [0, 1, 2] then gets a long unrelated prompt: its backlog
    # (~64 blocks of work) outweighs a 3-block match, so the follow-up moves.
    trace = [req(0, [0, 1, 2]), req(0.001, [0] + list(range(10, 74))), req(0.002, [0, 1, 2, 3])]
    results = {}
    for weight in (0.0, 1.0):
      backends = replicas(trace, 2)
      pin_first = _Scripted([0, 0])
      cluster = ReplicaCluster(backends, pin_first, tokens_per_s=RATE)
      items = routed(trace)
      for r in items[:2]:
        cluster.submit(r)
      cluster.router = CacheAwareRouter(load_weight=weight)
      results[weight] = cluster.submit(items[2])
    self.assertEqual(results[0.0].replica, 0)  # prefix only: the holder
    self.assertEqual(results[0.0].outcome.hit_tokens, 3 * BLOCK)
    self.assertEqual(results[1.0].replica, 1)  # balanced: the idle replica
    self.assertEqual(results[1.0].outcome.hit_tokens, 0)  # replica 1 was empty

  def test_cache_aware_rule_on_views(self):
    router = CacheAwareRouter(load_weight=1.0)
    views = [ReplicaView(0, 4096, 5000.0), ReplicaView(1, 512, 0.0), ReplicaView(2, 2048, 100.0)]
    self.assertEqual(router.choose(None, views), 2)  # 1948 beats -904 and 512
    np.testing.assert_allclose(router.scores(views), [-904.0, 512.0, 1948.0])
    self.assertEqual(CacheAwareRouter(load_weight=0.0).choose(None, views), 0)
    # Near-ties (within 2000 tokens of the best) go to the least loaded.
    near_ties = CacheAwareRouter(load_weight=1.0, tie_tokens=2000)
    self.assertEqual(near_ties.choose(None, views), 1)
    # The default weight (0.1) keeps the 4096-token prefix despite the backlog.
    self.assertEqual(CacheAwareRouter().choose(None, views), 0)
    # Exact ties on score and load rotate.
    flat = [ReplicaView(i, 512, 0.0) for i in range(3)]
    rr = CacheAwareRouter()
    self.assertEqual([rr.choose(None, flat) for _ in range(4)], [0, 1, 2, 0])

  def test_least_load_picks_smallest_backlog(self):
    views = [ReplicaView(0, 0, 30.0), ReplicaView(1, 0, 10.0), ReplicaView(2, 0, 20.0)]
    self.assertEqual(LeastLoadRouter().choose(None, views), 1)

  def test_invalid_arguments(self):
    with self.assertRaises(ValueError):
      CacheAwareRouter(load_weight=-1.0)
    with self.assertRaises(ValueError):
      CacheAwareRouter(tie_tokens=float("nan"))
    with self.assertRaises(ValueError):
      ReplicaLoad(0.0)
    with self.assertRaises(ValueError):
      RoundRobinRouter().choose(None, [])
    with self.assertRaises(TypeError):
      ReplicaCluster([object()], RoundRobinRouter(), tokens_per_s=RATE)


class _Scripted:
  """A router that replays a fixed list of choices (test helper)."""

  needs_probe = False
  name = "scripted"

  def __init__(self, choices: list[int]):
    self._choices = list(choices)

  def choose(self, request, views):
    del request, views
    return self._choices.pop(0)


class ClusterTest(parameterized.TestCase):

  def test_probe_is_read_only(self):
    trace = [req(0, [0, 1, 2]), req(5, [0, 1, 2, 3])]
    backends = replicas(trace, 2)
    cluster = ReplicaCluster(backends, CacheAwareRouter(), tokens_per_s=RATE)
    items = routed(trace)
    cluster.submit(items[0])
    before = [
        (b.cache.stats(), [(n.last_access, n.access_seq, n.lock_ref) for n in b.cache.tree.nodes()])
        for b in backends
    ]
    np.testing.assert_array_equal(cluster.probe(items[1]), [3 * BLOCK, 0])
    after = [
        (b.cache.stats(), [(n.last_access, n.access_seq, n.lock_ref) for n in b.cache.tree.nodes()])
        for b in backends
    ]
    self.assertEqual(before, after)

  @parameterized.named_parameters(("unlimited", 0), ("evicting", 6 * BLOCK))
  def test_global_cache_equals_single_replica(self, capacity):
    trace = random_trace(seed=3)
    single = ReplicaCluster(replicas(trace, 1, capacity), RoundRobinRouter(), tokens_per_s=RATE)
    shared = GlobalCache(replicas(trace, 1, capacity)[0], num_replicas=1, tokens_per_s=RATE)
    for r in routed(trace):
      single.submit(r)
    for r in routed(trace):
      shared.submit(r)
    a, b = single.stats, shared.stats
    self.assertGreater(a.hit_tokens, 0)
    self.assertEqual(
        (a.hit_tokens, a.prompt_tokens, a.evicted_tokens, a.rejected),
        (b.hit_tokens, b.prompt_tokens, b.evicted_tokens, b.rejected),
    )
    np.testing.assert_allclose(a.work_tokens, b.work_tokens)
    self.assertEqual(a.waits_s, b.waits_s)
    if capacity:
      self.assertGreater(a.evicted_tokens, 0)
    else:
      self.assertEqual(a.hit_tokens, exact_hit_bound(trace)[0])

  def test_cache_aware_beats_round_robin_on_sessions(self):
    trace = random_trace(seed=7, num=200)
    rates = {}
    for router in (RoundRobinRouter(), CacheAwareRouter()):
      cluster = ReplicaCluster(replicas(trace, 4), router, tokens_per_s=1e9)
      for r in routed(trace):
        cluster.submit(r)
      rates[router.name] = cluster.stats.hit_rate
    glob = GlobalCache(replicas(trace, 1)[0], num_replicas=4, tokens_per_s=1e9)
    for r in routed(trace):
      glob.submit(r)
    self.assertGreater(rates["cache_aware"], rates["round_robin"])
    # Unlimited caches and no load pressure: sticky sessions lose only the first
    # turn's system block on each replica.
    self.assertGreaterEqual(rates["cache_aware"], 0.9 * glob.stats.hit_rate)

  def test_load_model(self):
    load = ReplicaLoad(100.0)
    self.assertEqual(load.add(500), 0.0)
    load.advance(2.0)
    self.assertAlmostEqual(load.backlog_tokens, 300.0)
    self.assertAlmostEqual(load.add(100), 3.0)
    load.advance(100.0)
    self.assertEqual(load.backlog_tokens, 0.0)
    with self.assertRaises(ValueError):
      load.advance(1.0)

  def test_requests_must_be_time_ordered(self):
    trace = [req(5, [0, 1]), req(1, [0, 2])]
    cluster = ReplicaCluster(replicas(trace, 2), RoundRobinRouter(), tokens_per_s=RATE)
    items = routed(trace)
    cluster.submit(items[0])
    with self.assertRaisesRegex(ValueError, "time order"):
      cluster.submit(items[1])

  def test_router_out_of_range_is_an_error(self):
    trace = [req(0, [0, 1])]
    cluster = ReplicaCluster(replicas(trace, 2), _Scripted([5]), tokens_per_s=RATE)
    with self.assertRaisesRegex(ValueError, "chose replica 5"):
      cluster.submit(routed(trace)[0])


class SimReplicaTest(absltest.TestCase):

  def test_serve_reports_the_change(self):
    trace = [req(0, [0, 1]), req(1, [0, 1, 2])]
    backend = replicas(trace, 1)[0]
    items = routed(trace)
    first, second = backend.serve(items[0]), backend.serve(items[1])
    self.assertEqual((first.admitted, first.hit_tokens), (True, 0))
    self.assertEqual((second.admitted, second.hit_tokens), (True, 2 * BLOCK))
    backend.check_accounting()

  def test_serve_checks_payload_and_namespace(self):
    trace = [req(0, [0, 1])]
    backend = replicas(trace, 1)[0]
    item = routed(trace)[0]
    with self.assertRaises(TypeError):
      backend.serve(RoutedRequest(item.tokens, 0.0, 1, "default", payload=None))
    with self.assertRaisesRegex(ValueError, "namespace"):
      backend.serve(RoutedRequest(item.tokens, 0.0, 1, "other", payload=trace[0]))


@pytest.mark.slow
class ScriptTest(absltest.TestCase):

  def _run(self, script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(script), *args], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)

  def test_replay_routing_smoke(self):
    trace = write_mooncake(tmp_file(self, "sessions.jsonl"),
                           session_trace(seed=11, num=200, num_sessions=24, partial=True))
    proc = self._run(
        _ROOT / "benchmarks" / "replay_routing.py",
        f"--trace={trace}",
        "--progress=false",
        "--capacity_tokens=200000,0",
        "--routers=round_robin,least_load,cache_aware,prefix_only",
    )
    self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-4000:])
    for name in (
        "global_cache",
        "round_robin",
        "least_load",
        "cache_aware w=0.1",
        "cache_aware w=1",
        "prefix_only",
    ):
      self.assertIn(f"| {name} |", proc.stdout)
    self.assertIn("| 200,000 | 1,600,000 | global_cache | ", proc.stdout)
    self.assertIn("goal (cache_aware >= 0.90 of global)", proc.stdout)

  def test_missing_trace_is_one_line(self):
    proc = self._run(_ROOT / "benchmarks" / "replay_routing.py", "--trace=/nowhere/trace.jsonl")
    self.assertNotEqual(proc.returncode, 0)
    self.assertEqual(proc.stdout, "")
    lines = proc.stderr.strip().splitlines()
    self.assertLen(lines, 1, proc.stderr)
    self.assertIn("/nowhere/trace.jsonl not found", lines[0])


if __name__ == "__main__":
  absltest.main()
