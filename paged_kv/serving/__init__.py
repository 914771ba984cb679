"""Serving: the scheduler, executors, the cache-bound pool, swap, persistence, routing.

  paged_kv.serving.cached_pool  `CachedPool`: a `BlockPool` and its radix prefix cache,
                                kept in sync (every reference delta applied inside)
  paged_kv.serving.scheduler    `Scheduler`: continuous batching, one mixed forward
                                pass per step: the step loop and the request lifecycle;
                                its parts decide the KV side: admission, batching,
                                forward_pass, preemption, eviction, finishing,
                                maintenance (compaction, promotion), shrink_control,
                                stats_pacing, step_telemetry, recovery
  paged_kv.serving.request, scheduler_config, step_report
                                `Request`, `SchedulerConfig`, `SchedulerStats`/`StepReport`
  paged_kv.serving.sampling_params, parallel_sampling, prompt_positions, stop_strings
                                `SamplingParams`; `n > 1` (samples fork the first
                                request's row: `SampleId`); prompt logprobs; stop strings
  paged_kv.serving.executor     `Executor` protocol, `ModelExecutor` (a Flax model),
                                `DryExecutor` (memory dynamics only, for replay)
  paged_kv.serving.swap         preemption by swap to host memory
  paged_kv.serving.persist      the prefix cache saved to / restored from disk
  paged_kv.serving.routing      data-parallel replicas with cache-aware routing
  paged_kv.serving.traces, replay, engine_replay   request traces and their replay
  paged_kv.serving.llm          `LLM`: text in, text out (generate, stream, abort) over
                                a scheduler; its single-threaded `Engine`
  paged_kv.serving.engine_thread, engine_task, engine_process, openai_api, server
                                the OpenAI-compatible HTTP server (`python -m
                                paged_kv.serve`; the `server` extra) and where it runs
                                the engine (a thread, the event loop, a process),
                                imported explicitly

Importing this package needs no flax (`ModelExecutor` imports it when built).
"""

from paged_kv.serving.cached_pool import CachedPool, CacheView, PoolStateLost
from paged_kv.serving.executor import (DryExecutor, Executor, ModelExecutor, attach_state,
                                       attached_state)
from paged_kv.serving.parallel_sampling import SampleId
from paged_kv.serving.persist import load_prefix_cache, save_prefix_cache
from paged_kv.serving.scheduler import (Phase, Request, Scheduler, SchedulerBroken,
                                        SchedulerConfig, SchedulerStalled, SchedulerStats,
                                        UnknownRequest)
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.swap import SwappedKV, swap_in, swap_out

__all__ = ["CacheView", "CachedPool", "DryExecutor", "Executor", "ModelExecutor", "Phase",
           "PoolStateLost", "Request", "SampleId", "SamplingParams", "Scheduler", "SchedulerBroken", "SchedulerConfig",
           "SchedulerStalled", "SchedulerStats", "SwappedKV", "UnknownRequest", "attach_state", "attached_state",
           "load_prefix_cache", "save_prefix_cache", "swap_in", "swap_out"]
