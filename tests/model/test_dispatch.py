"""A step call's host work does not grow with the model: counted, not timed.

The bound steps (`steps.bind`, used by `ModelExecutor`, `PagedRunner` and the
sharded executor) close over the graph definition and hold the parameters as a
flat tuple of arrays: per call, 0 hashes of the `nnx.GraphDef`, no Python call
into flax (the `nnx.State` flatten is one) and the same Python calls at 2 and 32
layers; a second call of a shape compiles nothing.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import StepPlan, llama, steps
from paged_kv.model.plan import CarriedTokens
from paged_kv.model.runner import PagedRunner
from paged_kv.model.sampling import SamplingBatch
from paged_kv.runtime import counters
from paged_kv.scheduler.executor import ModelExecutor

B = 4


def _configs(num_layers: int, scan_layers: bool = False):
  # Unrolled by default: a parameter tree that grows with depth (as many users'
  # models do) is what the bound steps must keep off the call path.
  mc = llama.LlamaConfig(num_layers=num_layers, d_model=8, num_q_heads=1, num_kv_heads=1,
                         head_dim=8, ffn_dim=8, vocab_size=16, scan_layers=scan_layers)
  return mc, llama.pool_config_for(mc, num_blocks=16, block_size=4, max_seqs=B, max_segments=4)


def _model(num_layers: int, scan_layers: bool = False
           ) -> tuple[llama.TinyLlama, paged_kv.PoolConfig]:
  mc, pc = _configs(num_layers, scan_layers)
  return llama.TinyLlama(mc, rngs=nnx.Rngs(0)), pc


def _plan(sampled: bool = False) -> StepPlan:
  plan = StepPlan.build([], num_rows=B, max_query_len=1, num_tokens=B)
  if sampled:
    plan = StepPlan(plan.seq_ids, plan.num_new, plan.tokens, sampling=SamplingBatch.greedy(B))
  return plan


@contextlib.contextmanager
def _python_calls():
  """Records the code objects of every Python function called inside the block."""
  calls = []
  prev = sys.getprofile()
  sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code)
                 if event == "call" else None)
  try:
    yield calls
  finally:
    sys.setprofile(prev)


@contextlib.contextmanager
def _graphdef_hashes(graphdef):
  """Counts calls of the graph definition class's `__hash__` inside the block."""
  cls = type(graphdef)
  orig = cls.__hash__
  count = [0]

  def counting(self):
    count[0] += 1
    return orig(self)

  cls.__hash__ = counting
  try:
    yield count
  finally:
    cls.__hash__ = orig


def _flax_calls(calls) -> list[str]:
  return [f"{c.co_filename}:{c.co_name}" for c in calls if "/flax/" in c.co_filename]


def _executor_step_calls(num_layers: int, sampled: bool):
  """Python calls, flax calls and graph hashes of one warm `ModelExecutor.step`."""
  model, pc = _model(num_layers)
  ex = ModelExecutor(model, pc)
  state = paged_kv.init_pool(pc)
  plan = _plan(sampled)
  for _ in range(2):  # compile, then one warm call
    state, *_ = ex.step(state, plan)
  with _graphdef_hashes(ex.graphdef) as hashes, _python_calls() as calls:
    state, *_ = ex.step(state, plan)
  return len(calls), _flax_calls(calls), hashes[0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_executor_step_hashes_and_flattens_nothing_flat_in_depth(sampled):
  n2, flax2, hashes2 = _executor_step_calls(2, sampled)
  n32, flax32, hashes32 = _executor_step_calls(32, sampled)
  assert hashes2 == hashes32 == 0
  assert flax2 == flax32 == []  # no nnx.State flatten, no graph walk
  # The Python work of a call is the same at 2 and 32 layers (<= 1.2x asked).
  assert n32 == n2, (n2, n32)
  assert n32 <= 12  # the executor's and the bound step's frames, the outputs' dataclasses


def test_module_level_step_hashes_the_graph_every_call():
  """What the bound steps avoid: the module-level jit hashes the graph definition and
  flattens the parameters in flax's Python on every call (growing with depth)."""
  counts = []
  for num_layers in (2, 8):
    model, pc = _model(num_layers)
    graphdef, params = nnx.split(model)
    state = paged_kv.init_pool(pc)
    kw = dict(graphdef=graphdef, config=pc)
    plan = _plan()
    state, _ = steps.forward(params, state, plan, **kw)
    with _graphdef_hashes(graphdef) as hashes, _python_calls() as calls:
      state, _ = steps.forward(params, state, plan, **kw)
    assert hashes[0] >= 1 and _flax_calls(calls)
    counts.append(len(calls))
  assert counts[1] > counts[0]


def test_runner_calls_flat_in_depth():
  counts = []
  for num_layers in (2, 32):
    model, pc = _model(num_layers)
    runner = PagedRunner(model, pc, prefill_chunk=4)
    rows = [runner.open([1, 2, 3], max_new_tokens=8) for _ in range(2)]
    runner.prefill(rows)
    runner.decode(num_tokens=1)  # compiles
    ids, tokens = np.full((B,), -1, np.int32), np.zeros((B,), np.int32)
    with _graphdef_hashes(runner.graphdef) as hashes, _python_calls() as calls:
      runner.state, _ = runner.steps.decode_step(runner.state, ids, tokens)
    assert hashes[0] == 0 and not _flax_calls(calls)
    counts.append(len(calls))
  assert counts[0] == counts[1]


def test_bound_steps_compile_once_per_shape():
  model, pc = _model(2)
  ex = ModelExecutor(model, pc)
  state = paged_kv.init_pool(pc)
  z = np.zeros((1, 1), np.int32)
  state, status = paged_kv.open_sequence(state, np.array([0], np.int32), z, z, z,
                                         np.zeros((1,), np.int32), config=pc)
  plan = StepPlan.build([(0, [1, 2, 3])], num_rows=B, max_query_len=4, num_tokens=8)
  state, nxt, status = ex.step(state, plan)
  # Decode steps: plain tokens, then carried ones (a device array from the previous
  # step: a program of its own, compiled once).
  plan = StepPlan.build([(0, [int(nxt[0])])], num_rows=B, max_query_len=1, num_tokens=B)
  state, nxt, status = ex.step(state, plan)
  carried = lambda prev: StepPlan(plan.seq_ids, plan.num_new, np.zeros((B,), np.int32),
                                  carried=CarriedTokens(prev, np.array([0, -1, -1, -1],
                                                                        np.int32)))
  state, nxt, status = ex.step(state, carried(nxt))
  size, compiles = ex.steps.cache_size(), counters.backend_compiles()
  for _ in range(3):
    state, nxt, status = ex.step(state, carried(nxt))
  state, nxt, status = ex.step(state, StepPlan.build([(0, [int(nxt[0])])], num_rows=B,
                                                     max_query_len=1, num_tokens=B))
  assert ex.steps.cache_size() == size == 3
  assert counters.backend_compiles() == compiles
  np.testing.assert_array_equal(np.asarray(status), 0)
  assert int(state.table.seq_len[0]) == 3 + 6  # the prompt, then six decodes


def test_resize_binds_anew_and_release_clears_every_binding():
  model, pc = _model(2)
  ex = ModelExecutor(model, pc)
  state = paged_kv.init_pool(pc)
  state, *_ = ex.step(state, _plan())
  old = ex.steps
  assert old.cache_size() == 1
  ex.resize(paged_kv.core.regions.resized_config(pc, 12))
  assert ex.steps is not old and ex.steps.config.num_blocks == 12
  assert ex.steps.leaves is old.leaves  # the parameters are not flattened again
  state = paged_kv.init_pool(ex.config)
  state, *_ = ex.step(state, _plan())
  assert ex.steps.cache_size() == 1
  steps.release_programs()
  assert ex.steps.cache_size() == old.cache_size() == 0


def test_set_params_checks_the_structure():
  model, pc = _model(2)
  bound = steps.bind(model, pc)
  other, _ = _model(3)
  with pytest.raises(paged_kv.InvalidArgument):
    bound.set_params(nnx.state(other))
  with pytest.raises(paged_kv.InvalidArgument):
    steps.bind(model, "pool")
  scanned, spc = _model(2, scan_layers=True)
  deeper, _ = _model(3, scan_layers=True)  # the same tree, stacked 3 deep
  with pytest.raises(paged_kv.InvalidArgument, match="shape"):
    steps.bind(scanned, spc).set_params(nnx.state(deeper))
  bound.set_params(nnx.state(model))  # the same structure: accepted
