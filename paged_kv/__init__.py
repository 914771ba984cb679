"""paged_kv: a functional, fragmentation-aware KV-cache memory manager for JAX.

Folders, from the bottom up (imports point down only):

  paged_kv.core         pure, jitted device transitions on `PoolState`
  paged_kv.runtime      counters of dispatches, blocking reads and compiles
  paged_kv.pool.block_pool         `BlockPool`: the validating host API, decided on the host
  paged_kv.telemetry    metrics snapshots, Prometheus and JSONL export
  paged_kv.model        what model code imports: `StepMetadata`, `paged_attention`,
                        the NNX `PagedAttention` layer, jitted steps, a Llama model
  paged_kv.cache        the radix prefix cache bound to the pool, persistence
  paged_kv.scheduler    continuous batching: the step loop, requests, executors
  paged_kv.parallel     tensor-parallel pools and executors
  paged_kv.cluster      data-parallel replicas, routing, multi-process lockstep
  paged_kv.entrypoints  `LLM`, its engines, the OpenAI-compatible server
  paged_kv.sim          traces, the synthetic workload, replays

This module re-exports the core and the host API (jax, jaxlib and numpy only); the
other folders, `paged_kv.LLM` and `paged_kv.SamplingParams` load on first use.
"""

import importlib

from paged_kv.core.alloc import allocate, apply_ref_deltas
from paged_kv.core.compact import (CompactionPolicy, compact_permute, compact_step,
                                   fragmentation_ratio, plan_compaction, region_fragmentation)
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import (BlockInUse, InvalidArgument, InvalidBlock, InvalidSegment,
                                  InvalidSegmentLayout, InvalidSequence, InvariantViolation,
                                  PagedKVError, PoolExhausted, PoolTooLarge, RefCountOverflow,
                                  RefCountUnderflow, Status)
from paged_kv.core.invariants import check_invariants
from paged_kv.core.kv import gather_kv, jit_write_kv, token_slots, write_kv
from paged_kv.core.regions import (WatermarkQuota, plan_promotion, promote_blocks, resize_pool,
                                   resized_config)
from paged_kv.core.resize import ResizeReport
from paged_kv.core.segment_format import (Segments, as_segments, empty_segments, num_tokens,
                                          take_tokens)
from paged_kv.core.sequences import fork, open_sequence, release, reserve_tokens
from paged_kv.core.slots import OWNER_EXTERNAL, cow_split, pack_slots, reclaim_slots
from paged_kv.core.state import BlockMeta, KVPages, PoolState, SegmentTable, init_pool
from paged_kv.pool.block_pool import BlockPool

__version__ = "0.2.0.dev0"

_SUBPACKAGES = ("core", "runtime", "pool", "telemetry", "model", "cache", "scheduler",
                "parallel", "cluster", "entrypoints", "sim")
# Names imported from a layer on first use: `paged_kv.LLM` loads the entrypoints.
_LAZY = {"LLM": "paged_kv.entrypoints.llm", "SamplingParams": "paged_kv.scheduler.sampling_params"}

__all__ = [
    "__version__",
    # host API
    "BlockPool",
    # configuration and state
    "PoolConfig", "PoolState", "KVPages", "BlockMeta", "SegmentTable", "init_pool",
    # the segment format
    "Segments", "as_segments", "empty_segments", "num_tokens", "take_tokens",
    # transitions
    "allocate", "apply_ref_deltas", "open_sequence", "reserve_tokens", "release", "fork",
    "write_kv", "jit_write_kv", "gather_kv", "token_slots", "cow_split", "pack_slots",
    "reclaim_slots", "OWNER_EXTERNAL", "compact_permute", "compact_step", "plan_compaction",
    "CompactionPolicy", "fragmentation_ratio", "region_fragmentation", "plan_promotion",
    "promote_blocks", "resize_pool", "resized_config", "ResizeReport", "WatermarkQuota",
    "check_invariants",
    # status and errors
    "Status", "PagedKVError", "PoolExhausted", "InvalidArgument", "InvalidBlock",
    "InvalidSegment", "InvalidSegmentLayout", "InvalidSequence", "InvariantViolation",
    "RefCountUnderflow", "RefCountOverflow", "BlockInUse", "PoolTooLarge",
    # layers and the facade, imported on first use
    *_SUBPACKAGES, *_LAZY,
]


def __getattr__(name: str):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"paged_kv.{name}")
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'paged_kv' has no attribute {name!r}")
