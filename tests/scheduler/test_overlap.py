"""The overlapped loop: step t+1 is dispatched before step t's tokens are read.

Its outputs equal the synchronous loop's and the dense reference's (greedy, under
pressure, both preemption modes, stop tokens seen a step late); the order of
events is dispatch t+1, then read t; a step's host time hides behind a device
step (`LatencyExecutor`); an exception while a step is in flight loses no token
of the step before and leaves every block accounted for.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import llama
from paged_kv.model.reference import generate_dense
from paged_kv.scheduler.executor import DryExecutor, ModelExecutor, attach_state
from paged_kv.scheduler.latency_executor import LatencyExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def workload(model):
  rng = np.random.default_rng(3)
  tok = lambda n: rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist()
  system = tok(9)
  prompts = [system + tok(int(rng.integers(2, 9))) for _ in range(6)] + [tok(7), tok(5)]
  return prompts, generate_dense(model, prompts, NEW_TOKENS)


def _serve(model, prompts, *, overlap, num_blocks=14, preemption="recompute", stop_token=-1,
           executor=None, steps_before=None):
  pool_config = llama.pool_config_for(MODEL_CONFIG, num_blocks=num_blocks, block_size=4,
                                      max_seqs=4, max_segments=24)
  pool = paged_kv.BlockPool(pool_config)
  streamed = []
  sched = Scheduler(pool, executor or ModelExecutor(model, pool_config),
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    preemption=preemption, compaction=None,
                                    output_reserve_ratio=0.0, stop_token=stop_token,
                                    overlap=overlap),
                    on_step=lambda report: streamed.extend(report.tokens))
  reqs = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
  for r in reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    if steps_before is not None:
      steps_before(sched, steps)
    sched.step()
    sched.check_invariants()
    steps += 1
    assert steps < 500
  return sched, reqs, streamed


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_overlapped_tokens_equal_dense_and_sync_under_pressure(model, workload, preemption):
  prompts, dense = workload
  sync, sync_reqs, _ = _serve(model, prompts, overlap=False, preemption=preemption)
  over, reqs, _ = _serve(model, prompts, overlap=True, preemption=preemption)
  assert [r.tokens.tolist() for r in reqs] == dense
  assert [r.output for r in reqs] == [r.output for r in sync_reqs]
  assert over.stats.preemptions > 0 and over.stats.evictions > 0
  assert over.stats.hit_tokens > 0


@pytest.mark.parametrize("which", [0, 2])
def test_a_stop_seen_late_drops_what_follows(model, workload, which):
  """The token after a stop is computed (the step was dispatched before the stop was
  read) but never streamed, never in the output, never cached."""
  prompts, dense = workload
  stop = dense[which][len(prompts[which]) + 2]
  # (No pressure: under it the two loops evict at other times, so their caches differ.)
  sync, sync_reqs, sync_stream = _serve(model, prompts, overlap=False, stop_token=stop,
                                        num_blocks=64)
  over, reqs, stream = _serve(model, prompts, overlap=True, stop_token=stop, num_blocks=64)
  assert any(r.stop_reason == "stop_token" for r in reqs)
  assert [r.output for r in reqs] == [r.output for r in sync_reqs]
  assert [r.stop_reason for r in reqs] == [r.stop_reason for r in sync_reqs]
  for r in reqs:
    assert [t for i, t in stream if i == r.request_id] == r.output
  assert sorted(stream) == sorted(sync_stream)
  assert over.cache.num_tokens == sync.cache.num_tokens
  assert over.stats.hit_tokens == sync.stats.hit_tokens
  assert over.stats.decode_tokens > sync.stats.decode_tokens  # the dropped ones ran


def _dry(num_blocks=512, max_seqs=8):
  return paged_kv.PoolConfig(num_blocks=num_blocks, block_size=4, num_layers=1, num_kv_heads=1,
                             head_dim=2, max_seqs=max_seqs, max_segments=32)


def _dry_requests(n, seed=0, max_new=(4, 24)):
  rng = np.random.default_rng(seed)
  return [Request(i, rng.integers(0, 500, int(rng.integers(3, 30))), int(rng.integers(*max_new)))
          for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_order_of_events(overlap):
  """Overlapped: step t+1 is dispatched before step t's tokens are read; synchronous:
  read t before dispatch t+1."""
  cfg, events = _dry(), []
  sched = Scheduler(paged_kv.BlockPool(cfg), LatencyExecutor(cfg, 0.0, events=events),
                    SchedulerConfig(max_batch=8, prefill_chunk=8, prefill_token_budget=16,
                                    overlap=overlap))
  for r in _dry_requests(12):
    sched.submit(r)
  sched.run()
  dispatched = [n for kind, n in events if kind == "dispatch"]
  assert dispatched == list(range(len(dispatched))) and len(dispatched) > 10
  at = {e: i for i, e in enumerate(events)}
  for n in dispatched[:-1]:
    if overlap:
      assert at[("dispatch", n + 1)] < at[("read", n)], n
    else:
      assert at[("read", n)] < at[("dispatch", n + 1)], n
  assert sorted(n for kind, n in events if kind == "read") == dispatched  # each read once


def _step_times(overlap: bool, device_seconds: float, steps: int = 40) -> list[float]:
  cfg = _dry(max_seqs=16)
  sched = Scheduler(paged_kv.BlockPool(cfg, debug=False), LatencyExecutor(cfg, device_seconds),
                    SchedulerConfig(max_batch=16, prefill_chunk=8, prefill_token_budget=32,
                                    overlap=overlap, stats_every=0, snapshot_every=0))
  sched.warmup(progress=False)
  for r in _dry_requests(16, max_new=(60, 61)):
    sched.submit(r)
  for _ in range(8):
    sched.step()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    sched.step()
    times.append(time.perf_counter() - t0)
  return times


@pytest.mark.slow
def test_the_host_hides_behind_the_device():
  """With a device step of D = 20 ms, the synchronous loop takes host + D per step and
  the overlapped one max(host, D) (a timing: generous bounds for a loaded machine)."""
  d = 0.02
  sync = statistics.median(_step_times(False, d))
  over = statistics.median(_step_times(True, d))
  host = max(sync - d, 0.0)
  assert sync >= d
  assert over <= 1.15 * max(host, d) + 0.002, (sync, over)
  assert over < sync


class _FailingExecutor(ModelExecutor):
  """Raises at its `fail_at`-th step, before or after the donating call."""

  def __init__(self, *args, fail_at: int, after: bool, **kwargs):
    super().__init__(*args, **kwargs)
    self.fail_at, self.after, self.calls = fail_at, after, 0

  def step(self, state, plan):
    self.calls += 1
    if self.calls == self.fail_at and not self.after:
      raise RuntimeError("injected before the step")
    out = super().step(state, plan)
    if self.calls == self.fail_at:
      exc = RuntimeError("injected after the step")
      attach_state(exc, out[0])
      raise exc
    return out


@pytest.mark.parametrize("after", [False, True])
def test_a_failure_with_a_step_in_flight_loses_no_token(model, workload, after):
  """Step t+1 raises while step t's tokens are unread: t's tokens are kept, nothing is
  duplicated, every block is accounted for, and serving goes on to the dense tokens."""
  prompts, dense = workload
  pool_config = llama.pool_config_for(MODEL_CONFIG, num_blocks=40, block_size=4, max_seqs=4,
                                      max_segments=24)
  executor = _FailingExecutor(model, pool_config, fail_at=6, after=after)
  pool = paged_kv.BlockPool(pool_config)
  streamed = []
  sched = Scheduler(pool, executor,
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    compaction=None, overlap=True),
                    on_step=lambda report: streamed.extend(report.tokens))
  reqs = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
  for r in reqs:
    sched.submit(r)
  raised = 0
  while not sched.idle:
    try:
      sched.step()
    except RuntimeError as e:
      assert "injected" in str(e)
      raised += 1
      outputs_then = {r.request_id: list(r.output) for r in reqs}
      assert any(outputs_then.values())
    sched.check_invariants()
  assert raised == 1 and sched.broken is None and sched.num_recoveries == 1
  assert [r.tokens.tolist() for r in reqs] == dense
  for r in reqs:  # every token streamed exactly once, in order
    assert [t for i, t in streamed if i == r.request_id] == r.output
  sched.cached_pool.evict(num_tokens=10**9)
  assert (np.asarray(sched.pool.state.meta.ref_count) == 0).all(), "blocks leaked"


def test_abort_with_tokens_in_flight(model, workload):
  """An aborted request keeps only the tokens read before the abort; its unread ones
  are dropped; the others are unaffected."""
  prompts, dense = workload

  def abort_one(sched, step):
    if step == 4:
      r = next(r for r in sched.running if r.in_flight)
      sched.abort(r.request_id)

  sched, reqs, stream = _serve(model, prompts, overlap=True, num_blocks=40,
                               steps_before=abort_one)
  aborted = [r for r in reqs if r.stop_reason == "abort"]
  assert len(aborted) == 1
  for r, want in zip(reqs, dense):
    got = r.tokens.tolist()
    if r.stop_reason == "abort":
      assert got == want[:len(got)] and len(got) < len(want)
    else:
      assert got == want
    assert [t for i, t in stream if i == r.request_id] == r.output


def test_counts_after_warmup_overlapped():
  """Overlapped, after warm-up: one step and at most one commit dispatch per step, one
  read (the lagged tokens) per step, no other read, no compile."""
  cfg = _dry(max_seqs=8)
  pool = paged_kv.BlockPool(cfg, debug=False)
  sched = Scheduler(pool, DryExecutor(cfg),
                    SchedulerConfig(max_batch=8, prefill_chunk=8, prefill_token_budget=16,
                                    overlap=True))
  sched.warmup(progress=False)
  for r in _dry_requests(30):
    sched.submit(r)
  before = sched.runtime
  steps0 = sched.stats.steps
  sched.run()
  traffic = sched.runtime.since(before)
  steps = sched.stats.steps - steps0
  assert traffic.dispatches.get("step", 0) <= steps
  assert traffic.dispatches.get("commit", 0) <= steps
  assert traffic.dispatches.get("sync", 0) == 0 and traffic.dispatches.get("data", 0) == 0
  assert {k for k, n in traffic.host_reads.items() if n} <= {"tokens"}, traffic.host_reads
  assert sched.stats.compiles_after_warmup == 0
