"""A soak of the Mooncake conversation trace through the scheduler, every feature on.

The trace (`../shared/traces/conversation_trace.jsonl` beside the repository; from
github.com/kvcache-ai/Mooncake, `FAST25-release/traces/conversation_trace.jsonl`) is
replayed through a `Scheduler` over a small `BlockPool` with: the prefix cache (two
tenants whose prompts use the same token ids), swap preemption under pressure, tail
packing into slotted blocks, merge compaction, promotion into the base pool,
scrubbing of freed blocks. Lengths are divided by `TOKEN_SCALE` (the prefix
structure stays). Requests are fed to keep the queue full (pressure, not trace time).

Two executors (`PAGED_KV_SOAK_EXECUTOR=tags|model`; unset: both tests run):

* **tags** (`test_soak_ends_in_a_clean_drain`): a `kv_tags.TaggingExecutor` writes
  K/V encoding (tenant, token, position). Every `CHECK_EVERY` steps:
  `check_invariants()`, every running sequence and every cache node reads back its
  tags bit-exact, and every slot not handed out holds zeros (scrubbing).
* **model** (`test_model_soak_ends_in_a_clean_drain`): `ModelExecutor` with a
  seeded-random `TinyLlama` (fp32, vocab 256; trace token ids are hashed into the
  vocabulary), greedy decoding. Every `CHECK_EVERY` steps: `check_invariants()`,
  scrubbing's zero check, and against the dense no-cache reference
  (`TinyLlama.dense`, one row from position 0) for a sample: the K/V of
  `MODEL_NODES_PER_CHECK` random cache nodes and one running sequence (to
  `KV_ATOL`: the paged path sums attention in another order than the dense one,
  so from the second layer on K/V are equal only to rounding; the maximum
  difference per layer is printed), and the greedy tokens of
  `MODEL_REQUESTS_PER_CHECK` requests finished since the last check (all of them
  in the short CI run), teacher-forced: every generated token is the dense argmax
  after the tokens before it, exactly, unless the dense logits of the two tokens
  are within `TIE_TOL` (a near-tie that rounding may flip; counted and printed,
  and a paged token that is not the dense argmax by more fails). The scheduler is
  warmed up (`Scheduler.warmup`) first; the serving path's compiles after that
  (those of the checks' dense programs left out) are counted and must be 0. RSS
  and `/proc/self/maps` lines (`paged_kv.runtime.counters`, as in
  `benchmarks/soak_runtime.py`, with glibc's thresholds fixed as there) are sampled
  after warm-up, every `SAMPLE_SECONDS` and after the drain; with
  `PAGED_KV_SOAK_SECONDS` set, the checks' dense programs are compiled before the
  first sample (every width a request can reach), and the end's mappings must stay
  within x`MAPS_FLAT` and RSS within x`RSS_FLAT` of the first sample.
  Finished requests are taken off the scheduler after every step, as a server does.

Both: every `SAVE_EVERY` steps the cache is saved to disk (persist). At the end the
queue drains, the last saved cache restores into a fresh pool (its invariants
checked), the cache is evicted whole, and the pool is 100% free: every ref count 0,
no active row, cache empty, invariants hold, no K/V left in any block.

Scale: `PAGED_KV_SOAK_SECONDS=S` replays the trace (again and again, with new request
ids) until S seconds have passed, then drains; the default (CI) replays the first
`PAGED_KV_SOAK_REQUESTS` (default 40 with tags, 6 with the model) requests once;
`PAGED_KV_SOAK_TRACE=path` reads another Mooncake-format trace. The tests skip with a
reason when the trace is not there (a clone without `../shared`).

The 30-minute model soak:
  PAGED_KV_SOAK_SECONDS=1800 PAGED_KV_SOAK_EXECUTOR=model \
      python -m pytest -q -s tests/scheduler/test_soak.py
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core import compact
from paged_kv.runtime import counters, host_memory
from paged_kv.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.sim.traces import TokenSource, load_mooncake, scaled_prompt
from tests.scheduler import kv_tags

# The Mooncake trace soak; `make test` keeps the scheduler's tests.
pytestmark = pytest.mark.long

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE = os.environ.get("PAGED_KV_SOAK_TRACE") or os.path.normpath(
    os.path.join(_REPO, "..", "shared", "traces", "conversation_trace.jsonl"))
_SECONDS = float(os.environ.get("PAGED_KV_SOAK_SECONDS", "0") or 0)
_REQUESTS = int(os.environ.get("PAGED_KV_SOAK_REQUESTS", "0") or 0)
_EXECUTOR = os.environ.get("PAGED_KV_SOAK_EXECUTOR", "")
TOKEN_SCALE = 32
BLOCK_SIZE = 16
CHECK_EVERY = 25
SAVE_EVERY = 500
TENANTS = ("tenant-a", "tenant-b")
# The model soak.
MODEL_NODES_PER_CHECK = 2  # cache nodes whose K/V are compared with the dense reference
MODEL_REQUESTS_PER_CHECK = 2  # finished requests whose tokens are (long run; CI: all)
KV_ATOL = 1e-4  # K/V are O(1); the paged and dense paths differ by rounding only
TIE_TOL = 1e-4  # dense logits this close are a near-tie rounding may flip
SAMPLE_SECONDS = 60.0
MODEL_CI_REQUESTS = 6  # the CI run (~20 s): this many requests, no warm-up (~40 s alone)
MODEL_CI_BLOCKS = 64  # ... in a pool this small, for pressure (evictions; 8 requests in
# 96 blocks also swap once, but take ~35 s)
MODEL_BLOCKS = 384  # a timed soak's pool: the longest request takes 248 blocks; with
# 1024 the running sequences never filled it (30 minutes: 0 swap preemptions)
MAPS_FLAT = 1.02  # as benchmarks/soak_runtime.py
RSS_FLAT = 1.10


def tenant_of(namespace) -> int:
  return TENANTS.index(namespace)


def _skip_unless(test: absltest.TestCase, executor: str) -> None:
  if _EXECUTOR and _EXECUTOR != executor:
    test.skipTest(f"PAGED_KV_SOAK_EXECUTOR={_EXECUTOR}")
  if not os.path.exists(TRACE):
    test.skipTest(f"trace not found: {TRACE} (the Mooncake conversation trace, from "
                  f"github.com/kvcache-ai/Mooncake FAST25-release/traces/; lives in "
                  f"../shared/traces beside the repository)")


@dataclasses.dataclass
class Workload:
  """The trace as prompts and output lengths."""

  trace: list
  tokens: TokenSource
  prompts: list
  outputs: list

  @property
  def longest(self) -> int:
    return max(p.size + o for p, o in zip(self.prompts, self.outputs))


def load_workload(default_requests: int, vocab_size: int | None = None) -> Workload:
  """The trace's prompts (hashed into `[0, vocab_size)` when given) and outputs."""
  trace = load_mooncake(TRACE, 0 if _SECONDS else (_REQUESTS or default_requests))
  tokens = TokenSource(trace)
  prompts = [scaled_prompt(r, tokens, TOKEN_SCALE) for r in trace]
  if vocab_size is not None:
    # A fixed mix of each id: distinct 16-token blocks stay distinct (up to 256^-16).
    prompts = [((p.astype(np.uint64) * np.uint64(2654435761)) >> np.uint64(7)).astype(
        np.int64) % vocab_size for p in prompts]
    prompts = [p.astype(np.int32) for p in prompts]
  outputs = [max(1, -(-r.output_length // TOKEN_SCALE)) for r in trace]
  return Workload(trace, tokens, prompts, outputs)


def soak_scheduler(config: paged_kv.PoolConfig, executor, clock: list) -> Scheduler:
  """Every feature on: prefix cache, swap, packing, compaction, promotion, snapshots."""
  return Scheduler(
      CachedPool(paged_kv.BlockPool(config), pack_tails=True, clock=lambda: clock[0]),
      executor,
      SchedulerConfig(max_batch=16, prefill_token_budget=1024, prefill_chunk=256,
                      preemption="swap", pack_tails=True, output_reserve_ratio=0.0,
                      compaction=compact.CompactionPolicy(threshold=0.3, budget=16),
                      promote_readers=3, promote_every=16, snapshot_every=100),
      clock=lambda: clock[0])


@dataclasses.dataclass
class LoopStats:
  """What the soak loop counted."""

  submitted: int = 0
  refused: int = 0
  steps: int = 0
  passes: int = 0
  saves: int = 0
  next_index: int = 0
  seconds: float = 0.0


def run_soak(sched: Scheduler, work: Workload, clock: list, saved: str, *,
             check, after_step=None, forced_output: bool) -> LoopStats:
  """Feeds the trace (for `_SECONDS`, or once), steps until idle; `check(sched)` every
  `CHECK_EVERY` steps, `after_step(sched)` after every step, saves every `SAVE_EVERY`."""
  ls = LoopStats()
  t0 = time.monotonic()
  n = len(work.trace)

  def feeding() -> bool:
    return (time.monotonic() - t0 < _SECONDS) if _SECONDS else ls.passes == 0

  while True:
    while feeding() and len(sched.waiting) < 2 * sched.config.max_batch:
      i = ls.next_index % n
      req = Request((ls.passes, i), work.prompts[i], work.outputs[i],
                    namespace=TENANTS[i % 2],
                    forced_output=work.tokens.unique(work.outputs[i]) if forced_output
                    else None)
      try:
        sched.submit(req)
        ls.submitted += 1
      except paged_kv.PoolExhausted:
        ls.refused += 1
      ls.next_index += 1
      if ls.next_index % n == 0:
        ls.passes += 1
    if sched.idle:
      break
    sched.step()
    ls.steps += 1
    clock[0] += 0.05
    if after_step is not None:
      after_step(sched)
    if ls.steps % CHECK_EVERY == 0:
      check(sched)
    if ls.steps % SAVE_EVERY == 0:
      sched.cached_pool.save(saved)
      ls.saves += 1
  if not ls.saves:
    sched.cached_pool.save(saved)
    ls.saves += 1
  ls.seconds = time.monotonic() - t0
  return ls


def restore_and_drain(test: absltest.TestCase, sched: Scheduler, saved: str,
                      check_restored=None) -> int:
  """The saved cache restores into a fresh pool of the same config (its base region
  too: a cache with promoted blocks fits), `check_restored(fresh)` then; the whole
  cache is evicted and the pool is 100% free. Returns the restored tokens."""
  pool = sched.pool
  config = pool.config
  fresh = CachedPool(paged_kv.BlockPool(config), pack_tails=True)
  fresh.restore(saved)
  fresh.check_invariants()
  if check_restored is not None:
    check_restored(fresh)
  restored_tokens = fresh.cache.num_tokens
  del fresh
  sched.cached_pool.evict(num_blocks=config.num_blocks)
  test.assertEqual(len(sched.cached_pool.cache.tree), 0)
  ref_count = np.asarray(pool.state.meta.ref_count)
  test.assertFalse(ref_count.any(), np.flatnonzero(ref_count))
  test.assertEqual(pool.num_free_blocks, config.num_blocks - config.num_base_blocks)
  test.assertFalse(np.asarray(pool.state.table.active).any())
  sched.check_invariants()
  test.assertFalse(np.any(np.asarray(pool.state.pages.k)), "a freed block kept K/V")
  test.assertFalse(np.any(np.asarray(pool.state.pages.v)), "a freed block kept K/V")
  return restored_tokens


def _dense_kv_and_logits():
  """A jitted `(model, tokens i32[1, T], length i32[1]) -> (k, v [L, T, Hkv, D],
  logits [T, vocab])`: the dense no-cache pass, with the K/V each layer computes."""
  import jax.numpy as jnp
  from flax import nnx

  @nnx.jit
  def dense(model, tokens, lengths):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    x = model._embed(tokens)
    ks, vs = [], []
    for layer in range(model.config.num_layers):
      block = model.block(layer)
      _, k, v = block.attn.project(block.attn_norm(x), positions)
      ks.append(k[0])
      vs.append(v[0])
      x = block.dense(x, positions, valid)
    return jnp.stack(ks), jnp.stack(vs), model._logits(x)[0]

  return dense


class DenseChecker:
  """Compares the paged stack with the dense no-cache reference (see the docstring)."""

  def __init__(self, model, seed: int = 0, min_width: int = BLOCK_SIZE):
    from paged_kv.model.ragged import bucket
    self.model = model
    self.min_width = min_width  # dense rows are padded to a power of two >= this
    self.bucket = bucket
    self.dense = _dense_kv_and_logits()
    self.rng = np.random.default_rng(seed)
    self.kv_tokens = 0  # K/V tokens compared
    self.kv_max_diff = np.zeros(model.config.num_layers)  # max |paged - dense| per layer
    self.kv_exact_tokens = 0  # ... of which every layer was bit-equal
    self.requests = 0  # finished requests whose tokens were compared
    self.generated_checked = 0  # generated tokens compared
    self.exact = 0  # ... equal to the dense argmax
    self.near_ties = 0  # ... not equal, dense logits within TIE_TOL
    self.compiles = 0  # backend compiles during the checks (the dense programs)
    self.seconds = 0.0

  def _run(self, tokens: np.ndarray):
    width = self.bucket(max(tokens.size, self.min_width))
    row = np.zeros((1, width), np.int32)
    row[0, :tokens.size] = tokens
    k, v, logits = self.dense(self.model, row, np.array([tokens.size], np.int32))
    return np.asarray(k), np.asarray(v), np.asarray(logits)

  def warm(self, longest: int) -> None:
    """Compiles the dense programs for every width up to `longest` tokens."""
    width = BLOCK_SIZE
    while True:
      self._run(np.zeros(min(width, longest), np.int32))
      if width >= longest:
        break
      width *= 2

  def compare_kv(self, what: str, pool, tokens: np.ndarray, first: int,
                  segs: np.ndarray) -> None:
    """The K/V of `tokens[first:]` in `pool` at segments `segs` (`(block, start,
    length)` rows) against a dense pass over `tokens` (all of them, from position 0)."""
    c = pool.config
    slots = kv_tags._segment_slots(segs, c.block_size)
    assert slots.shape[0] == tokens.size - first, (what, slots.shape, tokens.size, first)
    k, v, _ = self._run(tokens)
    pk = np.asarray(pool.state.pages.k).reshape(c.num_layers, c.num_kv_heads, -1, c.head_dim)
    pv = np.asarray(pool.state.pages.v).reshape(pk.shape)
    got_k = np.moveaxis(pk[:, :, slots], 1, 2)  # [L, T, H, D]
    got_v = np.moveaxis(pv[:, :, slots], 1, 2)
    want_k, want_v = k[:, first:tokens.size], v[:, first:tokens.size]
    diff = np.maximum(np.abs(got_k - want_k).max(axis=(1, 2, 3)),
                      np.abs(got_v - want_v).max(axis=(1, 2, 3)))
    self.kv_max_diff = np.maximum(self.kv_max_diff, diff)
    bit = np.all((got_k == want_k) & (got_v == want_v), axis=(0, 2, 3))
    self.kv_exact_tokens += int(bit.sum())
    self.kv_tokens += slots.shape[0]
    if not diff.max() <= KV_ATOL:
      bad = np.abs(got_k - want_k).max(axis=(0, 2, 3))
      i = int(np.argmax(bad))
      raise AssertionError(
          f"{what}: K/V differ from the dense reference by {diff.tolist()} per layer "
          f"(> {KV_ATOL}); worst token {i} (position {first + i}, id {int(tokens[first + i])})"
          f" at slot {int(slots[i])}")

  def check_pool(self, sched: Scheduler) -> None:
    """K/V of a few random cache nodes and one running sequence."""
    t0, c0 = time.monotonic(), counters.backend_compiles()
    cache = sched.cached_pool.cache
    nodes = [n for n in cache.tree.nodes() if n.num_tokens]
    for j in self.rng.permutation(len(nodes))[:MODEL_NODES_PER_CHECK]:
      node = nodes[int(j)]
      path = np.asarray(cache.tree.path_tokens(node.node_id))
      self.compare_kv(f"cache node {node.node_id} ({node.namespace!r})", sched.pool, path,
                       path.shape[0] - node.num_tokens, np.asarray(node.value))
    if sched.running:
      req = sched.running[int(self.rng.integers(len(sched.running)))]
      table = sched.pool.state.table
      sid, ns = req.seq_id, int(np.asarray(table.num_segments)[req.seq_id])
      segs = np.stack([np.asarray(table.block)[sid, :ns], np.asarray(table.start)[sid, :ns],
                       np.asarray(table.length)[sid, :ns]], 1)
      length = int(np.asarray(table.seq_len)[sid])
      assert length == req.num_cached, (req.request_id, length, req.num_cached)
      if length:
        self.compare_kv(f"request {req.request_id!r} (row {sid})", sched.pool,
                         req.tokens[:length], 0, segs)
    self.compiles += counters.backend_compiles() - c0
    self.seconds += time.monotonic() - t0

  def check_tokens(self, reqs) -> None:
    """Every generated token of `reqs` is the dense greedy choice (near-ties aside)."""
    t0, c0 = time.monotonic(), counters.backend_compiles()
    for req in reqs:
      toks = req.tokens
      _, _, logits = self._run(toks)
      start = req.prompt.size
      for p in range(start, toks.size):
        row = logits[p - 1]
        want, got = int(np.argmax(row)), int(toks[p])
        self.generated_checked += 1
        if want == got:
          self.exact += 1
        elif row[want] - row[got] <= TIE_TOL:
          self.near_ties += 1
        else:
          raise AssertionError(
              f"request {req.request_id!r}: token {p} (output {p - start}) is {got}, the "
              f"dense greedy choice is {want} (logits {row[got]:.6f} vs {row[want]:.6f})")
      self.requests += 1
    self.compiles += counters.backend_compiles() - c0
    self.seconds += time.monotonic() - t0


class CompileNames:
  """The program name of every XLA compile while `on` (`jax.monitoring`'s `fun_name`
  with the event `paged_kv.runtime.counters` counts), to name what compiled."""

  def __init__(self):
    import jax
    self.phase = ""  # "" (off), "serving" or "check"
    self.names: dict[str, list[str]] = {"serving": [], "check": []}
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if self.phase and event == "/jax/core/compile/backend_compile_duration":
      self.names[self.phase].append(str(kwargs.get("fun_name", "?")))


def memory_sample(t0: float, steps: int) -> dict:
  """RSS and memory mappings now (`paged_kv.runtime.counters`)."""
  return dict(elapsed_s=round(time.monotonic() - t0, 1), steps=steps,
              rss_mb=round(counters.resident_bytes() / 2**20, 1),
              maps=counters.memory_mappings(), compiles=counters.backend_compiles())


class MooncakeSoakTest(absltest.TestCase):

  def test_soak_ends_in_a_clean_drain(self):
    _skip_unless(self, "tags")
    work = load_workload(40)
    config = paged_kv.PoolConfig(
        num_blocks=1024, block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1,
        head_dim=kv_tags.TAG_DIM, dtype="float32", max_seqs=16,
        max_segments=work.longest // BLOCK_SIZE + 16, base_pool_fraction=0.05,
        scrub_freed_blocks=True)
    executor = kv_tags.TaggingExecutor(config, tenant_of)
    clock = [0.0]
    sched = soak_scheduler(config, executor, clock)
    pool = sched.pool
    executor.sched = sched
    checked = [0]

    def check(s: Scheduler) -> None:
      s.check_invariants()
      checked[0] += kv_tags.check_tags(s, tenant_of)
      kv_tags.check_clear_slots_zero(pool)

    saved = os.path.join(tempfile.mkdtemp(), "cache.npz")
    ls = run_soak(sched, work, clock, saved, check=check, forced_output=True)
    st = sched.stats
    self.assertEqual(st.finished, ls.submitted)
    self.assertGreater(st.preemptions_swap + st.evictions, 0, "the soak must see pressure")
    sched.check_invariants()
    checked[0] += kv_tags.check_tags(sched, tenant_of)
    restored_tokens = restore_and_drain(self, sched, saved)
    n = len(work.trace)
    print(f"\nMooncake soak: {ls.seconds:.0f} s, {ls.passes} full pass(es) + "
          f"{ls.next_index % n} requests, {ls.submitted} submitted, {ls.refused} refused, "
          f"{st.finished} finished, {ls.steps} steps, {st.preemptions_swap} swap / "
          f"{st.preemptions_recompute} recompute preemptions, {st.evictions} evictions, "
          f"{st.compactions} compactions, {sched.stats.pack_moves} pack moves, "
          f"{sched.stats.promotions} promotions, hit rate "
          f"{st.prefix_cache_hit_rate:.3f}, {checked[0]} K/V tokens checked, restored "
          f"cache {restored_tokens} tokens; drain clean")

  def test_model_soak_ends_in_a_clean_drain(self):
    _skip_unless(self, "model")
    from flax import nnx
    from paged_kv.model import llama
    from paged_kv.scheduler.executor import ModelExecutor

    t_start = time.monotonic()
    host_memory.return_freed_memory()
    model_config = llama.LlamaConfig()
    model = llama.TinyLlama(model_config, rngs=nnx.Rngs(0))
    work = load_workload(MODEL_CI_REQUESTS, model_config.vocab_size)
    config = llama.pool_config_for(
        model_config, num_blocks=MODEL_BLOCKS if _SECONDS else MODEL_CI_BLOCKS,
        block_size=BLOCK_SIZE,
        max_seqs=16, max_segments=work.longest // BLOCK_SIZE + 16, base_pool_fraction=0.05,
        scrub_freed_blocks=True)
    executor = ModelExecutor(model, config)
    clock = [0.0]
    sched = soak_scheduler(config, executor, clock)
    pool = sched.pool
    warm = sched.warmup(progress=False) if _SECONDS else None
    # CI: one width for every dense row (one compile); a timed soak compiles each
    # power of two up to the longest request before the first sample.
    checker = DenseChecker(model, min_width=BLOCK_SIZE if _SECONDS else work.longest)
    if _SECONDS:
      checker.warm(work.longest)  # the checks' programs, before the first sample
      sched.check_invariants()  # ... and the other checks' (host-side jnp helpers)
      kv_tags.check_clear_slots_zero(pool)
      counters.trim_heap()  # the warm-up's freed heap back to the OS before the start
    compiles0 = counters.backend_compiles()
    names = CompileNames()
    names.phase = "serving"
    samples = [memory_sample(t_start, 0)]
    since_check = []
    generated = [0]
    last_sample = [time.monotonic()]
    steps = [0]

    def after_step(s: Scheduler) -> None:
      steps[0] += 1
      for req in s.take_finished():
        generated[0] += len(req.output)
        since_check.append(req)
      if time.monotonic() - last_sample[0] >= SAMPLE_SECONDS:
        samples.append(memory_sample(t_start, steps[0]))
        last_sample[0] = time.monotonic()

    def check(s: Scheduler) -> None:
      names.phase = "check"
      s.check_invariants()
      kv_tags.check_clear_slots_zero(pool)
      checker.check_pool(s)
      if _SECONDS:
        picked = [since_check[int(j)] for j in
                  checker.rng.permutation(len(since_check))[:MODEL_REQUESTS_PER_CHECK]]
      else:
        picked = list(since_check)
      checker.check_tokens(picked)
      since_check.clear()
      names.phase = "serving"

    saved = os.path.join(tempfile.mkdtemp(), "cache.npz")
    ls = run_soak(sched, work, clock, saved, check=check, after_step=after_step,
                  forced_output=False)
    after_step(sched)
    st = sched.stats
    self.assertEqual(st.finished, ls.submitted)
    self.assertGreater(st.preemptions_swap + st.evictions, 0, "the soak must see pressure")
    check(sched)
    names.phase = ""
    # Backend compiles (persistent-cache loads left out) minus the checks' (by name).
    all_compiles = counters.backend_compiles() - compiles0
    serving_compiles = len(names.names["serving"])
    samples.append(memory_sample(t_start, ls.steps))  # the end: drained, before the restore
    restored_nodes = [0]

    def check_restored(fresh: CachedPool) -> None:
      # The restored K/V are the saved ones: a few nodes against the dense reference.
      cache = fresh.cache
      nodes = [n for n in cache.tree.nodes() if n.num_tokens]
      for j in checker.rng.permutation(len(nodes))[:2 * MODEL_NODES_PER_CHECK]:
        node = nodes[int(j)]
        path = np.asarray(cache.tree.path_tokens(node.node_id))
        checker.compare_kv(f"restored node {node.node_id}", fresh.pool, path,
                            path.shape[0] - node.num_tokens, np.asarray(node.value))
        restored_nodes[0] += 1

    restored_tokens = restore_and_drain(self, sched, saved, check_restored)
    first, last = samples[0], samples[-1]
    samples.append(memory_sample(t_start, ls.steps))  # after the restore (its own compiles)
    n = len(work.trace)
    print(f"\nMooncake model soak ({time.strftime('%Y-%m-%d %H:%M:%S')}): TinyLlama "
          f"{model_config}, impl {executor.kernel_args['impl'] or 'default'}; "
          + (f"warm-up {warm.seconds:.0f} s, {warm.compiles} compiles" if warm else
             "no warm-up (CI)"))
    print(f"  wall {ls.seconds:.0f} s of serving; {ls.passes} full pass(es) + "
          f"{ls.next_index % n} requests; {ls.submitted} submitted, {ls.refused} refused, "
          f"{st.finished} finished, {generated[0]} tokens generated, {ls.steps} steps")
    print(f"  {st.preemptions_swap} swap / {st.preemptions_recompute} recompute preemptions, "
          f"{st.evictions} evictions, {st.compactions} compactions, "
          f"{sched.stats.pack_moves} pack moves, {sched.stats.promotions} promotions, "
          f"{ls.saves} saves, hit rate {st.prefix_cache_hit_rate:.3f}")
    print(f"  checked vs the dense reference ({checker.seconds:.0f} s, {checker.compiles} "
          f"compiles of its own): {checker.requests} requests, {checker.generated_checked} "
          f"generated tokens: {checker.exact} exact, {checker.near_ties} near-ties (dense "
          f"logits within {TIE_TOL}); {checker.kv_tokens} K/V tokens within {KV_ATOL} "
          f"(max |diff| per layer {checker.kv_max_diff.tolist()}), "
          f"{checker.kv_exact_tokens} bit-equal in every layer")
    print(f"  drain: pool 100% free ({pool.num_free_blocks} blocks + {config.num_base_blocks}"
          f" base), cache empty, every ref count 0, invariants hold, no K/V left; restored "
          f"cache {restored_tokens} tokens ({restored_nodes[0]} restored nodes' K/V checked)")
    print(f"  compiles after warm-up: {all_compiles} backend compiles, of which "
          f"{serving_compiles} in serving (steps, saves), the rest in the checks")
    print(f"  end (drained, before the restore) vs start (after warm-up): RSS {first['rss_mb']} -> "
          f"{last['rss_mb']} MiB (x{last['rss_mb'] / first['rss_mb']:.3f}); maps "
          f"{first['maps']} -> {last['maps']} (x{last['maps'] / first['maps']:.3f})")
    print(f"  programs compiled after warm-up in serving: {sorted(set(names.names['serving']))}"
          f"; in the checks: {sorted(set(names.names['check']))}")
    print("  samples: " + "; ".join(
        f"{s['elapsed_s']} s/{s['steps']} steps: {s['rss_mb']} MiB, {s['maps']} maps"
        for s in samples))
    self.assertGreater(checker.kv_tokens, 0)
    self.assertGreater(restored_nodes[0], 0)
    self.assertGreater(checker.generated_checked, 0)
    self.assertLessEqual(checker.near_ties, max(1, checker.generated_checked // 1000))
    if _SECONDS:
      self.assertEqual(serving_compiles, 0, "the serving path compiled after warm-up")
      self.assertLessEqual(last["maps"], MAPS_FLAT * first["maps"], samples)
      self.assertLessEqual(last["rss_mb"], RSS_FLAT * first["rss_mb"], samples)


if __name__ == "__main__":
  absltest.main()
