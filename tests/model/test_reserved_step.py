"""A step whose slots the host reserved (`BlockPool.reserve_step`, `plan.reserved`) computes
what the step that reserves inside its program computes: tokens, logits, statuses, every
page and the pool's bookkeeping (but the blocks' `last_use` stamps), failed rows included; its program holds no allocator;
the multi-step decodes refuse such a plan."""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jex_core
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.model import StepPlan, llama, metadata, steps
from paged_kv.pool import step_reservation

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=24, block_size=8, max_seqs=4,
                             max_segments=16)


@pytest.fixture(scope="module", name="bound")
def _bound() -> steps.ModelSteps:
  return steps.bind(llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(3)), POOL)


def _plans(rng, nxt):
  """Prefill, mixed prefill + decode, decode: the rows' tokens by step."""
  tok = lambda n: rng.integers(1, MODEL_CONFIG.vocab_size, n).tolist()
  yield StepPlan.build([(0, tok(13)), (1, tok(16))], num_rows=4, max_query_len=16)
  yield StepPlan.build([(0, [int(nxt()[0])]), (1, [int(nxt()[1])]), (2, tok(9))], num_rows=4,
                       max_query_len=16)
  yield StepPlan.build([(i, [int(nxt()[i])]) for i in range(3)], num_rows=4, max_query_len=1)


def _serve(bound: steps.ModelSteps, *, reserved: bool, hold: int = 0,
           grow: bool = False) -> list[np.ndarray]:
  """Runs `_plans` through a pool (`hold` blocks taken first: rows may fail), with the
  host's reservation (`reserve_step`; `grow`: the in-place rows applied by the step)
  or the step's own (`step_reservation.predict_step`)."""
  pool = paged_kv.BlockPool(POOL)
  pool.open_sequences([None] * 3)
  if hold:
    pool.allocate(hold)
  outs: list[np.ndarray] = []
  last = [None]
  for plan in _plans(np.random.default_rng(0), lambda: last[0]):
    if reserved:
      pred = pool.reserve_step(plan.seq_ids, plan.num_new, max_new_tokens=plan.max_query_len,
                               grow_in_step=grow)
      plan = dataclasses.replace(plan, reserved=metadata.reserved_slots(
          plan, pred.slot_idx, pred.status, pred.grow if grow else None, pred.clock))
    else:
      pred = step_reservation.predict_step(pool, plan.seq_ids, plan.num_new,
                                           max_new_tokens=plan.max_query_len)
    state, (nxt, logits, status) = bound.forward(pred.state, plan)
    pool.adopt_step(state, pred, device_status=status)
    np.testing.assert_array_equal(np.asarray(status), pred.status)
    last[0] = np.asarray(nxt)
    outs += [np.asarray(nxt), np.asarray(logits), np.asarray(status)]
  pool.verify()  # the mirror is the device's bookkeeping, field by field
  state = pool.state
  if not hold:
    paged_kv.check_invariants(state)
  # `meta.last_use` is left out: a commit stamps every block of its window with the
  # window's final clock (not mirrored; device metrics only), so blocks queued in the
  # same window as a host reservation get a later stamp than the step's own would give.
  state = dataclasses.replace(state, meta=dataclasses.replace(state.meta, last_use=None))
  return outs + [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("hold,grow", [(0, False), (19, False), (0, True), (19, True)])
def test_host_reserved_step_equals_the_reserving_step(bound, hold, grow):
  """Equal outputs and final pool state; with `hold`, the mixed step's chunk fails
  (no free block) on both paths the same way; with `grow`, the rows that grow in
  place are applied by the step (`ReservedSlots.grow`), not the commit."""
  want = _serve(bound, reserved=False, hold=hold)
  got = _serve(bound, reserved=True, hold=hold, grow=grow)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  statuses = [want[i] for i in range(2, 9, 3)]
  if hold:
    assert (statuses[1] != Status.OK).any()  # the case meant: a row failed
  else:
    assert all((s == Status.OK).all() for s in statuses)


def _calls(jaxpr) -> set[str]:
  """Names of the jitted functions a jaxpr calls (nested bodies included)."""
  names = set()
  for eqn in jaxpr.eqns:
    if "name" in eqn.params:
      names.add(eqn.params["name"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          names |= _calls(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          names |= _calls(sub)
  return names


def test_host_reserved_step_has_no_allocator(bound):
  state = jax.eval_shape(lambda: paged_kv.init_pool(POOL))
  plan = StepPlan.build([(0, [1, 2, 3]), (1, [4])], num_rows=4, max_query_len=8)
  with_slots = dataclasses.replace(plan, reserved=metadata.reserved_slots(
      plan, np.zeros((4, 8), np.int32), np.zeros((4,), np.int32)))
  trace = lambda p: jax.make_jaxpr(lambda s, q: bound.jitted["forward"](bound.leaves, s, q))(
      state, p).jaxpr
  assert "reserve_tokens" in _calls(trace(plan))
  assert "reserve_tokens" not in _calls(trace(with_slots))


def test_multi_step_decodes_refuse_a_host_reservation(bound):
  plan = StepPlan.build([(0, [1])], num_rows=4, max_query_len=1)
  plan = dataclasses.replace(plan, reserved=metadata.reserved_slots(
      plan, np.zeros((4, 1), np.int32), np.zeros((4,), np.int32)))
  state = paged_kv.init_pool(POOL)
  with pytest.raises(InvalidArgument, match="reserved"):
    bound.decode_steps(state, plan, np.ones((4,), np.int32), num_steps=2)
  assert not state.pages.k.is_deleted()  # refused before the call: nothing donated
