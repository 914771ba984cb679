"""k decode steps per dispatch (`Executor.decode_steps`) equal k single steps.

The tokens (greedy, seeded sampling, with logprobs), the statuses and the pool state
after it (K/V pages and bookkeeping, bit for bit) equal k `step` calls on the same
rows, with a row leaving once its `remaining` steps are done or a reservation
failed; carried tokens are resolved inside the program. `DryExecutor`'s version is
the same reservations. The pure functions are checked jitted and not (chex).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

import paged_kv
from paged_kv.core import sequences
from paged_kv.core.errors import Status
from paged_kv.model import StepPlan, llama, multistep, steps
from paged_kv.model.plan import CarriedTokens
from paged_kv.model.sampling import SamplingBatch
from paged_kv.parallel import sharding
from paged_kv.parallel.executor import ShardedModelExecutor
from paged_kv.scheduler.executor import DryExecutor, ModelExecutor

MODEL = llama.LlamaConfig(num_layers=2)
POOL = llama.pool_config_for(MODEL, num_blocks=24, block_size=4, max_seqs=4, max_segments=8)
B = 4
PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11], 1: [12, 13, 14, 15, 16, 17], 2: [18, 19, 20, 21, 22]}
SEQ_IDS = np.array([0, 1, 2, -1], np.int32)

_EXECUTOR = None


def _executor() -> ModelExecutor:
  """One executor for the module: its programs compile once for every test."""
  global _EXECUTOR
  if _EXECUTOR is None:
    _EXECUTOR = ModelExecutor(llama.TinyLlama(MODEL, rngs=nnx.Rngs(0)), POOL)
  return _EXECUTOR


def _prefilled(ex, *, free_blocks: int | None = None):
  """A pool holding the three prompts, and each row's pending token; with
  `free_blocks`, all but that many free blocks taken."""
  state = paged_kv.init_pool(POOL)
  ids = np.array(list(PROMPTS), np.int32)
  z = np.zeros((len(ids), 1), np.int32)
  state, status = paged_kv.open_sequence(state, ids, z, z, z, np.zeros((len(ids),), np.int32),
                                         config=POOL)
  np.testing.assert_array_equal(status, 0)
  plan = StepPlan.build(list(PROMPTS.items()), num_rows=B, max_query_len=8, num_tokens=32)
  state, nxt, status = ex.step(state, plan)
  np.testing.assert_array_equal(status, 0)
  if free_blocks is not None:
    take = int(state.meta.num_free) - free_blocks
    state, (_, status) = paged_kv.allocate(state, take, config=POOL, max_blocks=POOL.num_blocks,
                                           contiguous="never")
    assert int(status) == 0
  pending = np.zeros((B,), np.int32)
  pending[:3] = np.asarray(nxt)[:3]
  return state, pending


def _sampling(mode: str) -> tuple[SamplingBatch | None, int]:
  if mode == "greedy":
    return None, 0
  b = SamplingBatch.greedy(B)
  hot = dataclasses.replace(b, temperature=np.array([0.9, 0.0, 1.3, 0.7], np.float32),
                            top_k=np.array([0, 0, 20, 0], np.int32),
                            seed=np.array([11, 12, 13, 14], np.uint32),
                            index=np.array([1, 1, 1, 0], np.int32))
  return hot, (3 if mode == "logprobs" else 0)


def _copy(state):
  return jax.tree.map(jnp.copy, state)


def _single_steps(ex, state, tokens, remaining, k, sampling, num_logprobs):
  """The reference: k `step` calls; a row runs while it has steps left and no failure."""
  live = SEQ_IDS >= 0
  failed = np.zeros((B,), bool)
  tokens = tokens.copy()
  outs = []
  for j in range(k):
    run = live & (j < remaining) & ~failed
    plan = StepPlan(seq_ids=np.where(run, SEQ_IDS, -1).astype(np.int32),
                    num_new=np.ones((B,), np.int32), tokens=tokens, max_query_len=1,
                    num_logprobs=num_logprobs,
                    sampling=None if sampling is None else dataclasses.replace(
                        sampling, index=sampling.index + j))
    state, nxt, status, *out = ex.step(state, plan)
    nxt, status = np.asarray(nxt), np.asarray(status)
    ok = run & (status == Status.OK)
    failed |= run & (status != Status.OK)
    tokens = np.where(ok, nxt, tokens).astype(np.int32)
    outs.append((np.where(ok, nxt, -1), status, out[0] if out else None))
  return state, outs


def _assert_states_equal(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


class ModelDecodeStepsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"k{k}_{mode}", k, mode) for k in (1, 3, 4) for mode in ("greedy", "sampled", "logprobs"))
  def test_equals_single_steps(self, k, mode):
    ex = _executor()
    state, pending = _prefilled(ex)
    sampling, num_logprobs = _sampling(mode)
    remaining = np.array([k, 2, 0, 0], np.int32)  # row 2 has no budget, row 3 is padding
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=(SEQ_IDS >= 0).astype(np.int32), tokens=pending,
                    max_query_len=1, sampling=sampling, num_logprobs=num_logprobs)
    ref_state, ref = _single_steps(ex, _copy(state), pending, remaining, k, sampling,
                                   num_logprobs)
    state, tokens, status, *out = ex.decode_steps(state, plan, remaining, num_steps=k)
    tokens, status = np.asarray(tokens), np.asarray(status)
    self.assertEqual(tokens.shape, (k, B))
    np.testing.assert_array_equal(tokens, np.stack([r[0] for r in ref]))
    np.testing.assert_array_equal(status, np.stack([r[1] for r in ref]))
    self.assertTrue((tokens[:, 0] >= 0).all() and (tokens[:, 2:] == -1).all())
    self.assertTrue((tokens[:min(k, 2), 1] >= 0).all() and (tokens[2:, 1] == -1).all())
    _assert_states_equal(state, ref_state)
    paged_kv.check_invariants(state)
    if sampling is None:
      self.assertEqual(out, [])
      return
    (out,) = out
    self.assertEqual(out.top_ids.shape, (k, B, num_logprobs))
    ran = tokens >= 0
    np.testing.assert_array_equal(out.tokens, tokens)
    for name in ("logprob", "top_ids", "top_logprobs"):
      want = np.stack([np.asarray(getattr(r[2], name)) for r in ref])
      np.testing.assert_array_equal(np.asarray(getattr(out, name))[ran], want[ran], err_msg=name)

  @parameterized.named_parameters(("greedy", "greedy"), ("sampled", "logprobs"))
  def test_a_failed_reservation_ends_the_row(self, mode):
    ex = _executor()
    # One free block: row 0 takes it at step 1; rows 1 and 2 need one at steps 2 and 3.
    state, pending = _prefilled(ex, free_blocks=1)
    sampling, num_logprobs = _sampling(mode)
    remaining = np.array([4, 4, 4, 0], np.int32)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=(SEQ_IDS >= 0).astype(np.int32), tokens=pending,
                    max_query_len=1, sampling=sampling, num_logprobs=num_logprobs)
    ref_state, ref = _single_steps(ex, _copy(state), pending, remaining, 4, sampling,
                                   num_logprobs)
    state, tokens, status, *_ = ex.decode_steps(state, plan, remaining, num_steps=4)
    status = np.asarray(status)
    np.testing.assert_array_equal(status, np.stack([r[1] for r in ref]))
    np.testing.assert_array_equal(status[:, 1], [0, 0, Status.NO_FREE_BLOCK, 0])
    np.testing.assert_array_equal(status[:, 2], [0, 0, 0, Status.NO_FREE_BLOCK])
    np.testing.assert_array_equal(np.asarray(tokens)[:, 1] >= 0, [True, True, False, False])
    np.testing.assert_array_equal(tokens, np.stack([r[0] for r in ref]))
    np.testing.assert_array_equal(np.asarray(state.table.seq_len)[:3], [11, 8, 8])
    _assert_states_equal(state, ref_state)

  def test_carried_tokens_are_resolved_in_the_program(self):
    ex = _executor()
    state, pending = _prefilled(ex)
    remaining = np.array([3, 3, 3, 0], np.int32)
    # Rows 0 and 2 take their token from a device array (in another order), row 1
    # from the plan; the tokens are padded to 8 positions.
    prev = jnp.asarray([pending[2], 0, pending[0], 0], jnp.int32)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=(SEQ_IDS >= 0).astype(np.int32),
                    tokens=np.array([0, pending[1], 0, 0, 0, 0, 0, 0], np.int32),
                    max_query_len=1,
                    carried=CarriedTokens(prev, np.array([2, -1, 0, -1, -1, -1, -1, -1],
                                                         np.int32)))
    ref_state, ref = _single_steps(ex, _copy(state), pending, remaining, 3, None, 0)
    state, tokens, status = ex.decode_steps(state, plan, remaining, num_steps=3)
    np.testing.assert_array_equal(tokens, np.stack([r[0] for r in ref]))
    np.testing.assert_array_equal(status, 0)
    _assert_states_equal(state, ref_state)

  def test_the_pool_is_updated_in_place(self):
    ex = _executor()
    state, pending = _prefilled(ex)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=np.ones((B,), np.int32), tokens=pending)
    compiled = ex.steps.jitted["decode_steps"].lower(
        ex.steps.leaves, state, plan, np.ones((B,), np.int32), num_steps=3).compile()
    pages_bytes = 2 * state.pages.k.size * state.pages.k.dtype.itemsize
    self.assertGreaterEqual(compiled.memory_analysis().alias_size_in_bytes, pages_bytes)

  def test_bad_arguments_raise_before_the_call(self):
    ex = _executor()
    state, pending = _prefilled(ex)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=np.ones((B,), np.int32), tokens=pending)
    for bad_plan, remaining, k in (
        (dataclasses.replace(plan, max_query_len=2), np.ones((B,), np.int32), 2),
        (plan, np.ones((B + 1,), np.int32), 2),
        (plan, np.ones((B,), np.int32), 0),
        (plan, np.ones((B,), np.int32), 2.0)):
      with self.assertRaises(paged_kv.InvalidArgument):
        ex.decode_steps(state, bad_plan, remaining, num_steps=k)
      with self.assertRaises(paged_kv.InvalidArgument):
        DryExecutor(POOL).decode_steps(state, bad_plan, remaining, num_steps=k)
    self.assertFalse(state.pages.k.is_deleted())  # nothing was donated
    paged_kv.check_invariants(state)

  def test_executors_say_they_carry_tokens(self):
    self.assertTrue(ModelExecutor.carries_tokens)
    self.assertTrue(ShardedModelExecutor.carries_tokens)
    self.assertTrue(DryExecutor.carries_tokens)

  def test_sharded_executor_runs_the_same_steps(self):
    ex = ShardedModelExecutor(llama.TinyLlama(MODEL, rngs=nnx.Rngs(0)), POOL,
                              sharding.make_tp_mesh(1))
    state, pending = _prefilled(_executor())
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=np.ones((B,), np.int32), tokens=pending)
    remaining = np.array([3, 1, 3, 0], np.int32)
    want_state, want, _ = _executor().decode_steps(_copy(state), plan, remaining, num_steps=3)
    state, tokens, status = ex.decode_steps(state, plan, remaining, num_steps=3)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(status, 0)
    _assert_states_equal(state, want_state)


class _ReservingStep:
  """The dry decode's reference single step: one device reservation, no model math
  (`DryExecutor.step` reads a host reservation instead)."""

  def step(self, state, plan):
    state, (_, status) = sequences.reserve_tokens(state, plan.seq_ids, plan.num_new,
                                                 config=POOL, max_new_tokens=plan.max_query_len)
    return state, np.zeros(plan.seq_ids.shape, np.int32), status


class DryDecodeStepsTest(parameterized.TestCase):

  @parameterized.parameters(1, 3, 4)
  def test_equals_single_steps(self, k):
    ex = DryExecutor(POOL)
    state, pending = _prefilled(_executor(), free_blocks=1)
    remaining = np.array([k, 4, 2, 0], np.int32)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=np.ones((B,), np.int32), tokens=pending)
    ref_state, ref = _single_steps(_ReservingStep(), _copy(state), pending, remaining, k,
                                   None, 0)
    state, tokens, status = ex.decode_steps(state, plan, remaining, num_steps=k)
    np.testing.assert_array_equal(tokens, np.zeros((k, B), np.int32))
    np.testing.assert_array_equal(status, np.stack([r[1] for r in ref]))
    _assert_states_equal(state, ref_state)


class PureFunctionsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_reserve_decode_steps(self):
    fn = self.variant(multistep.reserve_decode_steps, static_argnames=("config", "num_steps"))
    state, _ = _prefilled(_executor(), free_blocks=1)
    want = _copy(state)
    state, status = fn(state, SEQ_IDS, np.array([4, 4, 4, 0], np.int32), config=POOL,
                       num_steps=4)
    failed = np.zeros((B,), bool)
    for j in range(4):
      ids = np.where((SEQ_IDS >= 0) & ~failed, SEQ_IDS, -1).astype(np.int32)
      want, (_, st) = sequences.reserve_tokens(want, ids, np.ones((B,), np.int32), config=POOL,
                                              max_new_tokens=1)
      np.testing.assert_array_equal(status[j], st)
      failed |= (ids >= 0) & (np.asarray(st) != 0)
    self.assertTrue(failed[1] and failed[2] and not failed[0])
    _assert_states_equal(state, want)

  @chex.variants(with_jit=True, without_jit=True)
  def test_run_decode_steps(self):
    ex = _executor()
    graphdef = ex.graphdef

    def run(params, state, plan, remaining):
      return steps.run_decode_steps(nnx.merge(graphdef, params), state, plan, remaining,
                                    config=POOL, num_steps=2)

    fn = self.variant(run)
    state, pending = _prefilled(ex)
    plan = StepPlan(seq_ids=SEQ_IDS, num_new=np.ones((B,), np.int32), tokens=pending)
    remaining = np.array([2, 1, 2, 0], np.int32)
    want_state, want, _ = ex.decode_steps(_copy(state), plan, remaining, num_steps=2)
    state, (tokens, status) = fn(ex.params, state, plan, remaining)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(status, 0)
    self.assertEqual(int(np.asarray(tokens)[1, 1]), -1)
    _assert_states_equal(state, want_state)


if __name__ == "__main__":
  absltest.main()
