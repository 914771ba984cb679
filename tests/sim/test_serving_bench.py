"""`paged_kv.sim.serving_bench`: the closed loop, the bandwidth ceiling (SERVING.md's
H200 figures recomputed) and the comparison with a reference."""

from __future__ import annotations

import dataclasses

import numpy as np

import paged_kv
from paged_kv.model import hf_reference
from paged_kv.sim import serving_bench as sb
from paged_kv.sim import workload
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Scheduler, SchedulerConfig


def test_ceiling_reproduces_the_h200_serving_figures():
  """SERVING.md: weights 2.47 GB + K/V of 64 x 576 tokens at 4.3 TB/s is 0.856 ms, a
  ceiling of ~74,800 tokens/s; 6,369 tokens/s is 8.5% of it."""
  step = sb.decode_step_bytes(2_471_628_800, 2 * 16 * 8 * 64 * 2, 64, 576.0)
  top, share = sb.ceiling(6369.0, step, 4.3e12, 64)
  assert step == 3_679_588_352
  assert round(step / 4.3e12 * 1e3, 3) == 0.856 and round(top) == 74791
  assert round(100 * share, 1) == 8.5


def test_bytes_per_step():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_kv.model import llama  # pylint: disable=import-outside-toplevel
  tied = llama.LlamaConfig(vocab_size=64, d_model=16, num_layers=1, num_q_heads=2,
                           num_kv_heads=1, head_dim=8, ffn_dim=32, tie_embeddings=True)
  untied = dataclasses.replace(tied, tie_embeddings=False)
  w_tied = sb.weight_bytes_per_step(llama.TinyLlama(tied, rngs=nnx.Rngs(0)))
  w_untied = sb.weight_bytes_per_step(llama.TinyLlama(untied, rngs=nnx.Rngs(0)))
  # Untied: the head is read, the input embedding only gathered: the same bytes.
  assert w_tied == w_untied
  layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32 + 2 * 16
  assert w_tied == 4 * (64 * 16 + layer + 16)
  pool = llama.pool_config_for(tied, num_blocks=8, block_size=4, max_seqs=2, max_segments=4)
  assert sb.kv_bytes_per_token(pool) == 2 * 1 * 1 * 8 * 4


def test_closed_loop_keeps_the_batch_in_flight():
  config = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                               head_dim=2, max_seqs=4, max_segments=8)
  sched = Scheduler(paged_kv.BlockPool(config), DryExecutor(config),
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                                    compaction=None))
  seen = []
  step = sched.step

  def counted():
    seen.append(len(sched.running) + len(sched.waiting))
    step()

  sched.step = counted
  wl = workload.random_workload(7, 6, 3, 50, seed=1)
  res = sb.run_closed_loop(sched, wl, 3, first_id=100)
  assert max(seen) == 3 and res.requests == 7 and res.output_tokens == 21
  assert [len(o) for o in res.outputs] == [3] * 7 and len(res.step_s) == len(seen)
  f = res.figures()
  assert f["tokens_per_s"] > 0 and f["ttft_p50_ms"] >= 0 and f["steps"] == len(seen)
  sb.warm_run(sched, wl, 3, first_id=200)  # ids of its own: no clash with the run's


class _FakeReference:
  """`greedy` answers `theirs`; `check` reports a token off where ours differ."""

  def __init__(self, theirs):
    self.theirs = theirs
    self.calls = 0

  def greedy(self, prompts, output_lens, *, batch_size):
    del batch_size
    self.calls += 1
    out = [self.theirs[tuple(map(int, p))][:n] for p, n in zip(prompts, output_lens)]
    return hf_reference.GreedyResult(out, seconds=1.0)

  def check(self, prompts, outputs, *, tie_tolerance):
    off = [(i, k, 1.0) for i, (p, o) in enumerate(zip(prompts, outputs))
           for k, (a, b) in enumerate(zip(o, self.theirs[tuple(map(int, p))])) if a != b]
    return hf_reference.TokenCheck(sum(map(len, outputs)), off[:1] if off else [],
                                   tie_tolerance)


def test_compare_with_reference_one_generate_for_every_loop():
  prompts = {1: [np.array([5, 6]), np.array([7])], 2: [np.array([8, 9, 10])]}
  theirs = {(5, 6): [1, 2, 3], (7,): [4, 5, 6], (8, 9, 10): [7, 8, 9]}
  ref = _FakeReference(theirs)
  outputs = {(1, "sync"): [[1, 2, 3], [4, 5, 6]], (1, "overlapped"): [[1, 2, 3], [4, 0, 6]],
             (2, "sync"): [[7, 8, 9]]}
  verdicts, rate = sb.compare_with_reference(ref, prompts, {1: [3, 3], 2: [3]}, outputs)
  assert ref.calls == 1 and rate == 9.0
  assert verdicts[1, "sync"] == dict(compared=2, equal=2, first_diffs=[], tokens=6,
                                     tokens_off=0, off=[])
  assert verdicts[1, "overlapped"]["equal"] == 1
  assert verdicts[1, "overlapped"]["first_diffs"] == [(1, 1)]
  assert verdicts[1, "overlapped"]["off"] == [(1, 1, 1.0)]
  assert verdicts[2, "sync"]["equal"] == 1


def test_copy_rate_is_positive():
  assert sb.copy_rate(1 << 20, repeats=2, calls=2) > 0
