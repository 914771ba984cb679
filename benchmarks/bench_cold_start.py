"""Cold start: from process start to the first token, with and without the compile cache.

Each measurement is a fresh Python process (`paged_kv.sim.cold_start.measure`;
the parent only launches them and collects what they print): import the library, load a Llama-shaped Hugging Face
checkpoint (`--shape`, written once by the parent with
`paged_kv.model.random_checkpoint`, or `--checkpoint DIR`), build the pool,
`ModelExecutor` and `Scheduler` (`max_batch` = the row's batch), run
`Scheduler.warmup()`, then submit one request and step until its first token.
Per (batch, cache) row it prints the seconds from the launch to each milestone
(`import`, `load`, `warm-up` alone, `first token`), the warm-up's programs, XLA
compiles and persistent-cache loads.

`cold`: the process starts with an empty persistent compilation cache (a new
directory), so every program compiles (and is written to the cache). `cache`: a
second process with the same directory and config loads every program from it
(issue V: it compiles none). `--cache=off` adds a run with the cache disabled.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_cold_start.py                   # CPU: tiny, batch 16
  PYTHONPATH=. python benchmarks/bench_cold_start.py --shape=llama-3.2-1b --batch=64,256   # a GPU
  PYTHONPATH=. .venv/bin/python benchmarks/bench_cold_start.py --repeats=3 --record=docs/records/cold_start/
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import tempfile

from absl import app, flags

from benchmarks import records, shared_flags

_SHAPE = flags.DEFINE_string("shape", None, "A random checkpoint's shape "
                             "(paged_kv.model.random_checkpoint.SHAPES; default: "
                             "llama-3.2-1b on a GPU, tiny on a CPU).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Read this Hugging Face checkpoint "
                                  "directory instead of writing a random one.")
_DTYPE = flags.DEFINE_string("dtype", None, "The random checkpoint's dtype (default: bfloat16 "
                             "on a GPU, float32 on a CPU).")
_BATCH = flags.DEFINE_list("batch", ["16"], "Schedulers' max_batch, one row each.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "The first request's prompt tokens.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 256, "Tokens per sequence the pool is "
                                    "sized for.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "SchedulerConfig.prefill_chunk.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 256,
                                       "SchedulerConfig.prefill_token_budget.")
_CACHE = flags.DEFINE_list("cache", ["cold", "cache"], "Runs per row: cold (an empty "
                           "persistent cache), cache (the cold run's cache), off (none).")
_REPEATS = shared_flags.define_repeats(1, "Rounds (each with a fresh cache directory).")
_SEED = shared_flags.define_seed("Weights and prompt seed.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Wall limit of one process.")
_RECORD = shared_flags.define_record()
MODES = ("cold", "cache", "off")


def _checkpoint(on_gpu: bool, tmp: pathlib.Path) -> tuple[str, str]:
  """(checkpoint directory, what it is)."""
  if _CHECKPOINT.value:
    return _CHECKPOINT.value, f"checkpoint {_CHECKPOINT.value}"
  from paged_kv.model import random_checkpoint  # pylint: disable=import-outside-toplevel
  shape = _SHAPE.value or ("llama-3.2-1b" if on_gpu else "tiny")
  dtype = _DTYPE.value or ("bfloat16" if on_gpu else "float32")
  if shape not in random_checkpoint.SHAPES:
    raise app.UsageError(f"--shape must be one of {sorted(random_checkpoint.SHAPES)}")
  hf = random_checkpoint.hf_config(shape, dtype=dtype)
  path = tmp / "checkpoint"
  random_checkpoint.write_random_checkpoint(path, hf, seed=_SEED.value)
  return str(path), f"random {shape} ({dtype})"


def main(argv):
  del argv
  bad = [m for m in _CACHE.value if m not in MODES]
  if bad or not _CACHE.value:
    raise app.UsageError(f"--cache takes {MODES}, got {_CACHE.value}")
  if "cache" in _CACHE.value and "cold" not in _CACHE.value:
    raise app.UsageError("--cache=cache needs cold too (the cold run fills the cache)")
  try:
    batches = sorted({int(b) for b in _BATCH.value})
  except ValueError as e:
    raise app.UsageError(f"--batch: {e}") from e
  if not batches or min(batches) < 1 or _REPEATS.value < 1:
    raise app.UsageError("--batch values and --repeats must be >= 1")
  import jax  # pylint: disable=import-outside-toplevel
  from paged_kv.sim import cold_start  # pylint: disable=import-outside-toplevel
  on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
  rec = records.Recorder(_RECORD.value, "bench_cold_start", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="paged_kv_cold_start_"))
  runs = []
  try:
    path, what = _checkpoint(on_gpu, tmp)
    for r in range(_REPEATS.value):
      for b in batches:
        cache_dir = tmp / f"cache-{r}-{b}"
        for mode in [m for m in MODES if m in _CACHE.value]:
          spec = cold_start.ColdStartSpec(
              checkpoint=path, max_batch=b, max_seq_len=_MAX_SEQ_LEN.value,
              prefill_chunk=_PREFILL_CHUNK.value, prefill_token_budget=_PREFILL_BUDGET.value,
              prompt_len=_PROMPT_LEN.value, seed=_SEED.value,
              cache_dir=None if mode == "off" else str(cache_dir))
          out = dict(cold_start.measure(spec, timeout_s=_TIMEOUT.value), batch=b, cache=mode,
                     round=r)
          runs.append(out)
          print(f"round {r} batch {b:4d} {mode:5s}: first token {out['first_token']:7.1f} s "
                f"(warm-up {out['warmup_s']:.1f} s: {out['programs']} programs, "
                f"{out['compiles']} compiled, {out['cache_loads']} loaded)", flush=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)

  print(f"\nCold start ({what}; seconds from the process's launch, median of "
        f"{_REPEATS.value}; prompt {_PROMPT_LEN.value} tokens, prefill chunk "
        f"{_PREFILL_CHUNK.value}, budget {_PREFILL_BUDGET.value})")
  print(f"{'batch':>5} {'cache':>5} {'import':>7} {'load':>7} {'warm-up':>8} {'first token':>12}"
        f" {'programs':>8} {'compiles':>8} {'loaded':>7}")
  rows = []
  for b in batches:
    for mode in [m for m in MODES if m in _CACHE.value]:
      xs = [x for x in runs if x["batch"] == b and x["cache"] == mode]
      med = lambda k, xs=xs: statistics.median(x[k] for x in xs)
      row = dict(batch=b, cache=mode, import_s=med("import"), load_s=med("load"),
                 warmup_s=med("warmup_s"), first_token_s=med("first_token"),
                 programs=xs[0]["programs"], compiles=max(x["compiles"] for x in xs),
                 cache_loads=min(x["cache_loads"] for x in xs), rounds=len(xs))
      rows.append(row)
      print(f"{b:5d} {mode:>5} {row['import_s']:7.1f} {row['load_s']:7.1f} "
            f"{row['warmup_s']:8.1f} {row['first_token_s']:12.1f} {row['programs']:8d} "
            f"{row['compiles']:8d} {row['cache_loads']:7d}")
  rec.write({"model": what, "backend": runs[0]["backend"], "rows": rows, "runs": runs})


if __name__ == "__main__":
  app.run(main)
