"""k decode steps per dispatch in the serving loop (`SchedulerConfig.decode_steps`).

When a step has no prompt chunk and nothing waits, the scheduler runs up to k
decode steps in one call (allocation inside the jitted step); the host predicts
the k reservations on its mirror. Tokens equal k = 1's (greedy and seeded
sampling, with logprobs, stop tokens inside the k steps, both loops); what a row
reserved past its stop is freed with its row; after warm-up nothing compiles.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.model import llama
from paged_kv.scheduler.executor import DryExecutor, ModelExecutor
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)


@pytest.fixture(scope="module")
def model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0))


def _prompts(seed=3, n=6):
  rng = np.random.default_rng(seed)
  tok = lambda k: rng.integers(0, MODEL_CONFIG.vocab_size, k).tolist()
  system = tok(9)
  return [system + tok(int(rng.integers(2, 9))) for _ in range(n)]


class CountingExecutor(ModelExecutor):
  """Counts its single and multi-step calls."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.single = self.multi = 0

  def step(self, state, plan):
    self.single += 1
    return super().step(state, plan)

  def decode_steps(self, state, plan, remaining, *, num_steps):
    self.multi += 1
    return super().decode_steps(state, plan, remaining, num_steps=num_steps)


def _serve(model, prompts, *, k, overlap, stop_token=-1, sampling=None, max_new=10,
           num_blocks=64, max_logprobs=0, staggered=False):
  pc = llama.pool_config_for(MODEL_CONFIG, num_blocks=num_blocks, block_size=4, max_seqs=4,
                             max_segments=24)
  executor = CountingExecutor(model, pc)
  sched = Scheduler(paged_kv.BlockPool(pc), executor,
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    compaction=None, output_reserve_ratio=0.0,
                                    stop_token=stop_token, overlap=overlap, decode_steps=k,
                                    max_logprobs=max_logprobs))
  reqs = [Request(i, p, max_new + (i % 3 if staggered else 0), sampling=sampling)
          for i, p in enumerate(prompts)]
  for r in reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    sched.step()
    sched.check_invariants()
    steps += 1
    assert steps < 500
  return sched, reqs


def test_k_steps_equal_one_step_greedy_with_stops(model):
  prompts = _prompts()
  _, base = _serve(model, prompts, k=1, overlap=False, staggered=True)
  stop = base[1].output[4]
  _, want = _serve(model, prompts, k=1, overlap=False, stop_token=stop, staggered=True)
  assert any(r.stop_reason == "stop_token" for r in want)
  for overlap in (False, True):
    sched, got = _serve(model, prompts, k=4, overlap=overlap, stop_token=stop, staggered=True)
    assert [r.output for r in got] == [r.output for r in want], overlap
    assert [r.stop_reason for r in got] == [r.stop_reason for r in want], overlap
    assert sched.executor.multi > 0
    sched.cached_pool.evict(num_tokens=10**9)
    assert (np.asarray(sched.pool.state.meta.ref_count) == 0).all(), ("blocks leaked", overlap)


def test_k_steps_equal_one_step_seeded_sampling_with_logprobs(model):
  prompts = _prompts(seed=5)
  sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2)
  _, want = _serve(model, prompts, k=1, overlap=False, sampling=sp, max_logprobs=2)
  sched, got = _serve(model, prompts, k=3, overlap=True, sampling=sp, max_logprobs=2)
  assert sched.executor.multi > 0
  assert [r.output for r in got] == [r.output for r in want]
  for g, w in zip(got, want):
    assert len(g.logprobs) == len(g.output)
    np.testing.assert_allclose([lp for lp, _ in g.logprobs], [lp for lp, _ in w.logprobs],
                               rtol=1e-5, atol=1e-6)


def test_k_steps_under_pressure_equal_one_step(model):
  """A pool too small for k steps of every row falls back to one step (or preempts)."""
  prompts = _prompts(seed=7)
  _, want = _serve(model, prompts, k=1, overlap=False, num_blocks=64)
  sched, got = _serve(model, prompts, k=4, overlap=True, num_blocks=16)
  assert [r.output for r in got] == [r.output for r in want]


def test_no_compile_after_warmup_one_dispatch_per_k_steps():
  cfg = paged_kv.PoolConfig(num_blocks=512, block_size=4, num_layers=1, num_kv_heads=1,
                            head_dim=2, max_seqs=8, max_segments=64)
  sched = Scheduler(paged_kv.BlockPool(cfg, debug=False), DryExecutor(cfg),
                    SchedulerConfig(max_batch=8, prefill_chunk=8, prefill_token_budget=64,
                                    decode_steps=4))
  sched.warmup(progress=False)
  rng = np.random.default_rng(0)
  for i in range(8):
    sched.submit(Request(i, rng.integers(0, 100, 10), 41))
  before = sched.runtime
  sched.run()
  traffic = sched.runtime.since(before)
  assert sched.stats.compiles_after_warmup == 0
  # 8 rows x 41 tokens: the first from the prefill, 40 in 10 calls of 4 steps.
  assert sched.stats.decode_tokens == 8 * 40
  assert traffic.dispatches["step"] <= 1 + 10 + 1, traffic.dispatches
  assert all(len(r.output) == 41 for r in sched.take_finished())
