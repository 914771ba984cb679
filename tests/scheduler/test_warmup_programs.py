"""Few programs, compiled concurrently, restored from the persistent cache.

One serving configuration compiles at most 8 model-step programs (`token_widths`:
one decode-only width, at most six mixed widths, plus the k-step decode); the
warm-up compiles the executor's programs on threads before it runs them, so the
runs compile nothing; a second process with the same config and JAX's persistent
compilation cache compiles nothing at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.pool.changes import CommitWidths
from paged_kv.model import llama
from paged_kv.runtime import counters
from paged_kv.scheduler import batching, warmup
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
SCHED = SchedulerConfig(max_batch=8, prefill_chunk=32, prefill_token_budget=64, decode_steps=4,
                        compaction=None)


@pytest.mark.parametrize("max_batch,budget", [(1, 1), (4, 16), (8, 64), (64, 2048),
                                              (256, 512), (16, 8192)])
def test_token_widths(max_batch, budget):
  cfg = SchedulerConfig(max_batch=max_batch, prefill_token_budget=budget,
                        prefill_chunk=min(budget, 64))
  decode, mixed = batching.token_widths(cfg)
  assert decode == (max_batch,)
  assert list(mixed) == sorted(set(mixed)) and len(mixed) <= batching.MAX_MIXED_WIDTHS
  assert mixed[-1] == max_batch + budget
  for total in range(1, max_batch + budget + 1):
    w = batching.width_for(total, mixed)
    assert w >= total
    assert w <= max(2 * total + 16, mixed[0]), (total, w, mixed)
  with pytest.raises(ValueError):
    batching.width_for(max_batch + budget + 1, mixed)


def _scheduler(layers=2):
  mc = llama.LlamaConfig(num_layers=layers)
  model = llama.TinyLlama(mc, rngs=nnx.Rngs(0))
  pc = llama.pool_config_for(mc, num_blocks=128, block_size=8, max_seqs=8, max_segments=32)
  return Scheduler(paged_kv.BlockPool(pc), ModelExecutor(model, pc), SCHED)


class _CompileCounting:
  """Counts the backend compiles inside the executor's step calls."""

  def __init__(self, executor):
    self.inside = 0
    for name in ("step", "decode_steps"):
      fn = getattr(executor, name)

      def counted(*args, _fn=fn, **kwargs):
        c0 = counters.backend_compiles()
        try:
          return _fn(*args, **kwargs)
        finally:
          self.inside += counters.backend_compiles() - c0

      setattr(executor, name, counted)


@pytest.mark.parametrize("threads", [1, 2])
def test_steps_compile_ahead_on_threads_and_not_when_run(threads):
  sched = _scheduler()
  ahead = [r for r in warmup.program_runs(sched) if r.lower is not None]
  steps = [r for r in ahead if not r.name.startswith("commit")]
  assert 1 < len(steps) <= 8 and len(ahead) > len(steps)  # the commits compile ahead too
  counting = _CompileCounting(sched.executor)
  report = warmup.warm(sched, progress=False, threads=threads)
  assert report.programs == len(warmup.program_runs(sched))
  if threads > 1:
    assert counting.inside == 0  # every step program was compiled ahead
  else:
    assert counting.inside >= len(steps)  # compiled when first run
  assert sched.executor.steps.cache_size() == len(steps)
  rng = np.random.default_rng(0)
  for i in range(12):
    sched.submit(Request(i, rng.integers(0, 200, int(rng.integers(3, 90))),
                         int(rng.integers(2, 20))))
  sched.run()
  assert sched.stats.compiles_after_warmup == 0
  assert sched.executor.steps.cache_size() == len(steps)


def test_a_commit_lowered_ahead_is_not_compiled_again_when_run():
  pool = _scheduler().pool
  widths = CommitWidths.all_for(pool.config)[1]
  jax.clear_caches()  # another test in this process may have compiled it
  c0 = counters.backend_compiles() + counters.cache_loads()
  pool.lower_commit(widths).compile()
  c1 = counters.backend_compiles() + counters.cache_loads()
  pool.warm_commit(widths)
  assert (c1 - c0, counters.backend_compiles() + counters.cache_loads() - c1) == (1, 0)


_CHILD = """
import json, sys
from paged_kv.runtime import compile_cache
compile_cache.enable_compilation_cache(sys.argv[1])
sys.path.insert(0, sys.argv[2])
import test_warmup_programs as t
report = t._scheduler().warmup(progress=False)
print(json.dumps(dict(programs=report.programs, compiles=report.compiles,
                      loads=report.cache_loads)))
"""


@pytest.mark.slow
def test_a_second_process_loads_every_program_from_the_persistent_cache():
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(here))] + os.environ.get("PYTHONPATH", "").split(
          os.pathsep)))
  with tempfile.TemporaryDirectory(prefix="paged_kv_restart_") as cache:
    runs = []
    for _ in range(2):
      out = subprocess.run([sys.executable, "-c", _CHILD, cache, here], env=env, check=True,
                           capture_output=True, text=True, timeout=900)
      runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  first, second = runs
  assert first["compiles"] > 0 and first["loads"] == 0, runs
  assert second["compiles"] == 0, runs
  assert second["loads"] == first["compiles"], runs


def test_min_mixed_width_is_the_narrowest_mixed_program():
  """Below `min_mixed_width` tokens a mixed step pads to one program (fewer programs to
  compile); 16 keeps the halves down to `max_batch`."""
  base = dict(max_batch=16, prefill_chunk=128, prefill_token_budget=256)
  assert batching.token_widths(SchedulerConfig(**base)) == ((16,), (80, 144, 272))
  assert batching.token_widths(SchedulerConfig(**base, min_mixed_width=16)) == (
      (16,), (16, 32, 48, 80, 144, 272))
  assert batching.token_widths(SchedulerConfig(**base, min_mixed_width=4096)) == (
      (16,), (272,))
  with pytest.raises(paged_kv.InvalidArgument, match="min_mixed_width"):
    SchedulerConfig(**base, min_mixed_width=0)
