"""Compile time of the model's steps against depth: scanned layers vs unrolled.

For the tiny-width Llama (`llama.LlamaConfig` defaults but `num_layers`) at each
depth of `--layers`, in both layouts (`scan_layers=True`: one stacked block run by
`lax.scan`; False: the layers unrolled into the program), times a fresh compile
(trace, lower, XLA compile; `jax.clear_caches()` first, the persistent cache off)
of:

  * `forward`: one mixed step (`paged_kv.model.steps.forward`) of `--max_batch` rows,
    `--prefill_chunk` tokens per row at most, `--num_tokens` tokens: a quarter of the
    rows prefill, the rest decode;
  * `decode`: one decode step (`steps.decode_step`) of `--max_batch` rows;
  * `forward_reserved`, `decode_reserved`: the same two steps with their slots
    reserved by the host (`plan.reserved`, what the serving loop runs:
    `BlockPool.reserve_step`), so the program holds no allocator.

Each repeat compiles every (depth, layout, program) once, in turn; the table gives
the median [min-max] over the repeats and the ratio of each depth's median to the
first depth's. Before the table, every compiled program runs once on the same
weights in both layouts and their tokens, logits and pages must be equal.

`--warmup_layers` also times `Scheduler.warmup()` (every serving program of a
scheduler of `--max_batch` rows, `--prefill_chunk`, `--prefill_token_budget`) at
those depths in both layouts, `--warmup_repeats` times each. `--program_times`
then also lowers and compiles each of the warm-up's programs alone, one after
the other (scanned, the first warm-up depth): where the warm-up's time goes.

Usage:
  PYTHONPATH=. python benchmarks/bench_compile.py [--layers=2,8,32 --repeats=3 --warmup_layers=2,32]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from absl import app, flags
import jax
import numpy as np
from flax import nnx

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.model import StepPlan, llama, metadata, steps

_LAYERS = flags.DEFINE_list("layers", ["2", "8", "32"],
                            "Model depths of the compile table (empty: warm-ups only).")
_LAYOUTS = flags.DEFINE_list("layouts", ["scanned", "unrolled"],
                             "Layer layouts: scanned (lax.scan), unrolled.")
_PROGRAM_NAMES = ("forward", "decode", "forward_reserved", "decode_reserved")
_PROGRAMS = flags.DEFINE_list("programs", ["forward", "decode"],
                              "Programs: forward (mixed step), decode (decode_step), "
                              "forward_reserved / decode_reserved (host-reserved slots).")
_REPEATS = shared_flags.define_repeats(3, "Fresh compiles per (depth, layout, program).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "Rows per step.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Most tokens of a row per step.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 256, "Tokens of the mixed step.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 256,
                                       "Scheduler's prompt tokens per step (warm-up).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 256, "Blocks in the pool.")
_BLOCK_SIZE = shared_flags.define_block_size()
_WARMUP_LAYERS = flags.DEFINE_list("warmup_layers", [],
                                   "Depths at which to time Scheduler.warmup() too.")
_WARMUP_REPEATS = flags.DEFINE_integer("warmup_repeats", 1, "Warm-ups per depth and layout.")
_PROGRAM_TIMES = flags.DEFINE_bool("program_times", False,
                                   "Also time each warm-up program's lower and compile alone.")
_SEED = shared_flags.define_seed("Weights and tokens seed.")
_RECORD = shared_flags.define_record()

_SCAN = {"scanned": True, "unrolled": False}
# CPU seconds of this process (every thread: XLA compiles on several) per program and
# per warm-up: wall times on a shared machine follow its load, CPU times much less.
_CPU: dict[str, list[float]] = {}


def _pool_config(model_config: llama.LlamaConfig) -> paged_kv.PoolConfig:
  per_row = math.ceil((_PREFILL_CHUNK.value + 1) / _BLOCK_SIZE.value) + 1
  return llama.pool_config_for(model_config, num_blocks=_NUM_BLOCKS.value,
                               block_size=_BLOCK_SIZE.value, max_seqs=_MAX_BATCH.value,
                               max_segments=per_row)


def _models(num_layers: int) -> dict[str, llama.TinyLlama]:
  """The same weights in every layout asked for."""
  scanned = llama.TinyLlama(llama.LlamaConfig(num_layers=num_layers),
                            rngs=nnx.Rngs(_SEED.value))
  return {layout: llama.convert_layers(scanned, scan_layers=_SCAN[layout])
          for layout in _LAYOUTS.value}


def _inputs(pool_config: paged_kv.PoolConfig, program: str):
  """`(state, args)`: a pool with every row open, and the program's other arguments
  (a `*_reserved` program's plan holds the slots the host reserved and committed)."""
  b = _MAX_BATCH.value
  pool = paged_kv.BlockPool(pool_config)
  ids = pool.open_sequences([None] * b)
  rng = np.random.default_rng(_SEED.value)
  tok = lambda n: rng.integers(1, 256, n).tolist()
  if program == "decode":
    return pool.state, (np.asarray(ids, np.int32), np.asarray(tok(b), np.int32))
  if program == "decode_reserved":
    plan = StepPlan.build([(int(i), tok(1)) for i in ids], num_rows=b, max_query_len=1,
                          num_tokens=b)
  else:
    num_prefill = max(1, b // 4)
    chunk = min(_PREFILL_CHUNK.value, (_NUM_TOKENS.value - (b - num_prefill)) // num_prefill)
    rows = [(int(i), tok(1)) for i in ids[:b - num_prefill]]
    rows += [(int(i), tok(chunk)) for i in ids[b - num_prefill:]]
    plan = StepPlan.build(rows, num_rows=b, max_query_len=_PREFILL_CHUNK.value,
                          num_tokens=_NUM_TOKENS.value)
  if not program.endswith("_reserved"):
    return pool.state, (plan,)
  pred = pool.reserve_step(plan.seq_ids, plan.num_new, max_new_tokens=plan.max_query_len,
                           grow_in_step=True)
  plan = dataclasses.replace(plan, reserved=metadata.reserved_slots(
      plan, pred.slot_idx, pred.status, pred.grow, pred.clock))
  return pred.state, (plan,)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _compile(model: llama.TinyLlama, program: str, inputs):
  """`(seconds, compiled)`: one fresh trace + lower + compile for `inputs`' shapes."""
  graphdef, params = nnx.split(model)
  fn = steps.decode_step if program == "decode" else steps.forward
  state, args = _abstract(inputs)
  jax.clear_caches()
  start, cpu = time.perf_counter(), time.process_time()
  compiled = fn.lower(_abstract(params), state, *args, graphdef=graphdef,
                      config=_pool_config(model.config)).compile()
  _CPU.setdefault(f"{program} {model.config.num_layers} layers", []).append(
      time.process_time() - cpu)
  return time.perf_counter() - start, compiled


def _run(model: llama.TinyLlama, program: str, compiled) -> list[np.ndarray]:
  """The compiled program's outputs and pages, on a fresh pool."""
  state, args = _inputs(_pool_config(model.config), program)
  state, outs = compiled(nnx.split(model)[1], state, *args)
  return [np.asarray(x) for x in outs] + [np.asarray(state.pages.k), np.asarray(state.pages.v)]


def _check_equal(outs: dict[str, list[np.ndarray]], what: str) -> None:
  """Every layout's outputs equal the first's (nothing to compare when empty)."""
  layouts = list(outs)
  for layout in layouts[1:]:
    for a, b in zip(outs[layouts[0]], outs[layout]):
      if a.shape != b.shape or not np.array_equal(a, b):
        raise AssertionError(f"{what}: {layout} differs from {layouts[0]}")


def _cold_scheduler(model: llama.TinyLlama):
  """A `Scheduler` over `model` with the flags' batch and prefill sizes, every compiled
  program and JAX cache released first (so what follows compiles from nothing)."""
  # pylint: disable=import-outside-toplevel
  from paged_kv.scheduler import warmup as warmup_lib
  from paged_kv.scheduler.executor import ModelExecutor
  from paged_kv.scheduler.scheduler import Scheduler, SchedulerConfig
  pool_config = _pool_config(model.config)
  sched = Scheduler(paged_kv.BlockPool(pool_config), ModelExecutor(model, pool_config),
                    SchedulerConfig(max_batch=_MAX_BATCH.value,
                                    prefill_chunk=_PREFILL_CHUNK.value,
                                    prefill_token_budget=_PREFILL_BUDGET.value))
  warmup_lib.release_programs()
  jax.clear_caches()
  return sched


def _warmup(model: llama.TinyLlama) -> tuple[float, int, int]:
  """`(seconds, programs, compiles)` of `Scheduler.warmup()`, every cache cleared first."""
  sched = _cold_scheduler(model)
  cpu = time.process_time()
  report = sched.warmup(progress=False)
  _CPU.setdefault(f"warmup {model.config.num_layers} layers", []).append(
      time.process_time() - cpu)
  if report.cache_loads:
    raise AssertionError(f"warm-up loaded {report.cache_loads} programs from a cache")
  return report.seconds, report.programs, report.compiles


def _program_times(model: llama.TinyLlama) -> list[dict]:
  """Each warm-up program lowered and compiled alone, one after the other (every cache
  cleared first): `{"name", "lower_s", "compile_s"}`; programs the warm-up cannot
  lower ahead (they run eagerly: persistence) get their run's time as `compile_s`."""
  from paged_kv.scheduler import warmup as warmup_lib  # pylint: disable=import-outside-toplevel
  sched = _cold_scheduler(model)
  out = []
  for run in warmup_lib.program_runs(sched):
    t0, c0 = time.perf_counter(), time.process_time()
    if run.lower is None:
      run.run()
      out.append({"name": run.name, "lower_s": 0.0, "compile_s": time.perf_counter() - t0,
                  "compile_cpu_s": time.process_time() - c0})
      continue
    lowered = run.lower()
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    out.append({"name": run.name, "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                "compile_cpu_s": time.process_time() - c1})
  return out


def _ratio(values: list[float], base: list[float]) -> str:
  return f"{statistics.median(values) / statistics.median(base):.2f}x"


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  depths = [int(x) for x in _LAYERS.value]
  warm_depths = [int(x) for x in _WARMUP_LAYERS.value]
  bad = [x for x in _LAYOUTS.value if x not in _SCAN] + [
      x for x in _PROGRAMS.value if x not in _PROGRAM_NAMES]
  if bad or not depths + warm_depths or any(n < 1 for n in depths + warm_depths):
    raise app.UsageError(f"bad --layers/--warmup_layers/--layouts/--programs: {bad or depths}")
  rec = records.Recorder(_RECORD.value, "bench_compile", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  models = {n: _models(n) for n in sorted(set(depths + warm_depths))}

  seconds: dict[tuple[int, str, str], list[float]] = {}
  for repeat in range(_REPEATS.value):
    for n in depths:
      for program in _PROGRAMS.value:
        outs = {}
        inputs = _inputs(_pool_config(models[n][_LAYOUTS.value[0]].config), program)
        for layout in _LAYOUTS.value:
          s, compiled = _compile(models[n][layout], program, inputs)
          seconds.setdefault((n, layout, program), []).append(s)
          if repeat == 0:
            outs[layout] = _run(models[n][layout], program, compiled)
          del compiled
        _check_equal(outs, f"{n} layers, {program}")

  warm: dict[tuple[int, str], list[tuple[float, int, int]]] = {}
  for _ in range(_WARMUP_REPEATS.value if warm_depths else 0):
    for n in warm_depths:
      for layout in _LAYOUTS.value:
        warm.setdefault((n, layout), []).append(_warmup(models[n][layout]))

  per_program = []
  if _PROGRAM_TIMES.value and warm_depths:
    per_program = _program_times(models[warm_depths[0]][_LAYOUTS.value[0]])

  rows = []
  if depths:
    print(f"tiny width (d_model 64), max_batch={_MAX_BATCH.value}, forward: "
          f"{_NUM_TOKENS.value} tokens, chunk {_PREFILL_CHUNK.value}; fresh compiles "
          f"(trace+lower+compile), {_REPEATS.value} repeats, median [min-max]; outputs "
          f"equal across layouts; backend {jax.default_backend()}")
    print(f"{'program':>8} {'layout':>9} {'layers':>6} {'compile s':>22} {'vs first depth':>14}")
  for program in _PROGRAMS.value if depths else ():
    for layout in _LAYOUTS.value:
      base = seconds[(depths[0], layout, program)]
      for n in depths:
        s = seconds[(n, layout, program)]
        print(f"{program:>8} {layout:>9} {n:>6} {records.format_median_range(s, suffix=' s'):>22} "
              f"{_ratio(s, base):>14}")
        rows.append({"program": program, "layout": layout, "num_layers": n, "seconds": s})
  warm_rows = []
  if warm:
    print(f"\nScheduler.warmup() (max_batch {_MAX_BATCH.value}, prefill chunk "
          f"{_PREFILL_CHUNK.value}, budget {_PREFILL_BUDGET.value}), median of "
          f"{_WARMUP_REPEATS.value}")
    print(f"{'layout':>9} {'layers':>6} {'programs':>8} {'compiles':>8} {'seconds':>9} "
          f"{'vs first depth':>14}")
    for layout in _LAYOUTS.value:
      base = [r[0] for r in warm[(warm_depths[0], layout)]]
      for n in warm_depths:
        runs = warm[(n, layout)]
        s = [r[0] for r in runs]
        print(f"{layout:>9} {n:>6} {runs[0][1]:>8} {runs[0][2]:>8} "
              f"{statistics.median(s):>9.1f} {_ratio(s, base):>14}")
        warm_rows.append({"layout": layout, "num_layers": n, "seconds": s,
                          "programs": runs[0][1], "compiles": [r[2] for r in runs]})
  if per_program:
    print(f"\nwarm-up programs alone ({warm_depths[0]} layers, {_LAYOUTS.value[0]}; lower, "
          f"then compile, one at a time)")
    print(f"{'program':>44} {'lower s':>8} {'compile s':>9} {'CPU s':>6}")
    for p in per_program:
      print(f"{p['name']:>44} {p['lower_s']:>8.2f} {p['compile_s']:>9.2f} "
            f"{p['compile_cpu_s']:>6.2f}")
    print(f"{'total':>44} {sum(p['lower_s'] for p in per_program):>8.2f} "
          f"{sum(p['compile_s'] for p in per_program):>9.2f} "
          f"{sum(p['compile_cpu_s'] for p in per_program):>6.2f}")
  if _CPU:
    print("\nCPU seconds (this process, all threads), median [min-max]:")
    for name, values in _CPU.items():
      print(f"  cpu: {name}: {records.format_median_range(values, suffix=' s')}")
  # Which library ran (the same script measures a build without them, for an A/B).
  host_reserved = hasattr(paged_kv.BlockPool, "reserve_step")
  rec.write({"compile": rows, "warmup": warm_rows, "programs": per_program,
             "cpu_seconds": _CPU, "host_reserved_slots": host_reserved},
            notes=["fresh compiles: jax.clear_caches() before each, persistent cache off"])


if __name__ == "__main__":
  app.run(main)
