"""Replays request traces through the radix prefix cache and a simulated block pool.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/replay_trace.py \
      --trace=../shared/traces/conversation_trace.jsonl \
      --capacity_tokens=1000000,3000000,10000000,0
  PYTHONPATH=. .venv/bin/python benchmarks/replay_trace.py --max_requests=500   # smoke run
  PYTHONPATH=. .venv/bin/python benchmarks/replay_trace.py --engine --max_requests=300 --pool_tokens=32768
  PYTHONPATH=. .venv/bin/python benchmarks/replay_trace.py --capacity_tokens=1000000 \
      --trace=../shared/traces/AzureLLMInferenceTrace_conv.csv,../shared/traces/AzureLLMInferenceTrace_code.csv

The default ``--trace`` is the Mooncake conversation trace in ``../shared/traces/``
beside the repository (from github.com/kvcache-ai/Mooncake,
``FAST25-release/traces/conversation_trace.jsonl``); the script says so in one line
and exits when it is missing. Formats: ``paged_kv.sim.traces``.

Simulation mode (the default; ``paged_kv.sim.replay``): no attention math and no
device; requests served one at a time in arrival order through a prefix cache over
host block accounting. With unlimited capacity the hit rate must equal the exact bound
computed from the hash ids: both are printed and the script fails if they disagree.

Engine mode (``--engine``; ``paged_kv.sim.engine_replay``): the real scheduler and
JAX block pool with a dry executor (memory dynamics with arrival times and output
lengths, no model math), one row per ``--variants`` entry.

Held-out tuning of the cache governance (``--engine --holdout``): the two-phase GC's TTL
(``--gc_ttl_grid``) and the quotas' watermarks (``--watermark_grid``) are chosen by hit
rate on one slice of the trace (``--tune_slice``) and then reported, beside the plain-LRU
baseline and the published settings, on another (``--eval_slice``), at every
``--holdout_pools`` size:

  PYTHONPATH=. .venv/bin/python benchmarks/replay_trace.py --engine --holdout --tune_slice=0:1500 \
      --eval_slice=1500:3000 --holdout_pools=32768,65536

``--record=PATH`` writes what was measured, with its provenance, as JSON
(``benchmarks.records``).
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
from absl import app, flags

from benchmarks import records, shared_flags
from paged_kv.sim import engine_replay, replay, traces
from paged_kv.cache.governance import CacheGovernance
from paged_kv.sim.replay import ReplayConfig, ReplayResult, replay_sim

try:
  import tqdm as _tqdm
except ImportError:  # progress bars are optional
  _tqdm = None

DEFAULT_TRACE = shared_flags.default_trace(__file__)

_TRACE = flags.DEFINE_list(
    "trace",
    [DEFAULT_TRACE],
    "Trace files (comma-separated): Mooncake .jsonl or Azure .csv. Default: the Mooncake "
    "conversation trace in ../shared/traces/ beside the repository.",
)
_CAPACITY = flags.DEFINE_list(
    "capacity_tokens", ["0"], "Pool capacities in tokens (comma-separated); 0 = unlimited."
)
_BLOCK_SIZE = shared_flags.define_block_size("Tokens per pool block.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 0, "Replay only the first N (0 = all).")
_POLICY = flags.DEFINE_enum("policy", "lru", ["lru", "cost"], "Eviction policy.")
_INSERT_OUTPUT = flags.DEFINE_bool(
    "insert_output", False, "Also cache each request's output tokens (unique ids)."
)
_PROGRESS = shared_flags.define_progress()
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
    "Engine mode: configurations to compare (paged_kv.sim.engine_replay.ENGINE_VARIANTS).",
)
_SKIP_REQUESTS = flags.DEFINE_integer(
    "skip_requests", 0, "Start at this request of the trace (a later slice; with "
    "--max_requests, the slice is [skip, skip + max)).")
_HOLDOUT = flags.DEFINE_bool(
    "holdout", False, "Engine mode: tune the GC TTL and the quota watermarks on --tune_slice "
    "and report them on --eval_slice (see the module docstring).")
_TUNE_SLICE = flags.DEFINE_string("tune_slice", "0:1500", "Holdout: requests [a:b) to tune on.")
_EVAL_SLICE = flags.DEFINE_string("eval_slice", "1500:3000",
                                  "Holdout: requests [a:b) to report on.")
_HOLDOUT_POOLS = flags.DEFINE_list("holdout_pools", ["32768", "65536"],
                                   "Holdout: pool sizes in tokens (after --token_scale).")
_GC_TTL_GRID = flags.DEFINE_list("gc_ttl_grid", ["1", "2.5", "5", "10", "20"],
                                 "Holdout: GC TTLs (trace seconds) tried on the tune slice.")
_GC_EVERY = flags.DEFINE_integer("gc_every", 16, "Holdout: steps between GC marking passes.")
_WATERMARK_GRID = flags.DEFINE_list(
    "watermark_grid", ["0.85/0.5", "0.95/0.7", "0.7/0.3"],
    "Holdout: quota high/low watermarks tried (quotas + GC at the chosen TTL).")
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()


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


def load_slice(path: str, start: int = 0, stop: int | None = None) -> list:
  """Requests [start, stop) of a trace (stop None: to the end)."""
  requests = traces.load_trace(path, 0 if stop is None else stop)
  return requests[start:stop]


def _flag_slice() -> tuple[int, int | None]:
  start = _SKIP_REQUESTS.value
  return start, (start + _MAX_REQUESTS.value if _MAX_REQUESTS.value else None)


def run_trace(path: str, capacities: list[int], base_config: dict) -> list[tuple]:
  """Replays one trace at every capacity; checks the unlimited run against the bound."""
  requests = load_slice(path, *_flag_slice())
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
    requests = load_slice(path, *_flag_slice())
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

      r = _engine(requests, variant, label, _POOL_TOKENS.value, on_step=on_step)
      if bar is not None:
        bar.close()
      results.append(r)
  print()
  print(format_engine_table(results))
  return results


def _engine(requests, variant: str, label: str, pool_tokens: int, on_step=None):
  r = engine_replay.replay_engine(
      requests,
      variant=variant,
      label=label,
      pool_tokens=pool_tokens,
      block_size=_BLOCK_SIZE.value,
      token_scale=_TOKEN_SCALE.value,
      step_ms=_STEP_MS.value,
      max_batch=_MAX_BATCH.value,
      policy=_POLICY.value,
      on_step=on_step,
  )
  print(
      f"{r.label} {variant} pool {pool_tokens}: {r.finished}/{r.submitted} finished, "
      f"{r.preemptions} preemptions, hit rate {r.hit_rate:.4f}, {r.wall_s:.0f} s",
      flush=True,
  )
  return r


def _parse_slice(text: str, name: str) -> tuple[int, int]:
  try:
    a, b = (int(x) for x in text.split(":"))
  except ValueError:
    raise app.UsageError(f"--{name} must be START:STOP, got {text!r}") from None
  if not 0 <= a < b:
    raise app.UsageError(f"--{name} must have 0 <= START < STOP, got {text!r}")
  return a, b


def _variant(name: str, governance: CacheGovernance) -> str:
  """Registers a governance variant of "compaction" under `name` (the replay looks
  variants up by name) and returns the name."""
  base = engine_replay.ENGINE_VARIANTS["compaction"]
  engine_replay.ENGINE_VARIANTS[name] = engine_replay.EngineVariant(
      base.pack_tails, base.compaction, base.preemption, base.output_reserve_ratio, governance)
  return name


def run_holdout() -> dict:
  """Tunes the GC TTL, then the quota watermarks, on one slice; reports on another."""
  (path,) = _TRACE.value[:1]
  tune, held = _parse_slice(_TUNE_SLICE.value, "tune_slice"), _parse_slice(
      _EVAL_SLICE.value, "eval_slice")
  if tune[1] > held[0] and held[1] > tune[0]:
    raise app.UsageError("--tune_slice and --eval_slice overlap")
  label = os.path.basename(path)
  tune_reqs, eval_reqs = load_slice(path, *tune), load_slice(path, *held)
  ttls = [float(x) for x in _GC_TTL_GRID.value]
  marks = [tuple(float(y) for y in x.split("/")) for x in _WATERMARK_GRID.value]
  published = engine_replay.ENGINE_VARIANTS["gc"].governance
  out = {"trace": label, "tune_slice": list(tune), "eval_slice": list(held),
         "gc_every": _GC_EVERY.value, "published_gc_ttl": published.gc_ttl,
         "published_watermarks": [published.high_watermark, published.low_watermark],
         "pools": []}
  for pool in (int(x) for x in _HOLDOUT_POOLS.value):
    tuning = []
    base = _engine(tune_reqs, "compaction", f"{label}[tune]", pool)
    tuning.append(dict(kind="baseline", variant="compaction", result=base))
    for ttl in ttls:
      v = _variant(f"gc_ttl={ttl:g}", CacheGovernance(quotas=False, gc_ttl=ttl,
                                                      gc_every=_GC_EVERY.value))
      tuning.append(dict(kind="gc", gc_ttl=ttl, variant=v,
                         result=_engine(tune_reqs, v, f"{label}[tune]", pool)))
    gc_rows = [t for t in tuning if t["kind"] == "gc"]
    best_ttl = max(gc_rows, key=lambda t: (t["result"].hit_rate, -t["gc_ttl"]))["gc_ttl"]
    for hi, lo in marks:
      v = _variant(f"quotas_gc_wm={hi:g}/{lo:g}", CacheGovernance(
          gc_ttl=best_ttl, gc_every=_GC_EVERY.value, high_watermark=hi, low_watermark=lo))
      tuning.append(dict(kind="quotas_gc", watermarks=[hi, lo], gc_ttl=best_ttl, variant=v,
                         result=_engine(tune_reqs, v, f"{label}[tune]", pool)))
    q_rows = [t for t in tuning if t["kind"] == "quotas_gc"]
    best_marks = max(q_rows, key=lambda t: t["result"].hit_rate)["watermarks"]
    evaluated = []
    chosen = [("baseline", "compaction"),
              ("gc, published TTL", "gc"),
              ("gc, tuned TTL", f"gc_ttl={best_ttl:g}"),
              ("quotas + gc, published", "quotas_gc"),
              ("quotas + gc, tuned", f"quotas_gc_wm={best_marks[0]:g}/{best_marks[1]:g}")]
    for role, v in chosen:
      evaluated.append(dict(role=role, variant=v,
                            result=_engine(eval_reqs, v, f"{label}[eval]", pool)))
    out["pools"].append(dict(pool_tokens=pool, tuned_gc_ttl=best_ttl,
                             tuned_watermarks=list(best_marks), tuning=tuning,
                             evaluated=evaluated))
    print(f"pool {pool}: TTL {best_ttl:g} s and watermarks {best_marks} chosen on requests "
          f"{tune[0]}-{tune[1]}; on {held[0]}-{held[1]}:")
    for e in evaluated:
      print(f"  {e['role']:<26} hit rate {e['result'].hit_rate:.4f}")
  return out


def parse_capacities(values: list[str]) -> list[int]:
  """``--capacity_tokens`` as ints >= 0 (0 = unlimited); a usage error otherwise."""
  try:
    return replay.parse_capacities(values)
  except ValueError as e:
    raise app.UsageError(f"--capacity_tokens: {e}") from None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _COMPILE_CACHE.enable()
  try:
    traces.check_trace_files(_TRACE.value)
  except FileNotFoundError as e:
    sys.exit(f"replay_trace.py: {e}; pass --trace=PATH")
  if _BLOCK_SIZE.value < 1:
    raise app.UsageError("--block_size must be >= 1")
  rec = records.Recorder(_RECORD.value, "replay_trace", flag_values=records.script_flags())
  if _ENGINE.value and _HOLDOUT.value:
    rec.write({"mode": "holdout", **run_holdout()})
    return
  if _ENGINE.value:
    results = run_engine()
    rec.write({"mode": "engine", "pool_tokens": _POOL_TOKENS.value,
               "token_scale": _TOKEN_SCALE.value, "step_ms": _STEP_MS.value,
               "slice": list(_flag_slice()), "rows": results})
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
  rec.write({"mode": "sim", "slice": list(_flag_slice()), "rows": [
      dict(label=r.label, capacity_tokens=r.capacity_tokens, requests=r.num_requests,
           hit_rate=r.hit_rate, hit_tokens=r.hit_tokens, prompt_tokens=r.prompt_tokens,
           exact_bound=bound, evicted_tokens=r.evicted_tokens, evicted_nodes=r.evicted_nodes,
           rejected=r.rejected, match_p50_us=_pct_us(r.match_s, 50),
           match_p99_us=_pct_us(r.match_s, 99), insert_p50_us=_pct_us(r.insert_s, 50),
           insert_p99_us=_pct_us(r.insert_s, 99), wall_s=r.wall_s)
      for r, bound in rows]})


if __name__ == "__main__":
  app.run(main)
