"""Host cost of one jitted step call, by model depth: module-level jit vs bound steps.

"Before" is the module-level `steps.forward(params, state, plan, graphdef=...,
config=...)`, whose static graph definition is hashed and whose `nnx.State` is
flattened in Python on every call; "after" is `steps.bind(model, config).forward(state,
plan)` (what `ModelExecutor` calls): statics closed over, parameters a flat tuple.

Per depth, the same plan (`--batch` decode rows) goes through both in the same run:
  * counted per call: the graph definition's `__hash__` calls and the Python function
    calls (`sys.setprofile`), exact;
  * timed: `--calls` back-to-back calls per repeat, then `block_until_ready`; the
    median over `--repeats` of the mean per call (depths and paths take turns
    within a repeat). XLA:CPU runs small programs inline in the calling thread, so the timing
    uses a hollow model (TinyLlama's parameters, a step that computes nothing per
    layer): what is left is the host's work. "fixed" is "after" with the
    parameters of the smallest depth's model on the same pool: the call without
    the C++ argument handling JAX's dispatch does per parameter array (a model
    with stacked, scanned layers has a fixed number of them); it is flat in depth.
Before any number is printed, the real tiny model's outputs of both paths are
checked equal (tokens, logits, pool state).

Usage:
  PYTHONPATH=. python benchmarks/bench_dispatch.py [--layers=2,8,32 --calls=100 --repeats=7]
"""

from __future__ import annotations

import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.model import StepPlan, llama, steps

_LAYERS = flags.DEFINE_list("layers", ["2", "8", "32"], "Model depths.")
_BATCH = flags.DEFINE_integer("batch", 8, "Decode rows per step.")
_CALLS = flags.DEFINE_integer("calls", 100, "Back-to-back calls per timed repeat.")
_REPEATS = shared_flags.define_repeats(7, "Timed repeats (median reported).")
_SEED = shared_flags.define_seed("Weights seed.")
_RECORD = shared_flags.define_record()


class HollowLlama(llama.TinyLlama):
  """TinyLlama's parameters behind a step that computes nothing per layer."""

  def __call__(self, tokens, pages, meta, *, impl=None, interpret=None, logits_indices=None):
    del meta, impl, interpret
    rows = tokens.shape[0] if logits_indices is None else logits_indices.shape[0]
    return pages, jnp.zeros((rows, self.config.vocab_size), jnp.float32)


def _configs(num_layers: int):
  mc = llama.LlamaConfig(num_layers=num_layers, d_model=32, num_q_heads=2, num_kv_heads=1,
                         head_dim=16, ffn_dim=64, vocab_size=64)
  b = _BATCH.value
  pc = llama.pool_config_for(mc, num_blocks=4 * b, block_size=4, max_seqs=b, max_segments=4)
  return mc, pc


def _decode_state(pc, b: int):
  """A pool with `b` open rows of one cached token each, and their decode plan."""
  state = paged_kv.init_pool(pc)
  ids = np.arange(b, dtype=np.int32)
  z = np.zeros((b, 1), np.int32)
  state, status = paged_kv.open_sequence(state, ids, z, z, z, np.zeros((b,), np.int32),
                                         config=pc)
  assert (np.asarray(status) == 0).all()
  plan = StepPlan.build([(i, [i % 7 + 1]) for i in range(b)], num_rows=b, max_query_len=1)
  return state, plan


def _check_equal(num_layers: int) -> None:
  """Both paths on the real tiny model: the same tokens, logits and pool state."""
  mc, pc = _configs(num_layers)
  model = llama.TinyLlama(mc, rngs=nnx.Rngs(_SEED.value))
  graphdef, params = nnx.split(model)
  state, plan = _decode_state(pc, _BATCH.value)
  before = steps.forward(params, jax.tree.map(jnp.copy, state), plan, graphdef=graphdef,
                         config=pc)
  after = steps.bind(model, pc).forward(state, plan)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if not (np.asarray(after[1][0]) >= 0).all():
    raise AssertionError("a decode row sampled no token")


def _count(call, graphdef) -> tuple[int, int]:
  """(graph definition hashes, Python function calls) of one `call()`."""
  cls = type(graphdef)
  orig, hashes, calls = cls.__hash__, [0], [0]

  def counting(self):
    hashes[0] += 1
    return orig(self)

  def profile(frame, event, arg):
    del frame, arg
    if event == "call":
      calls[0] += 1

  cls.__hash__ = counting
  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
    cls.__hash__ = orig
  return hashes[0], calls[0]


def _setup(num_layers: int, fixed_layers: int) -> tuple[dict, tuple]:
  """A depth's row (counts filled in) and its compiled, warm `(name, call)` paths."""
  mc, pc = _configs(num_layers)
  model = HollowLlama(mc, rngs=nnx.Rngs(_SEED.value))
  graphdef, params = nnx.split(model)
  bound = steps.bind(model, pc)
  state, plan = _decode_state(pc, _BATCH.value)
  # Padding rows (seq_ids -1): the pool does not fill up over thousands of calls.
  plan = StepPlan(np.full_like(plan.seq_ids, -1), plan.num_new, plan.tokens)
  holder = {"state": state}

  def before():
    holder["state"], out = steps.forward(params, holder["state"], plan, graphdef=graphdef,
                                         config=pc)
    return out

  def after():
    holder["state"], out = bound.forward(holder["state"], plan)
    return out

  fixed_steps = steps.bind(HollowLlama(_configs(fixed_layers)[0], rngs=nnx.Rngs(_SEED.value)),
                           pc)

  def fixed():
    holder["state"], out = fixed_steps.forward(holder["state"], plan)
    return out

  row = {"layers": num_layers, "param_arrays": len(bound.leaves),
         "fixed_arrays": len(fixed_steps.leaves)}
  paths = (("before", before), ("after", after), ("fixed", fixed))
  for name, fn in paths:
    jax.block_until_ready(fn())  # compile
    jax.block_until_ready(fn())
    row[f"{name}_us"] = []
  for name, fn in paths[:2]:
    row[f"{name}_hashes"], row[f"{name}_python_calls"] = _count(fn, graphdef)
  return row, paths


def _time(fn) -> float:
  """Mean microseconds per call of `--calls` back-to-back calls, results waited for."""
  start = time.perf_counter()
  for _ in range(_CALLS.value):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / _CALLS.value * 1e6


def main(argv):
  del argv
  layers = [int(x) for x in _LAYERS.value]
  rec = records.Recorder(_RECORD.value, "bench_dispatch", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  for num_layers in layers:
    _check_equal(num_layers)
  setups = [_setup(n, layers[0]) for n in layers]
  for _ in range(_REPEATS.value):  # depths and paths take turns within a repeat
    for row, paths in setups:
      for name, fn in paths:
        row[f"{name}_us"].append(_time(fn))
  rows = [row for row, _ in setups]
  print(f"batch={_BATCH.value} calls={_CALLS.value} repeats={_REPEATS.value} (median of the "
        f"per-call mean); backend {jax.default_backend()}; outputs of both paths equal")
  print(f"{'layers':>6} {'arrays':>6} {'hashes/call':>12} {'py calls/call':>14} "
        f"{'before us':>10} {'after us':>9} {'speedup':>8} "
        f"{'fixed us (' + str(rows[0]['fixed_arrays']) + ' arrays)':>22} {'vs first':>9}")
  med = lambda r, k: statistics.median(r[f"{k}_us"])
  for r in rows:
    b, a = med(r, "before"), med(r, "after")
    vs = records.format_median_range([x / f for x, f in zip(r["fixed_us"], rows[0]["fixed_us"])],
                                     suffix="x")
    print(f"{r['layers']:>6} {r['param_arrays']:>6} "
          f"{r['before_hashes']:>5} -> {r['after_hashes']:<4} "
          f"{r['before_python_calls']:>6} -> {r['after_python_calls']:<5} "
          f"{b:>10.1f} {a:>9.1f} {b / a:>7.1f}x {med(r, 'fixed'):>22.1f} {vs}")
  rec.write({"batch": _BATCH.value, "calls": _CALLS.value, "rows": rows},
            notes=["hollow model for the timings: TinyLlama's parameters, no per-layer work",
                   "fixed: the smallest depth's parameters on each depth's pool"])


if __name__ == "__main__":
  app.run(main)
