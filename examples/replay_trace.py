"""Replays request traces through the radix prefix cache and a simulated block pool.

Usage:
  .venv/bin/python examples/replay_trace.py \
      --trace=../shared/traces/conversation_trace.jsonl \
      --capacity_tokens=1000000,3000000,10000000,0
  .venv/bin/python examples/replay_trace.py --max_requests=500   # smoke run
  .venv/bin/python examples/replay_trace.py --engine --max_requests=300 --pool_tokens=32768
  .venv/bin/python examples/replay_trace.py --capacity_tokens=1000000 \
      --trace=../shared/traces/AzureLLMInferenceTrace_conv.csv,../shared/traces/AzureLLMInferenceTrace_code.csv

The default ``--trace`` is the Mooncake conversation trace in ``../shared/traces/``
beside the repository (from github.com/kvcache-ai/Mooncake,
``FAST25-release/traces/conversation_trace.jsonl``); the script says so in one line
and exits when it is missing. Formats: ``paged_kv.serving.traces``.

Simulation mode (the default; ``paged_kv.serving.replay``): no attention math and no
device; requests served one at a time in arrival order through a prefix cache over
host block accounting. With unlimited capacity the hit rate must equal the exact bound
computed from the hash ids: both are printed and the script fails if they disagree.

Engine mode (``--engine``; ``paged_kv.serving.engine_replay``): the real scheduler and
JAX block pool with a dry executor (memory dynamics with arrival times and output
lengths, no model math), one row per ``--variants`` entry.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
from absl import app, flags

from paged_kv.runtime import compile_cache
from paged_kv.serving import engine_replay, replay, traces
from paged_kv.serving.replay import ReplayConfig, ReplayResult, replay_sim

try:
  import tqdm as _tqdm
except ImportError:  # progress bars are optional
  _tqdm = None

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.normpath(
    os.path.join(_REPO, "..", "shared", "traces", "conversation_trace.jsonl")
)

_TRACE = flags.DEFINE_list(
    "trace",
    [DEFAULT_TRACE],
    "Trace files (comma-separated): Mooncake .jsonl or Azure .csv. Default: the Mooncake "
    "conversation trace in ../shared/traces/ beside the repository.",
)
_CAPACITY = flags.DEFINE_list(
    "capacity_tokens", ["0"], "Pool capacities in tokens (comma-separated); 0 = unlimited."
)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per pool block.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 0, "Replay only the first N (0 = all).")
_POLICY = flags.DEFINE_enum("policy", "lru", ["lru", "cost"], "Eviction policy.")
_INSERT_OUTPUT = flags.DEFINE_bool(
    "insert_output", False, "Also cache each request's output tokens (unique ids)."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar (needs tqdm).")
_NAMESPACE = flags.DEFINE_string("namespace", "default", "Cache namespace of all requests.")
_ENGINE = flags.DEFINE_bool(
    "engine",
    False,
    "Replay through the real scheduler and JAX block pool in dry mode (memory dynamics "
    "with arrival times and output lengths, no model math).",
)
_POOL_TOKENS = flags.DEFINE_integer(
    "pool_tokens", 65536, "Engine mode: pool size in tokens (after --token_scale)."
)
_TOKEN_SCALE = flags.DEFINE_integer(
    "token_scale",
    16,
    "Engine mode: divide every length by this (a 512-token hash block becomes 512/scale tokens).",
)
_STEP_MS = flags.DEFINE_float("step_ms", 50.0, "Engine mode: trace time per scheduler step.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Engine mode: sequences per step.")
_VARIANTS = flags.DEFINE_list(
    "variants",
    list(engine_replay.ENGINE_VARIANTS),
    "Engine mode: configurations to compare (paged_kv.serving.engine_replay.ENGINE_VARIANTS).",
)
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "Use JAX's persistent compilation "
                                   "cache (restarts skip XLA compiles).")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "The cache's directory "
                                         "(default: $PAGED_KV_COMPILE_CACHE, else "
                                         "~/.cache/paged_kv/jax).")


def _progress(desc: str):
  """A progress-bar wrapper for the replays, or None."""
  if _PROGRESS.value and _tqdm is not None:
    return functools.partial(_tqdm.tqdm, desc=desc, unit="req", mininterval=1.0, leave=False)
  return None


def _pct_us(xs: list[float], q: float) -> float:
  return float(np.percentile(np.asarray(xs), q)) * 1e6 if xs else float("nan")


def format_table(rows: list[tuple[ReplayResult, float | None]]) -> str:
  """Markdown table; each row is (result, exact bound or None)."""
  head = (
      "| trace | capacity (tokens) | requests | hit rate | exact bound | "
      "evicted tokens | evicted nodes | rejected | match p50 / p99 (us) | "
      "insert p50 / p99 (us) | wall (s) |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r, bound in rows:
    cap = "unlimited" if r.capacity_tokens == 0 else f"{r.capacity_tokens:,}"
    b = f"{bound:.4f}" if bound is not None else "-"
    lines.append(
        f"| {r.label} | {cap} | {r.num_requests:,} | {r.hit_rate:.4f} | {b} | "
        f"{r.evicted_tokens:,} | {r.evicted_nodes:,} | {r.rejected} | "
        f"{_pct_us(r.match_s, 50):.0f} / {_pct_us(r.match_s, 99):.0f} | "
        f"{_pct_us(r.insert_s, 50):.0f} / {_pct_us(r.insert_s, 99):.0f} | "
        f"{r.wall_s:.1f} |"
    )
  return "\n".join(lines)


def run_trace(path: str, capacities: list[int], base_config: dict) -> list[tuple]:
  """Replays one trace at every capacity; checks the unlimited run against the bound."""
  requests = traces.load_trace(path, _MAX_REQUESTS.value)
  label = os.path.basename(path)
  bound_hit, bound_total = traces.exact_hit_bound(requests)
  bound = bound_hit / bound_total if bound_total else 0.0
  rows = []
  for cap in capacities:
    config = ReplayConfig(capacity_tokens=cap, label=label, **base_config)
    result = replay_sim(requests, config, progress=_progress(label))
    print(
        f"{label} capacity={cap or 'unlimited'}: hit rate {result.hit_rate:.6f} "
        f"({result.hit_tokens:,} / {result.prompt_tokens:,} tokens), "
        f"exact bound {bound:.6f} ({bound_hit:,} tokens), "
        f"evicted {result.evicted_tokens:,} tokens in {result.evicted_nodes:,} nodes, "
        f"{result.wall_s:.1f} s",
        flush=True,
    )
    if cap == 0 and result.rejected == 0 and result.hit_tokens != bound_hit:
      raise SystemExit(
          f"unlimited-capacity hit tokens {result.hit_tokens} != exact bound {bound_hit}"
      )
    if cap == 0:
      print(
          f"  unlimited capacity: replay and exact bound agree "
          f"({result.hit_tokens:,} == {bound_hit:,} tokens)"
      )
    rows.append((result, bound if cap == 0 else None))
  return rows


def format_engine_table(results: list) -> str:
  """Markdown table of ``engine_replay.EngineResult`` rows."""
  head = (
      "| trace | variant | finished / submitted | rejected | max concurrent | preemptions | "
      "swap KB | OOMs by reason | hit rate | frag ratio mean / p99 | internal frag | "
      "utilization | compaction moves (KB) | packed tails | delayed (mean steps) | quota holds | "
      "GC-evicted tokens | steps | wall (s) |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in results:
    lines.append(
        f"| {r.label} | {r.variant} | {r.finished} / {r.submitted} | {r.rejected} | "
        f"{r.max_running} | {r.preemptions} | {r.swap_bytes / 1e3:.1f} | "
        f"{r.oom or 'none'} | {r.hit_rate:.3f} | {r.frag_mean:.3f} / {r.frag_p99:.3f} | "
        f"{r.internal_frag_mean:.1%} | {r.utilization_mean:.1%} | {r.compaction_moves} "
        f"({r.compaction_bytes / 1e3:.0f}) | "
        f"{r.pack_moves} | {r.delayed} ({r.delay_steps_mean:.1f}) | {r.quota_holds} | "
        f"{r.gc_evicted_tokens} | {r.steps} | {r.wall_s:.0f} |"
    )
  return "\n".join(lines)


def run_engine() -> None:
  """Every trace through every ``--variants`` entry; prints the table."""
  unknown = [v for v in _VARIANTS.value if v not in engine_replay.ENGINE_VARIANTS]
  if unknown:
    raise app.UsageError(
        f"unknown --variants {unknown}; choose from {sorted(engine_replay.ENGINE_VARIANTS)}"
    )
  results = []
  for path in _TRACE.value:
    requests = traces.load_trace(path, _MAX_REQUESTS.value)
    label = os.path.basename(path)
    for variant in _VARIANTS.value:
      bar = (
          _tqdm.tqdm(total=len(requests), desc=f"{label} {variant}", unit="req",
                     mininterval=1.0, leave=False)
          if _PROGRESS.value and _tqdm is not None
          else None
      )

      def on_step(s, bar=bar):
        if bar is not None:
          bar.n = s.stats.finished
          bar.refresh()

      r = engine_replay.replay_engine(
          requests,
          variant=variant,
          label=label,
          pool_tokens=_POOL_TOKENS.value,
          block_size=_BLOCK_SIZE.value,
          token_scale=_TOKEN_SCALE.value,
          step_ms=_STEP_MS.value,
          max_batch=_MAX_BATCH.value,
          policy=_POLICY.value,
          on_step=on_step,
      )
      if bar is not None:
        bar.close()
      print(
          f"{r.label} {variant}: {r.finished}/{r.submitted} finished, "
          f"{r.preemptions} preemptions, hit rate {r.hit_rate:.3f}, {r.wall_s:.0f} s",
          flush=True,
      )
      results.append(r)
  print()
  print(format_engine_table(results))


def parse_capacities(values: list[str]) -> list[int]:
  """``--capacity_tokens`` as ints >= 0 (0 = unlimited); a usage error otherwise."""
  try:
    return replay.parse_capacities(values)
  except ValueError as e:
    raise app.UsageError(f"--capacity_tokens: {e}") from None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _COMPILE_CACHE.value:
    compile_cache.enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  try:
    traces.check_trace_files(_TRACE.value)
  except FileNotFoundError as e:
    sys.exit(f"replay_trace.py: {e}; pass --trace=PATH")
  if _BLOCK_SIZE.value < 1:
    raise app.UsageError("--block_size must be >= 1")
  if _ENGINE.value:
    run_engine()
    return
  capacities = parse_capacities(_CAPACITY.value)
  base_config = dict(
      block_size=_BLOCK_SIZE.value,
      policy=_POLICY.value,
      insert_output=_INSERT_OUTPUT.value,
      namespace=_NAMESPACE.value,
  )
  rows = []
  for path in _TRACE.value:
    rows.extend(run_trace(path, capacities, base_config))
  print()
  print(format_table(rows))


if __name__ == "__main__":
  app.run(main)
