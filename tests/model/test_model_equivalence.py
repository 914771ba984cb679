"""Greedy generation through the paged stack equals the dense reference, token for token.

The tiny Llama (`paged_kv.model.llama`, seeded random weights, fp32) generates
through the jitted steps of `paged_kv.model.steps` (driven by `PagedRunner`) —
`reserve_tokens`, `StepMetadata`, `paged_attention` (write K/V + the kernels' xla
paths), greedy sampling, all inside one jit per step — and through the dense
no-cache reference; every sampled token must agree.

Adding a scenario for a new feature (slot packing, compaction, swap, eviction) is
one call: `generate_paged(model, prompts, n, pool_config=POOL, hook=my_hook)`
where `my_hook(runner, tokens_done)` acts on `runner.state` between decode calls,
then `assert_matches_dense(model, runner)`. `PagedRunner` already has `fork`,
`force_next` and `preempt`/`resume` (recompute). Every test shares `POOL`, `CHUNK`
and the model so each step function compiles once for the whole file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_kv
from paged_kv.core.errors import Status

from paged_kv.model import llama, steps
from paged_kv.model.reference import dense_mismatches, generate_dense
from paged_kv.model.runner import PagedRunner, generate_paged, prefix_segments

MODEL_CONFIG = llama.LlamaConfig(num_layers=2)
# Small blocks so prompts span several blocks and prefixes end inside one.
POOL = llama.pool_config_for(MODEL_CONFIG, num_blocks=48, block_size=4, max_seqs=4,
                          max_segments=16)
CHUNK = 8  # prefill tokens per call: 11- and 12-token prompts take two chunks
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model() -> llama.TinyLlama:
  return llama.TinyLlama(MODEL_CONFIG, rngs=nnx.Rngs(0))


def assert_matches_dense(model: llama.TinyLlama, runner: PagedRunner) -> None:
  """Every token the paged stack sampled is the dense greedy choice; pool consistent."""
  records = [runner.records[s] for s in sorted(runner.records)]
  assert dense_mismatches(model, records) == []
  paged_kv.check_invariants(runner.state)


def shared_prefix_requests(seed: int = 0):
  """Four prompts: r1 shares r0's first 7 tokens (ends inside a block), r2 its
  first 8 (a block boundary), r3 is unrelated. Returns `(prompts, prefixes)`."""
  rng = np.random.default_rng(seed)
  tok = lambda n: rng.integers(0, MODEL_CONFIG.vocab_size, n).tolist()
  r0 = tok(12)
  prompts = [r0, r0[:7] + tok(3), r0[:8] + tok(4), tok(11)]
  return prompts, [None, (0, 7), (0, 8), None]


def _check_prefix_shared(runner: PagedRunner, tokens_done: int) -> None:
  """Hook: before decoding, r0's first two blocks are read by r1 and r2 as well."""
  if tokens_done == 0:
    blocks = prefix_segments(runner.state, 0, 8)[:, 0]
    refs = np.asarray(runner.state.meta.ref_count)[blocks]
    assert refs.tolist() == [3, 3], refs


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_shared_prefixes_match_dense(model, steps_per_call):
  prompts, prefixes = shared_prefix_requests()
  runner = generate_paged(model, prompts, NEW_TOKENS, pool_config=POOL, prefixes=prefixes,
                             steps_per_call=steps_per_call, prefill_chunk=CHUNK,
                             hook=_check_prefix_shared)
  dense = generate_dense(model, prompts, NEW_TOKENS)
  for i in range(len(prompts)):
    assert runner.records[i].tokens == dense[i], f"request {i}"
  assert_matches_dense(model, runner)


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_fork_then_both_branches_continue(model, steps_per_call):
  prompts, _ = shared_prefix_requests(seed=1)
  prompts = [prompts[0], prompts[3]]
  forks = {}

  def fork_once(runner, tokens_done):
    if not forks and tokens_done >= 3:
      # The parent's tail block is partly filled; after the fork it has two readers.
      tail = int(runner.segments(0)[-1, 0])
      child = runner.fork(0)
      assert int(runner.state.meta.ref_count[tail]) == 2
      pending = runner.records[child].tokens[-1]
      runner.force_next(child, (pending + 1) % MODEL_CONFIG.vocab_size)
      forks[child] = (tail, len(runner.records[child].tokens))

  runner = generate_paged(model, prompts, NEW_TOKENS, pool_config=POOL,
                             steps_per_call=steps_per_call, prefill_chunk=CHUNK,
                             hook=fork_once)
  (child, (tail, forced_len)), = forks.items()
  parent_rec, child_rec = runner.records[0], runner.records[child]
  # Both branches generated to the end, diverged, and appended in their own blocks.
  assert len(parent_rec.tokens) == len(child_rec.tokens) == len(prompts[0]) + NEW_TOKENS
  parent_blocks = set(runner.segments(0)[:, 0].tolist())
  child_blocks = set(runner.segments(child)[:, 0].tolist())
  assert tail in parent_blocks & child_blocks
  assert len(parent_blocks - child_blocks) >= 1 and len(child_blocks - parent_blocks) >= 1
  assert_matches_dense(model, runner)
  # The child equals dense greedy generation from its forced prefix.
  start = child_rec.tokens[:forced_len]
  dense = generate_dense(model, [start], len(child_rec.tokens) - forced_len)[0]
  assert child_rec.tokens == dense


def test_preemption_by_recompute_matches_dense(model):
  """Sequence 1 (which shares r0's prefix) is preempted mid-generation and recomputed."""
  prompts, prefixes = shared_prefix_requests(seed=4)

  def preempt_then_resume(runner, tokens_done):
    if tokens_done == 3:
      runner.preempt(1)
      assert 1 not in runner.live
    elif tokens_done == 6:
      runner.resume(1)  # other sequences decoded meanwhile; 1 now has no shared prefix
      assert runner.num_cached(1) == len(runner.records[1].tokens) - 1

  runner = generate_paged(model, prompts, NEW_TOKENS, pool_config=POOL, prefixes=prefixes,
                             prefill_chunk=CHUNK, hook=preempt_then_resume)
  dense = generate_dense(model, prompts, NEW_TOKENS)
  assert runner.records[0].tokens == dense[0]
  # Paused for three calls, so three tokens short, but on the dense greedy path.
  assert runner.records[1].tokens == dense[1][:len(dense[1]) - 3]
  assert_matches_dense(model, runner)


def test_pool_exhaustion_is_reported_not_silent(model):
  """Mid-scan OOM: the failing row stops with NO_FREE_BLOCK; the other keeps going."""
  prompts, _ = shared_prefix_requests(seed=2)
  runner = PagedRunner(model, POOL, prefill_chunk=CHUNK)
  a = runner.open(prompts[0][:8], max_new_tokens=NEW_TOKENS)  # two full blocks each
  b = runner.open(prompts[3][:8], max_new_tokens=NEW_TOKENS)
  runner.prefill([a, b])
  free = int(runner.state.meta.num_free)
  runner.state, (_, status) = paged_kv.allocate(runner.state, free - 1, config=POOL,
                                                max_blocks=POOL.num_blocks, contiguous="never")
  assert int(status) == Status.OK
  with pytest.raises(paged_kv.PoolExhausted):
    runner.decode([a, b], num_tokens=4, steps_per_call=4)
  # a got the last block and 4 tokens in it; b got nothing and is intact.
  assert len(runner.records[a].tokens) == 9 + 4
  assert len(runner.records[b].tokens) == 9
  assert runner.num_cached(b) == int(runner.state.table.seq_len[b]) == 8
  assert dense_mismatches(model, [runner.records[a], runner.records[b]]) == []


@pytest.mark.slow
def test_steps_donate_state_and_compile_once(model):
  """The pool is updated in place (aliased) and a second call compiles nothing.

  Also checks the logits of the paged prefill and decode against the dense ones.
  """
  graphdef, params = nnx.split(model)
  prompts, _ = shared_prefix_requests(seed=3)
  state = paged_kv.init_pool(POOL)
  state, _ = paged_kv.open_sequence(state, jnp.array([0], jnp.int32),
                                    jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                    jnp.zeros((1, 1), jnp.int32), jnp.array([0], jnp.int32),
                                    config=POOL)
  ids = np.array([0, -1, -1, -1], np.int32)
  toks = np.zeros((4, CHUNK), np.int32)
  toks[0] = prompts[0][:CHUNK]
  num = np.array([CHUNK, 0, 0, 0], np.int32)
  state, (nxt, prefill_logits, status) = steps.prefill(params, state, ids, toks, num,
                                                    graphdef=graphdef, config=POOL)
  assert int(status[0]) == Status.OK
  last = np.array([int(nxt[0]), 0, 0, 0], np.int32)
  kwargs = dict(graphdef=graphdef, config=POOL)
  compiled = steps.decode_step.lower(params, state, ids, last, **kwargs).compile()
  pages_bytes = 2 * state.pages.k.size * state.pages.k.dtype.itemsize
  assert compiled.memory_analysis().alias_size_in_bytes >= pages_bytes
  state, (nxt2, decode_logits, status) = steps.decode_step(params, state, ids, last, **kwargs)
  cache_size = steps.decode_step._cache_size()
  old_k = state.pages.k
  state, _ = steps.decode_step(params, state, ids, np.asarray(nxt2), **kwargs)
  assert old_k.is_deleted()  # donated
  assert steps.decode_step._cache_size() == cache_size
  # The k-step scan updates the pool in place too (pages are not copied per call).
  multi = steps.decode_multi.lower(params, state, ids, last, np.full((4,), 4, np.int32),
                                num_steps=4, **kwargs).compile()
  assert multi.memory_analysis().alias_size_in_bytes >= pages_bytes
  dense = llama.dense_forward(model, jnp.asarray([prompts[0][:CHUNK] + [int(nxt[0])]]),
                                   jnp.array([CHUNK + 1]))
  np.testing.assert_allclose(prefill_logits[0], dense[0, CHUNK - 1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(decode_logits[0], dense[0, CHUNK], rtol=1e-5, atol=1e-5)


# The Pallas kernels in interpret mode; `make test` keeps the jnp reference and the kernels' own
# tests.
@pytest.mark.long
def test_pallas_kernels_match_dense(model):
  """The same shared-prefix generation through the Pallas kernels (interpret on CPU).

  13-30 s on CPU: in the long tier, which CI runs.
  """
  prompts, prefixes = shared_prefix_requests()
  prompts, prefixes = prompts[:2], prefixes[:2]
  interpret = jax.default_backend() == "cpu"
  runner = PagedRunner(model, POOL, prefill_chunk=CHUNK, impl="pallas", interpret=interpret)
  a = runner.open(prompts[0], max_new_tokens=6)
  runner.prefill([a])
  b = runner.open(prompts[1], max_new_tokens=6, prefix=prefixes[1])
  runner.prefill([b])
  runner.decode(num_tokens=5, steps_per_call=3)
  dense = generate_dense(model, prompts, 6)
  assert [runner.records[a].tokens, runner.records[b].tokens] == dense
  assert_matches_dense(model, runner)
