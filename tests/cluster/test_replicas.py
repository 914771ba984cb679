"""Replica processes behind the router: routing, death, hangs, shutdown, no orphans.

Every test that starts processes checks afterwards that none of them (and no other
child of the test process) is left, a failing test included (`_no_orphans`). Every
wait on a replica has a timeout (`reply_timeout_s`, `start_timeout_s`, `drain`'s).
The replicas share one compilation cache directory per module, so only the first
set compiles. The traces are synthetic (`trace_files.session_trace`); nothing here
reads ../shared.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument
from paged_kv.cluster.replica_worker import ReplicaServer
from paged_kv.cluster.replicas import (ReplicaRequest, ReplicaSet, ReplicaSpec,
                                       ReplicaStartError)
from paged_kv.cluster.routing import CacheAwareRouter
from paged_kv.scheduler.scheduler import SchedulerConfig
from paged_kv.sim.traces import TokenSource, scaled_prompt
from tests.sim.trace_files import session_trace

POOL = PoolConfig(num_blocks=256, block_size=16, num_layers=1, num_kv_heads=1, head_dim=2,
                  dtype="bfloat16", max_seqs=8, max_segments=64)
SCHED = SchedulerConfig(max_batch=8, prefill_token_budget=256, prefill_chunk=64,
                        compaction=None, snapshot_every=0)
SCALE = 64  # a 512-token hash block becomes 8 tokens
TIMEOUTS = dict(reply_timeout_s=60.0, start_timeout_s=120.0)


def _children() -> set[int]:
  """Pids of this process's child processes (zombies included), from /proc.

  Leaves out `multiprocessing`'s resource tracker: the spawn context starts one per
  interpreter at the first spawn, and it exits when the interpreter does.
  """
  me, out = os.getpid(), set()
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      with open(f"/proc/{name}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if int(fields[1]) == me and b"resource_tracker" not in cmdline:
      out.add(int(name))
  return out


@pytest.fixture(autouse=True)
def _no_orphans():
  before = _children()
  yield
  left = _children() - before
  assert not left, f"replica processes left behind: {sorted(left)}"


@pytest.fixture(scope="module", name="cache_dir")
def _cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def _spec(cache_dir: str, **kwargs) -> ReplicaSpec:
  return ReplicaSpec(POOL, SCHED, warmup=False, compile_cache_dir=cache_dir, **kwargs)


def _requests(seed: int, num: int, num_sessions: int = 4,
              gap_s: float = 0.02) -> list[ReplicaRequest]:
  rows = session_trace(seed, num=num, num_sessions=num_sessions, partial=True, gap_s=gap_s)
  tokens = TokenSource(rows)
  out = []
  for i, r in enumerate(rows):
    n = 1 + r.output_length % 4
    out.append(ReplicaRequest(i, scaled_prompt(r, tokens, SCALE), n, arrival_s=r.arrival_s,
                              forced_output=tokens.unique(n)))
  return out


def _gone(pid: int) -> bool:
  return not os.path.exists(f"/proc/{pid}")


def _check_results(requests: list[ReplicaRequest], results) -> None:
  assert sorted(r.request_id for r in results) == [q.request_id for q in requests]
  by_id = {q.request_id: q for q in requests}
  for r in results:
    assert r.stop_reason == "length", r
    np.testing.assert_array_equal(r.output, by_id[r.request_id].forced_output)


def _broken_executor(config):
  raise RuntimeError(f"no executor for {config.num_blocks} blocks")


# ----------------------------------------------------------------------------- in process
@pytest.mark.slow
def test_server_commands_in_process():
  # Outputs still to come count at weight 1 here (the default, 0, counts prompts only).
  server = ReplicaServer(ReplicaSpec(POOL, SCHED, warmup=False, output_weight=1.0), index=3)
  reqs = _requests(0, 6, num_sessions=1)
  assert server.probe("default", reqs[0].prompt) == (0, 0.0)
  assert server.submit(reqs[0]) is None
  _, backlog = server.probe("default", None)
  assert backlog == reqs[0].prompt.size + reqs[0].max_new_tokens
  reached, results, probe = server.advance(10.0, 1000, "default", reqs[1].prompt)
  assert reached and [r.request_id for r in results] == [0]
  assert probe == server.probe("default", reqs[1].prompt)
  assert results[0].replica == 3 and results[0].hit_tokens == 0
  # A read-only probe: the cache's hit statistics do not move.
  hits = server.scheduler.cache.stats().hit_tokens
  matched, backlog = server.probe("default", reqs[1].prompt)
  assert matched > 0 and backlog == 0.0
  assert server.scheduler.cache.stats().hit_tokens == hits
  huge = ReplicaRequest("huge", np.arange(POOL.num_blocks * POOL.block_size, dtype=np.int32), 1)
  assert server.submit(huge).stop_reason == "rejected"
  assert server.submit(reqs[1]) is None
  idle, results = server.drain(1000)
  assert idle and results[0].hit_tokens == matched
  with pytest.raises(InvalidArgument, match="unknown replica command"):
    server.handle(("nope",))


@pytest.mark.slow
def test_tiny_llama_factory_serves_the_seeded_model_greedily():
  """A replica built from `TinyLlamaFactory` (the factory pickled and rebuilt, as a
  spawned replica gets it) gives the dense reference's greedy tokens of the model
  with the same seed."""
  import pickle  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from paged_kv.model import llama  # pylint: disable=g-import-not-at-top
  from paged_kv.model.reference import generate_dense  # pylint: disable=g-import-not-at-top
  from paged_kv.cluster.replica_worker import TinyLlamaFactory  # pylint: disable=g-import-not-at-top
  cfg = llama.LlamaConfig(num_layers=1, dtype="float32")
  pool = llama.pool_config_for(cfg, num_blocks=32, block_size=4, max_seqs=2, max_segments=8)
  factory = pickle.loads(pickle.dumps(TinyLlamaFactory(cfg, seed=3)))
  server = ReplicaServer(ReplicaSpec(pool, SchedulerConfig(max_batch=2, prefill_token_budget=16,
                                                           prefill_chunk=8, compaction=None),
                                     warmup=False, executor_factory=factory), index=0)
  prompt = np.array([5, 9, 2, 7, 7, 1], np.int32)
  assert server.submit(ReplicaRequest("r", prompt, 4)) is None
  idle, results = server.drain(100)
  want = generate_dense(llama.TinyLlama(cfg, rngs=nnx.Rngs(3)), [prompt.tolist()], 4)[0]
  assert idle and [r.stop_reason for r in results] == ["length"]
  assert prompt.tolist() + results[0].output.tolist() == want


def test_spec_and_request_validation():
  with pytest.raises(InvalidArgument, match="clock"):
    ReplicaSpec(POOL, SCHED, clock="cpu")
  with pytest.raises(InvalidArgument, match="max_seqs"):
    ReplicaSpec(POOL, SchedulerConfig(max_batch=16))
  with pytest.raises(InvalidArgument, match="prompt"):
    ReplicaRequest(0, np.zeros(0, np.int32), 1)
  with pytest.raises(InvalidArgument, match="max_new_tokens"):
    ReplicaRequest(0, np.ones(3, np.int32), 0)
  with pytest.raises(InvalidArgument, match="same clock"):
    ReplicaSet([ReplicaSpec(POOL, SCHED), ReplicaSpec(POOL, SCHED, clock="wall")])


# ----------------------------------------------------------------------------- processes
@pytest.mark.slow
def test_routes_over_processes_and_reuses_prefixes(cache_dir):
  reqs = _requests(1, 40)
  with ReplicaSet([_spec(cache_dir)] * 2, CacheAwareRouter(load_weight=0.1),
                  **TIMEOUTS) as rs:
    pids = rs.pids
    routed = [rs.submit(q) for q in reqs]
    results = rs.drain(timeout_s=120)
    stats = rs.replica_stats()
    with pytest.raises(InvalidArgument, match="submitted before"):
      rs.submit(reqs[0])
  _check_results(reqs, results)
  assert all(_gone(pid) for pid in pids)
  assert set(routed) == {0, 1}  # both used
  summary = rs.summary()
  assert summary.hit_tokens > 0 and summary.down == {} and summary.rerouted == 0
  assert summary.per_replica_requests == tuple(routed.count(i) for i in (0, 1))
  assert sorted(s["pid"] for s in stats.values()) == sorted(pids)
  # Each replica's own counters agree with the results it reported.
  for i, s in stats.items():
    assert s["hit_tokens"] == sum(r.hit_tokens for r in results if r.replica == i)


@pytest.mark.slow
def test_dead_and_hung_replicas_are_routed_around(cache_dir):
  """SIGKILL one replica and SIGSTOP another mid-run: the third finishes everything."""
  reqs = _requests(2, 36)
  with ReplicaSet([_spec(cache_dir)] * 3, **TIMEOUTS) as rs:
    pids = rs.pids
    for q in reqs[:12]:
      rs.submit(q)
    busy = max(rs.in_flight().items(), key=lambda kv: kv[1])[0]
    os.kill(pids[busy], signal.SIGKILL)
    for q in reqs[12:24]:
      rs.submit(q)
    assert busy not in rs.live_indices and "exit" in rs.down[busy], rs.down
    hung = rs.live_indices[0]
    # Short from here on (the replicas compile lazily: a wait that long is only
    # safe once they have run their programs). `submit` waits 8 s on the frozen
    # replica, not the 60 s reply timeout.
    rs.submit_timeout_s = 8.0
    os.kill(pids[hung], signal.SIGSTOP)
    t0 = time.monotonic()
    for q in reqs[24:]:
      rs.submit(q)
    results = rs.drain(timeout_s=120)
    assert rs.live_indices == [i for i in range(3) if i not in (busy, hung)]
    assert "no reply within 8 s" in rs.down[hung], rs.down
    assert time.monotonic() - t0 < 60
    survivor = rs.live_indices[0]
  _check_results(reqs, results)
  assert all(_gone(pid) for pid in pids)
  summary = rs.summary()
  assert summary.rerouted > 0
  # After both failures only the survivor finished requests.
  late = [r for r in results if r.request_id >= 24]
  assert {r.replica for r in late} == {survivor}


@pytest.mark.slow
def test_wall_clock_replicas_and_an_exception_inside_the_set(cache_dir):
  """Wall-clock replicas step on their own; an exception in the block stops them all."""
  reqs = _requests(4, 12)
  with pytest.raises(RuntimeError, match="boom"):
    with ReplicaSet([_spec(cache_dir, clock="wall")] * 2, **TIMEOUTS) as rs:
      pids = rs.pids
      for q in reqs:
        rs.submit(q)
      results = rs.drain(timeout_s=120)
      rs.submit(ReplicaRequest("last", reqs[0].prompt, 4))  # in flight when it raises
      raise RuntimeError("boom")
  _check_results(reqs, results)
  assert all(_gone(pid) for pid in pids)


def test_timeouts_are_typed(cache_dir):
  for name in ("submit_timeout_s", "reply_timeout_s"):
    for bad in (0, -1.0, "5", float("inf"), True):
      with pytest.raises(InvalidArgument, match=name):
        ReplicaSet([_spec(cache_dir)], **{name: bad})


def test_a_replica_that_cannot_start_is_a_typed_error(cache_dir):
  with pytest.raises(ReplicaStartError, match="no executor for 256 blocks"):
    with ReplicaSet([_spec(cache_dir, executor_factory=_broken_executor)], **TIMEOUTS):
      pass
