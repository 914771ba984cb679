"""A seeded stateful fuzz of the scheduler: random configs, random request streams, pressure.

Each case draws a pool (block size, size, base region, scrubbing, segment-table
size) and a scheduler config (batch, prefill budget and chunk, recompute or swap
preemption, tail packing, compaction on/off with a random policy, promotion into
the base pool, governance quotas and GC, stop token, reserve ratio, watermark,
eviction policy, the overlapped or the synchronous loop, 1, 2 or 4 decode steps per
dispatch, executor failures injected while a step is in flight), then a stream of
requests over three namespaces whose prompts
share prefixes *with the same token ids across namespaces* (every seventh asks for
two samples, `SamplingParams(n=2)`: the second forks the first's row), arriving a few per
step into a pool small enough to evict and preempt. Some cases also shrink the
pool while serving (`Scheduler.shrink_to`, retried while refused) and some drain
half-way, save the prefix cache, restore it into a fresh pool and serve the rest
there (a persistence round trip). A `kv_tags.TaggingExecutor` writes K/V that
encode (tenant, token, position). After every step:

* `sched.check_invariants()` (pool + cache references);
* every running sequence and every cache node reads back its tags bit-exact through
  its segments (so a reused prefix holds the values its tokens were computed with, in
  its own namespace, after packing, compaction, promotion, swap, recompute, shrink
  moves and a restore);
* with scrubbing, every slot handed out reads zero first and every slot not handed out
  holds zeros.

Fault cases (`FaultyTaggingExecutor`) make about one executor call in
`FAULT_EVERY` raise, before the call changes anything or after it (the new state
attached, as a failing jitted step leaves it), in one-step and k-step calls alike;
the scheduler recovers (`num_recoveries`) and serving goes on. Every case (fault or
not) checks at the end that each finished request's output is exactly the chain
the executor samples from its prompt (`kv_tags.next_token`: a token lost,
duplicated or read from a stale step breaks it) and that the `on_step` stream
delivered each request's output once, in order.

At the end the queue drains, the cache is evicted, and the pool is 100% free with
every reference count 0.

Teeth. Every third case is a pressure case and must preempt at least once per
`1 / PRESSURE_RATE` = 10 steps, asserted per case (a case that loses its
pressure fails by its seed, not hidden by its neighbours). Stop-token cases sample
among a few ids (`kv_tags` `vocab`) so the stop token fires; table-limit cases
have 4 segments of 8 tokens per row and requests at that limit (their rows fill the table;
admission shares fewer cached segments rather than overflow it) or one token over it
(`submit` refuses them with `reason="table_full"`). Features are
drawn at random, and each group is forced on in one seed of every three, so any
three consecutive seeds (the CI sample) turn every feature on. `Totals` counts the
features each case had and what fired; with `PAGED_KV_FUZZ >= 200` (long mode)
the test asserts that every feature was on and every event (stop token, full
segment table and table_full refusal, shrink cut and move, round trip, swap,
promotion, quota hold and eviction, GC eviction, compaction, packing) happened,
so the run cannot silently lose its teeth.

Scale: `PAGED_KV_FUZZ=N` runs N cases (CI: 3, about 30 s of CPU);
`PAGED_KV_FUZZ_SECONDS=S` stops starting new cases after S seconds;
`PAGED_KV_FUZZ_SEED=K` shifts the seeds. A failure names its seed and config; rerun one
case with `PAGED_KV_FUZZ=1 PAGED_KV_FUZZ_SEED=<seed>`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile
import time
import traceback

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.core import compact
from paged_kv.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from paged_kv.cache import persist
from paged_kv.scheduler.executor import attach_state
from paged_kv.cache.governance import CacheGovernance
from radix.cache import PrefixCache
from tests.scheduler import kv_tags

# Random scheduler configs and streams; `make test` keeps the scheduler's unit tests and the issue-J
# small-pool sweep.
pytestmark = pytest.mark.long

NAMESPACES = ("alpha", "beta", 3)
_TENANT = {ns: i for i, ns in enumerate(NAMESPACES)}
_CASES = int(os.environ.get("PAGED_KV_FUZZ", "0") or 0) or 3
_SECONDS = float(os.environ.get("PAGED_KV_FUZZ_SECONDS", "0") or 0)
_SEED = int(os.environ.get("PAGED_KV_FUZZ_SEED", "0") or 0)
LONG_MODE = 200  # cases from which the run must show every feature and event
PRESSURE_RATE = 0.1  # preemptions per step every pressure case must reach
STOP_VOCAB = 24  # ids a stop-token case samples among
# Features every case reports (`Case.features`); long mode needs each on somewhere.
FEATURES = ("pressure", "prefix_cache", "governance", "gc", "promotion", "base_pool", "shrink",
            "swap", "scrub", "persist", "stop_token", "table_limit", "compaction", "pack_tails",
            "sync_loop", "multi_step", "faults")
FAULT_EVERY = 12  # a fault case's executor calls per injected failure (on average)
# Forced on for `seed % 3 == k`: three consecutive seeds turn every feature on.
_FORCED = ({"governance", "gc", "shrink", "persist", "compaction", "swap", "sync_loop"},
           {"stop_token", "table_limit", "scrub", "pack_tails", "promotion", "multi_step",
            "faults"},
           {"pressure"})


def tenant_of(namespace) -> int:
  return _TENANT[namespace]


class ResizingTaggingExecutor(kv_tags.TaggingExecutor):
  """The tagging executor, following the pool's cut like the library's executors."""

  def resize(self, config):
    self.config = config


class InjectedFault(RuntimeError):
  """The failure a `FaultyTaggingExecutor` raises."""


class FaultyTaggingExecutor(ResizingTaggingExecutor):
  """Raises `InjectedFault` on random calls (`step` and `decode_steps`): before the
  call (nothing changed) or after it (the new state attached to the exception, as
  a jitted step that fails after its donation leaves it). `in_flight_faults` counts
  the faults raised while an earlier step's tokens were still unread."""

  def __init__(self, *args, seed: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.rng = np.random.default_rng(seed)
    self.faults = self.in_flight_faults = 0
    self._depth = 0  # `decode_steps` runs `step`: inject at the outer call only

  def _fault(self) -> str | None:
    if self._depth or self.rng.random() >= 1 / FAULT_EVERY:
      return None
    self.faults += 1
    self.in_flight_faults += any(r.in_flight for r in self.sched.running)
    return "before" if self.rng.random() < 0.5 else "after"

  def _call(self, call, state, *args, **kwargs):
    when = self._fault()
    if when == "before":
      raise InjectedFault("injected before the call")
    self._depth += 1
    try:
      out = call(state, *args, **kwargs)
    finally:
      self._depth -= 1
    if when == "after":
      exc = InjectedFault("injected after the call")
      attach_state(exc, out[0])
      raise exc
    return out

  def step(self, state, plan):
    return self._call(super().step, state, plan)

  def decode_steps(self, state, plan, remaining, *, num_steps: int):
    return self._call(super().decode_steps, state, plan, remaining, num_steps=num_steps)


@dataclasses.dataclass
class Case:
  seed: int
  pool: paged_kv.PoolConfig
  sched: SchedulerConfig
  num_requests: int
  faults: bool = False  # the executor raises now and then (`FaultyTaggingExecutor`)
  max_new_tokens: int = 12
  min_new_tokens: int = 1
  max_prompt: int | None = None  # prompts cut to 2..max_prompt tokens (pressure cases)
  pressure: bool = False
  vocab: int | None = None  # the executor's shared vocabulary (stop-token cases)
  table_limit: int | None = None  # tokens a request may span (table-limit cases)
  shrink_at: int | None = None  # step of the first `shrink_to` try
  shrink_by: int = 0  # blocks the shrink gives back
  round_trip_after: int | None = None  # requests submitted before the save/restore
  features: frozenset = frozenset()


def draw_case(seed: int) -> Case:
  """A random pool and scheduler config (from a few pool shapes, to bound compiles)."""
  rng = np.random.default_rng(seed)
  forced = _FORCED[seed % 3]
  on = lambda name, p=0.35: name in forced or bool(rng.random() < p)
  # Pressure (every third case: the CI sample has one): 16 blocks of 8, 8 rows
  # all batched, no output reserve or watermark, 40-60 requests of short prompts
  # (2-12 tokens: the latest admitted, the victim, frees little) and 24-48 output
  # tokens arriving in bursts, so running sequences keep outgrowing the pool. No
  # stop token, segment limit or live quota there: they would take the pressure off.
  pressure = "pressure" in forced
  table_limit = not pressure and "shrink" not in forced and on("table_limit", 0.3)
  # Few pool shapes and batch widths (every PoolConfig field is a static argument:
  # each new one compiles the pool's programs again).
  bs = 8 if pressure or table_limit else int(rng.choice([4, 8]))
  num_blocks = 16 if pressure else 24
  max_seqs = 8 if pressure else 6
  max_segments = 4 if table_limit else 24
  base = on("base_pool", 0.5) or "promotion" in forced
  pool = paged_kv.PoolConfig(
      num_blocks=num_blocks, block_size=bs, num_layers=1, num_kv_heads=1,
      head_dim=kv_tags.TAG_DIM, max_seqs=max_seqs, max_segments=max_segments,
      base_pool_fraction=0.15 if base else 0.0,
      scrub_freed_blocks=on("scrub", 0.5))
  compaction = None
  if on("compaction", 0.6):
    compaction = compact.CompactionPolicy(
        threshold=float(rng.choice([0.0, 0.2, 0.35, 0.6])), budget=int(rng.integers(1, 9)),
        strategy=str(rng.choice(list(compact.STRATEGIES))))
  persist_rt = on("persist", 0.3)
  gc = on("gc", 0.3)
  governance = None
  quotas = not pressure and on("governance", 0.3)
  if quotas or gc:
    governance = CacheGovernance(
        quotas=quotas,
        live_fraction=float(rng.choice([0.4, 0.6, 0.8])), max_step=int(rng.choice([1, 2, 8])),
        gc_ttl=float(rng.choice([2.0, 5.0, 10.0])) if gc else None,
        gc_every=int(rng.choice([1, 3])))
  stop = not pressure and on("stop_token", 0.3)
  promote = pool.num_base_blocks and on("promotion", 0.6)
  sched = SchedulerConfig(
      max_batch=max_seqs,
      # Without the cache's blocks to evict first, pressure preempts at once; a
      # round trip needs the cache.
      enable_prefix_cache=(persist_rt or gc or on("prefix_cache", 0.7)),
      # (a pressure case admits at least two blocks' worth per step: with a budget of a
      # few tokens, admission lags the finishes and the pool never fills)
      prefill_token_budget=int(rng.integers(16 if pressure else 4, 33)),
      prefill_chunk=int(rng.choice([4, 16])),
      preemption="swap" if on("swap", 0.5) else "recompute",
      evict_policy=str(rng.choice(["lru", "cost"])),
      pack_tails=on("pack_tails", 0.5),
      compaction=compaction,
      promote_readers=int(rng.choice([2, 3])) if promote else 0,
      promote_every=int(rng.integers(1, 9)),
      output_reserve_ratio=0.0 if pressure else float(rng.choice([0.0, 0.5, 1.0])),
      watermark_blocks=0 if pressure else int(rng.integers(0, 3)),
      stop_token=int(rng.integers(STOP_VOCAB)) if stop else -1,
      governance=governance,
      snapshot_every=int(rng.choice([0, 1, 5])),
      overlap=not on("sync_loop", 0.3),
      decode_steps=int(rng.choice([2, 4])) if on("multi_step", 0.4) else 1)
  num_requests = int(rng.integers(40, 61)) if pressure else int(rng.integers(15, 45))
  # (a pressure pool has no room to give; a table-limit pool keeps its shape)
  shrink = not pressure and not table_limit and on("shrink", 0.3)
  # (a fault recomputes the rows of the failed step: not in the pressure cases' rate)
  faults = not pressure and on("faults", 0.2)
  case = Case(
      seed=seed, pool=pool, sched=sched, num_requests=num_requests, faults=faults,
      max_new_tokens=48 if pressure else 12, min_new_tokens=24 if pressure else 1,
      max_prompt=12 if pressure else None,
      pressure=pressure, vocab=STOP_VOCAB if stop else None,
      table_limit=max_segments * bs if table_limit else None,
      shrink_at=int(rng.integers(3, 30)) if shrink else None,
      shrink_by=8,
      round_trip_after=int(rng.integers(num_requests // 3, 2 * num_requests // 3 + 1))
      if persist_rt else None)
  flags = {
      "pressure": pressure, "prefix_cache": sched.enable_prefix_cache,
      "governance": quotas, "gc": gc,
      "promotion": bool(sched.promote_readers), "base_pool": bool(pool.num_base_blocks),
      "shrink": shrink, "swap": sched.preemption == "swap", "scrub": pool.scrub_freed_blocks,
      "persist": persist_rt, "stop_token": stop, "table_limit": table_limit,
      "compaction": compaction is not None, "pack_tails": sched.pack_tails,
      "sync_loop": not sched.overlap, "multi_step": sched.decode_steps > 1, "faults": faults}
  case.features = frozenset(k for k, v in flags.items() if v)
  return case


def request_stream(rng: np.random.Generator, n: int, max_new_tokens: int = 12,
                   min_new_tokens: int = 1, table_limit: int | None = None,
                   max_prompt: int | None = None) -> list[Request]:
  """Requests over `NAMESPACES`; prompts share prefixes (same ids across namespaces).

  With `table_limit`, about 5 requests in 12 span exactly that many tokens (a full
  segment table if every block is one segment), 1 in 6 one token more (`submit`
  refuses it: `PoolExhausted(reason="table_full")`), the rest fewer. With
  `max_prompt`, prompts are cut to 2..`max_prompt` tokens.
  """
  prefixes = [rng.integers(0, kv_tags.TOKENS_PER_TENANT, int(rng.integers(3, 20)))
              for _ in range(3)]
  out = []
  for i in range(n):
    ns = NAMESPACES[int(rng.integers(len(NAMESPACES)))]
    p = prefixes[int(rng.integers(len(prefixes)))]
    own = tenant_of(ns) * kv_tags.TOKENS_PER_TENANT
    tail = own + rng.integers(0, kv_tags.TOKENS_PER_TENANT, int(rng.integers(0, 14)))
    prompt = np.concatenate([p[:int(rng.integers(1, p.size + 1))], tail])
    new = int(rng.integers(min_new_tokens, max_new_tokens + 1))
    if max_prompt is not None:
      prompt = prompt[:int(rng.integers(2, max_prompt + 1))]
    if table_limit is not None:
      prompt = prompt[:table_limit - 1]
      room = table_limit - prompt.size
      draw = int(rng.integers(12))
      new = room + 1 if draw < 2 else room if draw < 7 else min(new, room)
    # Every seventh request asks for 2 samples (`parallel_sampling`: they fork its row).
    sampling = SamplingParams(n=2) if i % 7 == 3 else None
    out.append(Request(f"r{i}", prompt, max_new_tokens=new, namespace=ns, sampling=sampling))
  return out


@dataclasses.dataclass
class Totals:
  """What a fuzz run did, summed over its cases (printed at the end)."""

  cases: int = 0
  steps: int = 0
  requests: int = 0
  refused: int = 0
  tokens_checked: int = 0
  preemptions: int = 0
  swap_preemptions: int = 0
  pressure_cases: int = 0
  pressure_steps: int = 0
  pressure_preemptions: int = 0
  min_pressure_rate: float = float("inf")  # the lowest preemptions/step of a pressure case
  stop_tokens: int = 0  # requests ended by the stop token
  table_full_refused: int = 0  # requests `submit` refused: more segments than a row holds
  table_full_rows: int = 0  # requests whose row filled its segment table while running
  table_full_stops: int = 0  # requests ended by a full table (admission prevents it)
  evictions: int = 0
  compactions: int = 0
  pack_moves: int = 0
  promotions: int = 0
  quota_holds: int = 0
  quota_evicted_blocks: int = 0
  gc_evicted_tokens: int = 0
  shrink_cuts: int = 0
  shrink_refused: int = 0  # `shrink_to` refusals (PoolExhausted), retried later
  shrink_moves: int = 0
  round_trips: int = 0
  round_trip_tokens: int = 0  # cached tokens saved, restored and read back
  round_trip_refused: int = 0  # loads refused (PoolExhausted): promoted blocks lost room
  multi_step_calls: int = 0  # executor calls that ran k > 1 decode steps
  faults: int = 0  # injected executor failures the scheduler recovered from
  in_flight_faults: int = 0  # of them, raised while an earlier step's tokens were unread
  chains_checked: int = 0  # finished requests whose output chain and stream were checked
  features: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def absorb(self, sched: Scheduler) -> None:
    """Adds one scheduler's counters (a round trip's case has two)."""
    st = sched.stats
    self.preemptions += st.preemptions
    self.swap_preemptions += st.preemptions_swap
    self.evictions += st.evictions
    self.compactions += st.compactions
    self.pack_moves += sched.stats.pack_moves
    self.promotions += sched.stats.promotions
    self.quota_holds += st.quota_holds
    self.quota_evicted_blocks += st.quota_evicted_blocks
    self.gc_evicted_tokens += st.gc_evicted_tokens
    self.shrink_cuts += st.shrinks
    self.shrink_moves += st.shrink_moves
    self.multi_step_calls += sched.executor.multi_steps
    self.faults += getattr(sched.executor, "faults", 0)
    self.in_flight_faults += getattr(sched.executor, "in_flight_faults", 0)
    for r in sched.finished:
      self.stop_tokens += r.stop_reason == "stop_token"
      self.table_full_stops += r.stop_reason == "table_full"

  def missing(self) -> list[str]:
    """Features never on and events that never happened (empty: the run had teeth)."""
    out = [f"feature {f!r} never on" for f in FEATURES if not self.features[f]]
    for name in ("stop_tokens", "table_full_refused", "table_full_rows", "shrink_cuts",
                 "round_trips", "swap_preemptions", "promotions", "quota_holds",
                 "quota_evicted_blocks", "gc_evicted_tokens", "compactions", "pack_moves",
                 "shrink_moves", "evictions", "multi_step_calls", "faults",
                 "in_flight_faults"):
      if not getattr(self, name):
        out.append(f"no {name}")
    if self.pressure_steps and self.pressure_preemptions < PRESSURE_RATE * self.pressure_steps:
      out.append(f"pressure cases preempted {self.pressure_preemptions} times in "
                 f"{self.pressure_steps} steps")
    return out


def _check_step(sched: Scheduler, totals: Totals) -> None:
  sched.check_invariants()
  totals.tokens_checked += kv_tags.check_tags(sched, tenant_of)
  if sched.pool.config.scrub_freed_blocks:
    kv_tags.check_clear_slots_zero(sched.pool)


def _nodes(sched: Scheduler) -> list[tuple[str, tuple[int, ...]]]:
  """Every cache node as (namespace, path tokens), sorted."""
  cache = sched.cache
  if cache is None:
    return []
  return sorted((repr(n.namespace), tuple(cache.tree.path_tokens(n.node_id).tolist()))
                for n in cache.tree.nodes())


def _scheduler(case: Case, pool: paged_kv.BlockPool, clock_fn, on_step, cache=None) -> Scheduler:
  """A scheduler on `pool` with the case's tagging executor (a faulty one in fault cases)."""
  config = pool.config
  if case.faults:
    executor = FaultyTaggingExecutor(config, tenant_of, vocab=case.vocab, seed=case.seed)
  else:
    executor = ResizingTaggingExecutor(config, tenant_of, vocab=case.vocab)
  sched = Scheduler(pool, executor, case.sched, cache=cache, clock=clock_fn, on_step=on_step)
  executor.sched = sched
  return sched


def check_chains(case: Case, sched: Scheduler, streamed: dict) -> int:
  """Every finished request's output is the chain the executor samples from its prompt
  (`kv_tags.next_token`), and the stream delivered it once, in order. Returns the
  number of requests checked."""
  for req in sched.finished:
    tenant = tenant_of(req.namespace)
    prev, pos = int(req.prompt[-1]), int(req.prompt.size) - 1
    for i, token in enumerate(req.output):
      want = kv_tags.next_token(tenant, prev, pos, case.vocab)
      assert token == want, (f"request {req.request_id!r} output {i} is {token}, the chain "
                             f"gives {want} (output {req.output})")
      prev, pos = token, pos + 1
    got = streamed.get(req.request_id, [])
    assert got == list(req.output), (f"request {req.request_id!r} streamed {got}, "
                                     f"output {req.output}")
  return len(sched.finished)


def _round_trip(case: Case, sched: Scheduler, clock_fn, totals: Totals) -> Scheduler:
  """Saves the idle scheduler's cache, restores it into a fresh pool of the same config
  and returns a new scheduler on it (the restored tree and K/V checked).

  The loader lays the cache out in dynamic blocks only, so a cache holding promoted
  (base-region) blocks may not fit a fresh pool of the same size: the load is
  refused (`PoolExhausted`, the fresh pool untouched), a few cached blocks are
  evicted and the cache is saved again.
  """
  assert sched.idle
  config = sched.pool.config  # after a cut: the cut size
  pool = paged_kv.BlockPool(config)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "cache.npz")
    for _ in range(20):
      before, num_tokens = _nodes(sched), sched.cache.num_tokens
      sched.cached_pool.save(path)
      cache = PrefixCache(block_size=config.block_size, policy=case.sched.evict_policy,
                          pack_tails=case.sched.pack_tails, clock=clock_fn)
      try:
        persist.load_prefix_cache(path, pool, cache)
        break
      except paged_kv.PoolExhausted:
        assert len(cache.tree) == 0
        assert not np.asarray(pool.state.meta.ref_count).any(), "a refused load kept blocks"
        assert pool.num_free_blocks == config.num_blocks - config.num_base_blocks
        totals.round_trip_refused += 1
        sched.cached_pool.evict(num_blocks=2)
        sched.check_invariants()
    else:
      raise AssertionError("the saved cache never fit a fresh pool of the same config")
    assert os.listdir(tmp) == ["cache.npz"], os.listdir(tmp)  # no temporary file left
  new = _scheduler(case, pool, clock_fn, on_step=sched.on_step, cache=cache)
  assert new.cache.num_tokens == num_tokens, (new.cache.num_tokens, num_tokens)
  assert _nodes(new) == before, "the restored tree differs from the saved one"
  new.check_invariants()
  totals.round_trip_tokens += kv_tags.check_tags(new, tenant_of)  # the restored K/V
  if config.scrub_freed_blocks:
    kv_tags.check_clear_slots_zero(pool)
  totals.round_trips += 1
  return new


def run_case(case: Case, totals: Totals) -> None:
  """One case to its drain; raises on any violation."""
  rng = np.random.default_rng(case.seed + 1_000_003)
  pool = paged_kv.BlockPool(case.pool)
  clock = [0.0]
  clock_fn = lambda: clock[0]
  streamed = collections.defaultdict(list)

  def on_step(report) -> None:
    for request_id, token in report.tokens:
      streamed[request_id].append(int(token))

  sched = _scheduler(case, pool, clock_fn, on_step)
  executor = sched.executor
  pending = request_stream(rng, case.num_requests, case.max_new_tokens, case.min_new_tokens,
                           case.table_limit, case.max_prompt)
  case_totals = Totals()
  submitted = accepted = steps = 0
  shrink_at, shrink_tries = case.shrink_at, 0
  round_trip_after = case.round_trip_after
  done_before_trip = 0  # requests the first scheduler finished (a round trip's case)
  full_rows: set = set()  # requests whose row held `max_segments` segments at a step's end

  def shrinking() -> bool:
    s = sched.shrink_status
    return s is not None and not s.done and not s.cancelled

  while pending or not sched.idle or shrinking():
    if round_trip_after is not None and submitted >= round_trip_after:
      if sched.idle and not shrinking():
        assert sched.stats.finished == accepted, (sched.stats.finished, accepted)
        case_totals.chains_checked += check_chains(case, sched, streamed)
        case_totals.absorb(sched)
        done_before_trip = accepted
        sched = _round_trip(case, sched, clock_fn, case_totals)
        pool, executor = sched.pool, sched.executor
        round_trip_after = None
    else:
      # Pressure cases burst (up to 5 per step); the others trickle in.
      for _ in range(int(rng.integers(0, 6 if case.pressure else 4))):
        if pending:
          req = pending.pop(0)
          submitted += 1
          try:
            sched.submit(req)
            accepted += 1 + len(req.samples)
          except paged_kv.PoolExhausted as e:  # a typed refusal: it could never run
            if e.reason == "table_full":
              case_totals.table_full_refused += 1
            else:
              case_totals.refused += 1  # cannot fit even an empty pool
    if shrink_at is not None and steps >= shrink_at and not shrinking():
      config = sched.pool.config
      target = max(config.num_blocks - case.shrink_by, config.num_base_blocks + 1)
      try:
        sched.shrink_to(target)
        shrink_at = None
      except paged_kv.PoolExhausted:  # live data or a queued request needs the room
        case_totals.shrink_refused += 1
        shrink_tries += 1
        shrink_at = steps + 5 if shrink_tries < 8 else None
    if sched.idle and not shrinking():
      continue
    try:
      sched.step()
    except InjectedFault:
      assert sched.broken is None, sched.broken
    steps += 1
    clock[0] += 1.0
    if steps > 20_000:
      raise AssertionError("no progress after 20000 steps")
    _check_step(sched, case_totals)
    host, limit = sched.pool.host, sched.pool.config.max_segments
    full_rows.update(r.request_id for r in sched.running if host.num_segments[r.seq_id] == limit)
  assert sched.stats.finished + done_before_trip == accepted, (
      sched.stats.finished, done_before_trip, accepted)
  # Drain: evict the whole cache; the pool is 100% free, every count 0.
  config = sched.pool.config
  sched.cached_pool.evict(num_blocks=config.num_blocks)
  cache = sched.cached_pool.cache
  assert cache is None or len(cache.tree) == 0, len(cache.tree)
  ref_count = np.asarray(pool.state.meta.ref_count)
  assert not ref_count.any(), np.flatnonzero(ref_count)
  assert pool.num_free_blocks == config.num_blocks - config.num_base_blocks
  assert not np.asarray(pool.state.table.active).any()
  sched.check_invariants()
  if config.scrub_freed_blocks:
    assert not np.any(np.asarray(pool.state.pages.k)), "a freed block kept K/V"
  case_totals.chains_checked += check_chains(case, sched, streamed)
  case_totals.absorb(sched)
  case_totals.table_full_rows = len(full_rows)
  if case.pressure:
    rate = case_totals.preemptions / max(steps, 1)
    assert rate >= PRESSURE_RATE, (
        f"pressure case preempted {case_totals.preemptions} times in {steps} steps "
        f"({rate:.3f}/step < {PRESSURE_RATE})")
    totals.pressure_cases += 1
    totals.pressure_steps += steps
    totals.pressure_preemptions += case_totals.preemptions
    totals.min_pressure_rate = min(totals.min_pressure_rate, rate)
  # The case passed: its counts join the run's.
  for f in dataclasses.fields(Totals):
    if f.name not in ("cases", "steps", "requests", "features") and not f.name.startswith(
        ("pressure_", "min_pressure")):
      setattr(totals, f.name, getattr(totals, f.name) + getattr(case_totals, f.name))
  totals.cases += 1
  totals.steps += steps
  totals.requests += accepted
  totals.features.update(case.features)


class SchedulerFuzzTest(absltest.TestCase):

  def test_random_configs_and_streams_keep_invariants_and_kv_tags(self):
    totals = Totals()
    failures = []
    t0 = time.monotonic()
    for seed in range(_SEED, _SEED + _CASES):
      if _SECONDS and time.monotonic() - t0 > _SECONDS:
        break
      case = draw_case(seed)
      try:
        run_case(case, totals)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"seed {seed}: {type(e).__name__}: {e}\n  features="
                        f"{sorted(case.features)}\n  pool={case.pool}\n  "
                        f"sched={case.sched}\n{traceback.format_exc(limit=6)}")
        print(failures[-1], flush=True)
      if _CASES >= LONG_MODE and (seed - _SEED) % 10 == 9:  # progress of a long run
        print(f"{seed - _SEED + 1} cases, {time.monotonic() - t0:.0f} s, "
              f"{len(failures)} failing: {dataclasses.replace(totals, features=None)}",
              flush=True)
    elapsed = time.monotonic() - t0
    features = dict(sorted(totals.features.items()))
    counts = dataclasses.replace(totals, features=collections.Counter())
    print(f"\nscheduler fuzz: {counts} in {elapsed:.0f} s; {len(failures)} failing case(s)"
          f"\n  cases per feature: {features}")
    for f in failures:
      print(f)
    self.assertEqual(failures, [])
    if _CASES >= LONG_MODE:
      # Long mode: the run shows every feature on and every event it is there for.
      self.assertGreaterEqual(totals.cases, LONG_MODE,
                              "PAGED_KV_FUZZ_SECONDS stopped the run before long mode's cases")
      self.assertEqual(totals.missing(), [])


if __name__ == "__main__":
  absltest.main()
