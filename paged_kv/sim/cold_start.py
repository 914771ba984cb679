"""Cold start, measured in a fresh process: shared by `benchmarks/bench_cold_start.py`
and `tools/gpu_check.sh`.

`measure(spec)` times a server's start milestones (import, checkpoint load, build,
warm-up, first token) in a fresh process: in-memory caches of an earlier run would
hide what a restart pays. An empty `cache_dir` measures a cold start that fills the
persistent compilation cache; the same directory again, a restart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

MARK = "COLD_START "
"""The prefix of the child's one line of results on stdout."""


@dataclasses.dataclass(frozen=True)
class ColdStartSpec:
  """One measured start: the checkpoint, the scheduler's shape and the first request.

  `prompt_len` random ids (`seed`) make the first request; `cache_dir` is JAX's
  persistent compilation cache, or None (off).
  """

  checkpoint: str
  max_batch: int
  max_seq_len: int = 256
  prefill_chunk: int = 128
  prefill_token_budget: int = 256
  prompt_len: int = 64
  cache_dir: str | None = None
  seed: int = 0


def measure(spec: ColdStartSpec, *, timeout_s: float = 1800.0) -> dict:
  """Runs `spec` in a fresh interpreter; the seconds from its launch to `import`,
  `load`, `first_token`, plus `build_s`, `warmup_s`, `programs`, `compiles`,
  `cache_loads` and `backend`. `RuntimeError` if it failed (its output's tail)."""
  env = dict(os.environ)
  root = str(pathlib.Path(__file__).resolve().parents[2])
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  t0 = time.time()
  proc = subprocess.run([sys.executable, "-m", "paged_kv.sim.cold_start",
                         json.dumps(dataclasses.asdict(spec))], env=env, capture_output=True,
                        text=True, timeout=timeout_s, check=False)
  line = next((l for l in proc.stdout.splitlines() if l.startswith(MARK)), None)
  if proc.returncode != 0 or line is None:
    raise RuntimeError(f"the measured process failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
  out = json.loads(line[len(MARK):])
  marks = out.pop("marks")
  out.update({k: marks[k] - t0 for k in ("import", "load", "first_token")})
  out["build_s"] = marks["built"] - marks["load"]
  return out


def _child(spec: ColdStartSpec) -> None:
  """The measured start; prints one `MARK` line of epoch times (the parent subtracts)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from paged_kv.model import hf_checkpoint
  from paged_kv.runtime import compile_cache
  from paged_kv.sim import serving_bench as sb
  from paged_kv.sim import workload
  from paged_kv.scheduler.executor import ModelExecutor
  from paged_kv.scheduler.scheduler import Request, SchedulerConfig
  marks = {"import": time.time()}
  if spec.cache_dir:
    compile_cache.enable_compilation_cache(spec.cache_dir)
  else:
    compile_cache.disable_compilation_cache()
  ckpt = hf_checkpoint.load_checkpoint(spec.checkpoint, max_seq_len=spec.max_seq_len)
  jax.block_until_ready(jax.tree.leaves(ckpt.model))
  marks["load"] = time.time()
  pool_config = sb.serving_pool_config(ckpt.config, max_batch=spec.max_batch,
                                       max_seq_len=spec.max_seq_len)
  sched = sb.build_scheduler(
      ModelExecutor(ckpt.model, pool_config), pool_config,
      SchedulerConfig(max_batch=spec.max_batch, prefill_chunk=spec.prefill_chunk,
                      prefill_token_budget=max(spec.prefill_token_budget, spec.prefill_chunk),
                      max_seq_len=spec.max_seq_len))
  marks["built"] = time.time()
  report = sched.warmup(progress=False, persistence=False)
  rng = np.random.default_rng(spec.seed)
  prompt = rng.integers(workload.FIRST_TOKEN_ID, ckpt.config.vocab_size,
                        spec.prompt_len).astype(np.int32)
  req = Request(0, prompt, 2)
  sched.submit(req)
  while not req.output:
    sched.step()
  marks["first_token"] = time.time()
  print(MARK + json.dumps(dict(marks=marks, programs=report.programs,
                               compiles=report.compiles, cache_loads=report.cache_loads,
                               warmup_s=report.seconds, backend=jax.default_backend())),
        flush=True)


if __name__ == "__main__":
  _child(ColdStartSpec(**json.loads(sys.argv[1])))
