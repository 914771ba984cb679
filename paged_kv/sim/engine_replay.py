"""Trace replay through the real scheduler and JAX block pool, in dry mode.

A ``Scheduler`` with a ``DryExecutor`` (slots reserved, no model math); each step is
``step_ms`` of trace time and lengths are divided by ``token_scale`` (prefix structure
kept) so an hour-long trace fits a CPU run. It measures memory dynamics: concurrency,
preemptions, OOMs, fragmentation, packing, compaction. ``ENGINE_VARIANTS`` are the
configurations compared in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from paged_kv.core import compact
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import PoolExhausted
from paged_kv.pool.block_pool import BlockPool
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.cache.governance import CacheGovernance
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.sim.traces import TokenSource, TraceRequest, scaled_prompt

__all__ = ["ENGINE_VARIANTS", "EngineResult", "EngineVariant", "replay_engine"]


@dataclasses.dataclass(frozen=True)
class EngineVariant:
  """One scheduler configuration of the engine replay.

  Attributes:
    output_reserve_ratio: share of every running sequence's remaining output kept free
      at admission (0 admits on the prompt alone).
    governance: watermark quotas and the two-phase GC (None: LRU eviction on demand).
  """

  pack_tails: bool
  compaction: bool
  preemption: str
  output_reserve_ratio: float
  governance: CacheGovernance | None = None


ENGINE_VARIANTS = {
    "recompute_no_reserve": EngineVariant(False, False, "recompute", 0.0),
    "swap_no_reserve": EngineVariant(False, False, "swap", 0.0),
    "flat": EngineVariant(False, False, "recompute", 0.5),
    "full_reserve": EngineVariant(False, False, "recompute", 1.0),
    "slotted": EngineVariant(True, False, "recompute", 0.5),
    "compaction": EngineVariant(False, True, "recompute", 0.5),
    "all": EngineVariant(True, True, "recompute", 0.5),
    # Governance against "compaction" (plain LRU, no regions, compaction on); the GC's
    # TTL is in trace seconds (a 32k-token pool turns its cache over in ~15 s).
    "quotas": EngineVariant(False, True, "recompute", 0.5, CacheGovernance()),
    "gc": EngineVariant(False, True, "recompute", 0.5,
                        CacheGovernance(quotas=False, gc_ttl=5.0, gc_every=16)),
    "quotas_gc": EngineVariant(False, True, "recompute", 0.5,
                               CacheGovernance(gc_ttl=5.0, gc_every=16)),
}
"""The compared configurations, in report order."""


@dataclasses.dataclass
class EngineResult:
  """Outcome of one engine replay.

  Attributes:
    rejected: requests refused at submission (they can never fit).
    frag_mean, frag_p99: fragmentation ratio over the snapshots.
    delayed: requests that waited at least one step before their admission.
    delay_steps_mean: mean steps from submit to admission over the delayed ones.
    quota_holds: admissions held back by the live quota (governance).
  """

  label: str
  variant: str
  submitted: int = 0
  rejected: int = 0
  finished: int = 0
  steps: int = 0
  max_running: int = 0
  preemptions: int = 0
  swap_bytes: int = 0
  hit_rate: float = 0.0
  oom: dict = dataclasses.field(default_factory=dict)
  frag_mean: float = 0.0
  frag_p99: float = 0.0
  internal_frag_mean: float = 0.0
  utilization_mean: float = 0.0
  compaction_moves: int = 0
  compaction_bytes: int = 0
  delayed: int = 0
  delay_steps_mean: float = 0.0
  quota_holds: int = 0
  gc_evicted_tokens: int = 0
  pack_moves: int = 0
  wall_s: float = 0.0


def replay_engine(
    requests: list[TraceRequest],
    *,
    variant: str,
    label: str = "",
    pool_tokens: int = 65536,
    block_size: int = 16,
    token_scale: int = 16,
    step_ms: float = 50.0,
    max_batch: int = 64,
    policy: str = "lru",
    on_step: Callable[[Scheduler], None] | None = None,
) -> EngineResult:
  """Replays ``requests`` through a ``Scheduler`` with a ``DryExecutor``.

  ``pool_tokens`` counts tokens after scaling; ``on_step`` is called with the
  scheduler before every step. The scheduler's invariants are checked at the end.
  """
  if variant not in ENGINE_VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {sorted(ENGINE_VARIANTS)}")
  if token_scale < 1 or token_scale > 512:
    raise ValueError(f"token_scale must be in [1, 512], got {token_scale}")
  v = ENGINE_VARIANTS[variant]
  tokens = TokenSource(requests)
  prompts = [scaled_prompt(r, tokens, token_scale) for r in requests]
  outputs = [max(1, -(-r.output_length // token_scale)) for r in requests]
  longest = max((p.size + o for p, o in zip(prompts, outputs)), default=1)
  config = PoolConfig(
      num_blocks=pool_tokens // block_size,
      block_size=block_size,
      num_layers=1,
      num_kv_heads=1,
      head_dim=2,
      dtype="bfloat16",
      max_seqs=max_batch,
      max_segments=longest // block_size + 8,
  )
  pool = BlockPool(config)
  clock = {"now": 0.0}
  sched = Scheduler(
      pool,
      DryExecutor(config),
      SchedulerConfig(
          max_batch=max_batch,
          prefill_token_budget=4096,
          prefill_chunk=512,
          preemption=v.preemption,
          pack_tails=v.pack_tails,
          evict_policy=policy,
          output_reserve_ratio=v.output_reserve_ratio,
          compaction=compact.CompactionPolicy() if v.compaction else None,
          governance=v.governance,
          snapshot_every=5,
      ),
      clock=lambda: clock["now"],
  )
  result = EngineResult(label, variant)
  nxt = 0

  def before_step(s: Scheduler) -> None:
    nonlocal nxt
    clock["now"] += step_ms / 1000.0
    while nxt < len(requests) and requests[nxt].arrival_s <= clock["now"]:
      req = Request(
          nxt,
          prompts[nxt],
          outputs[nxt],
          forced_output=tokens.unique(outputs[nxt]),
          arrival=requests[nxt].arrival_s,
      )
      result.submitted += 1
      try:
        s.submit(req)
      except PoolExhausted:
        result.rejected += 1
      nxt += 1
    if s.idle and nxt < len(requests):  # jump over idle gaps in the trace
      clock["now"] = max(clock["now"], requests[nxt].arrival_s - step_ms / 1000.0)
    if on_step is not None:
      on_step(s)

  t0 = time.perf_counter()
  while nxt < len(requests) or not sched.idle:
    sched.run(before_step=before_step, max_steps=256)
  result.wall_s = time.perf_counter() - t0
  sched.check_invariants()
  st, snaps = sched.stats, sched.snapshots
  frag = np.array([x.fragmentation_ratio for x in snaps] or [0.0])
  result.finished, result.steps, result.max_running = st.finished, st.steps, st.max_running
  result.preemptions, result.swap_bytes = st.preemptions, st.swap_to_host_bytes
  result.hit_rate = st.prefix_cache_hit_rate
  result.oom = dict(sched.stats.oom_by_reason)
  result.frag_mean, result.frag_p99 = float(frag.mean()), float(np.percentile(frag, 99))
  result.internal_frag_mean = float(np.mean([x.internal_fragmentation for x in snaps] or [0]))
  result.utilization_mean = float(np.mean([x.block_pool_utilization for x in snaps] or [0]))
  result.compaction_moves = sched.stats.compaction_moves
  result.compaction_bytes = sched.stats.compaction_moves * config.block_bytes
  waits = np.array([r.admit_step - r.submit_step for r in sched.finished])
  result.delayed = int((waits > 0).sum())
  result.delay_steps_mean = float(waits[waits > 0].mean()) if result.delayed else 0.0
  result.quota_holds = st.quota_holds
  result.gc_evicted_tokens = st.gc_evicted_tokens
  result.pack_moves = sched.stats.pack_moves
  return result
