"""The full serving stack changes no token: scheduler + pool + radix cache + model.

Greedy fp32 generation of a batch of requests with shared prefixes, run by the
`Scheduler` with the tiny model (`ModelExecutor`: ONE mixed prefill/decode forward
pass per step) under pool pressure (prefix hits, eviction,
preemption by recompute and by swap, compaction forced every step, slot packing
where available), must equal the dense no-cache reference token for token, with
the invariant checker (cache references included) passing after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.core import compact
from paged_kv.model import llama
from paged_kv.model.reference import generate_dense
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

pytestmark = pytest.mark.slow

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def workload(model):
  rng = np.random.default_rng(3)
  tok = lambda n: rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist()
  system = tok(9)
  prompts = [system + tok(int(rng.integers(2, 9))) for _ in range(6)] + [tok(7), tok(5)]
  dense = generate_dense(model, prompts, NEW_TOKENS)
  return prompts, dense


class RecordingExecutor(ModelExecutor):
  """A `ModelExecutor` that records the kinds of rows of every forward pass."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls = []  # (decode rows, prefill rows) per call

  def step(self, state, plan):
    live = np.asarray(plan.seq_ids) >= 0
    num_new = np.asarray(plan.num_new)
    self.calls.append((int(np.sum(live & (num_new == 1))), int(np.sum(live & (num_new > 1)))))
    return super().step(state, plan)


def _serve(model, prompts, *, num_blocks, preemption, compaction=None, max_batch=4,
           pack_tails=False, base_pool_fraction=0.0, promote_readers=0):
  pool_config = llama.pool_config_for(MODEL_CONFIG, num_blocks=num_blocks, block_size=4,
                                   max_seqs=4, max_segments=24,
                                   base_pool_fraction=base_pool_fraction)
  pool = paged_kv.BlockPool(pool_config)
  sched = Scheduler(pool, RecordingExecutor(model, pool_config),
                    SchedulerConfig(max_batch=max_batch, prefill_chunk=8,
                                    prefill_token_budget=16, preemption=preemption,
                                    compaction=compaction, pack_tails=pack_tails,
                                    output_reserve_ratio=0.0,
                                    promote_readers=promote_readers, promote_every=1))
  reqs = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
  for r in reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    calls = len(sched.executor.calls)
    sched.step()
    sched.check_invariants()
    assert len(sched.executor.calls) <= calls + 1, "more than one forward pass in a step"
    steps += 1
    assert steps < 500
  return sched, reqs


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_pressure_and_preemption_change_no_token(model, workload, preemption):
  prompts, dense = workload
  sched, reqs = _serve(model, prompts, num_blocks=14, preemption=preemption)
  for r, want in zip(reqs, dense):
    assert r.tokens.tolist() == want, r.request_id
  st = sched.stats
  assert st.preemptions > 0 and st.evictions > 0 and st.hit_tokens > 0, st
  # Prefill chunks and decodes shared forward passes.
  assert any(d and p for d, p in sched.executor.calls), sched.executor.calls
  if preemption == "swap":
    assert st.preemptions_swap > 0 and st.swap_to_host_bytes > 0


# `make test` keeps token equality under pressure and preemption (both modes).
@pytest.mark.long
def test_forced_compaction_and_promotion_change_no_token(model, workload):
  prompts, dense = workload
  policy = compact.CompactionPolicy(threshold=0.0, budget=3)
  sched, reqs = _serve(model, prompts, num_blocks=48, preemption="recompute",
                       compaction=policy, base_pool_fraction=0.2, promote_readers=3)
  for r, want in zip(reqs, dense):
    assert r.tokens.tolist() == want, r.request_id
  assert sched.stats.compaction_moves > 0
  assert sched.stats.promotions > 0
  assert sched.stats.hit_tokens > 0


# `make test` keeps token equality under pressure and preemption (both modes).
@pytest.mark.long
def test_slotted_packing_changes_no_token(model, workload):
  """Finished sequences' tails are packed into slotted blocks; the next turn of each
  conversation (whole history + a new message) matches and reads them back."""
  prompts, dense = workload
  pool_config = llama.pool_config_for(MODEL_CONFIG, num_blocks=60, block_size=4, max_seqs=4,
                                   max_segments=24)
  pool = paged_kv.BlockPool(pool_config)
  sched = Scheduler(pool, ModelExecutor(model, pool_config),
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    pack_tails=True, compaction=None))
  turn2 = [d + [7, 9] for d in dense[:4]]
  dense2 = generate_dense(model, turn2, NEW_TOKENS)
  for phase, (ps, want) in enumerate(((prompts, dense), (turn2, dense2))):
    reqs = [Request((phase, i), p, NEW_TOKENS) for i, p in enumerate(ps)]
    for r in reqs:
      sched.submit(r)
    while not sched.idle:
      sched.step()
      sched.check_invariants()
    for r, w in zip(reqs, want):
      assert r.tokens.tolist() == w, r.request_id
    if phase == 0:
      assert sched.stats.pack_moves > 0
  # Every second turn re-read its whole first turn from the cache, packed tail included.
  for r, first in zip(reqs, dense[:4]):
    assert r.hit_tokens == len(first) - 1, (r.request_id, r.hit_tokens)
