"""Replays request traces through the radix prefix cache and a simulated block pool.

Usage:
  .venv/bin/python examples/replay_trace.py \
      --trace=../shared/traces/conversation_trace.jsonl \
      --capacity_tokens=1000000,3000000,10000000,0
  .venv/bin/python examples/replay_trace.py --max_requests=500   # smoke run
  .venv/bin/python examples/replay_trace.py --engine --max_requests=300 --pool_tokens=32768
  .venv/bin/python examples/replay_trace.py --capacity_tokens=1000000 \
      --trace=../shared/traces/AzureLLMInferenceTrace_conv.csv,../shared/traces/AzureLLMInferenceTrace_code.csv

Simulation mode (``--mode=sim``, the only mode so far): no attention math and no
device. Requests are served one at a time in arrival order: match the prompt in the
prefix cache, open a sequence on the matched segments, allocate blocks for the rest of
the prompt (evicting from the cache when the pool is full), insert the finished
sequence into the cache, release the sequence. Block accounting is a small numpy host
allocator (``HostBlockPool``, lowest address first) that applies exactly the ref
deltas the cache returns. The cache's clock is the trace's own time (seconds).

Traces:
  * Mooncake JSONL (``*.jsonl``: timestamp ms, input_length, output_length, hash_ids):
    each hash id names one 512-token block *and every block before it*. Block ``h`` is
    expanded to the 512 token ids ``h * 512 + j`` (j = 0..511): distinct hash ids give
    disjoint token ids, so a token-level match equals a hash-level match. The last
    block of a prompt is partial: only its first ``input_length - 512 * (n - 1)``
    tokens are used.
  * Azure CSV (``*.csv``: TIMESTAMP, ContextTokens, GeneratedTokens): no prefix
    information, so every prompt gets fresh unique token ids (a length-only workload:
    hit rate 0 by construction; exercises allocation and eviction churn).

Bound: with unlimited capacity the hit rate must equal the exact bound computed
directly from the hash ids (each request hits ``max over earlier requests p`` of
``min(512 * d_p, L, L_p)``, d_p = number of leading hash ids shared with p); both
are printed and the script fails if they disagree.

Output tokens are not inserted by default (their ids are unknown; the next turn's
hash ids already cover them); ``--insert_output`` caches them as unique tokens to
model their capacity cost.

Adding a mode: write ``replay_<mode>(requests, config) -> ReplayResult`` and register
it in ``_REPLAYERS``; loading, the bound and the report are shared.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from radix.cache import PrefixCache  # noqa: E402

try:
  import tqdm as _tqdm
except ImportError:  # progress bars are optional
  _tqdm = None

MOONCAKE_BLOCK_TOKENS = 512
_DEFAULT_TRACE = "../shared/traces/conversation_trace.jsonl"
ENGINE_VARIANTS_ORDER = (
    "recompute_no_reserve",
    "swap_no_reserve",
    "flat",
    "full_reserve",
    "slotted",
    "compaction",
    "all",
)

_TRACE = flags.DEFINE_list(
    "trace", [_DEFAULT_TRACE], "Trace files (comma-separated): Mooncake .jsonl or Azure .csv."
)
_CAPACITY = flags.DEFINE_list(
    "capacity_tokens", ["0"], "Pool capacities in tokens (comma-separated); 0 = unlimited."
)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per pool block.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 0, "Replay only the first N (0 = all).")
_POLICY = flags.DEFINE_enum("policy", "lru", ["lru", "cost"], "Eviction policy.")
_INSERT_OUTPUT = flags.DEFINE_bool(
    "insert_output", False, "Also cache each request's output tokens (unique ids)."
)
_MODE = flags.DEFINE_enum("mode", "sim", ["sim"], "Replay mode (sim: host simulation).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar (needs tqdm).")
_NAMESPACE = flags.DEFINE_string("namespace", "default", "Cache namespace of all requests.")
_ENGINE = flags.DEFINE_bool(
    "engine",
    False,
    "Replay through the real scheduler and JAX block pool in dry mode (memory "
    "dynamics with arrival times and output lengths, no model math); see replay_engine.",
)
_POOL_TOKENS = flags.DEFINE_integer(
    "pool_tokens", 65536, "Engine mode: pool size in tokens " "(after --token_scale)."
)
_TOKEN_SCALE = flags.DEFINE_integer(
    "token_scale",
    16,
    "Engine mode: divide every length by "
    "this (a 512-token hash block becomes 512/scale tokens).",
)
_STEP_MS = flags.DEFINE_float("step_ms", 50.0, "Engine mode: trace time per scheduler step.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Engine mode: sequences per step.")
_VARIANTS = flags.DEFINE_list(
    "variants",
    list(ENGINE_VARIANTS_ORDER),
    "Engine mode: configurations to compare (see ENGINE_VARIANTS).",
)


# ----------------------------------------------------------------------------- traces
@dataclasses.dataclass(frozen=True)
class Request:
  """One trace row.

  Attributes:
    arrival_s: arrival time in seconds from the start of the trace.
    input_length: prompt tokens.
    output_length: generated tokens.
    hash_ids: int64[ceil(input_length / 512)] Mooncake block hashes, or None when the
      trace has no prefix information.
  """

  arrival_s: float
  input_length: int
  output_length: int
  hash_ids: np.ndarray | None


def load_mooncake(path: str, max_requests: int = 0) -> list[Request]:
  """Reads a Mooncake JSONL trace (timestamps in ms)."""
  out = []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      row = json.loads(line)
      hash_ids = np.asarray(row["hash_ids"], np.int64)
      n = -(-int(row["input_length"]) // MOONCAKE_BLOCK_TOKENS)
      if hash_ids.shape[0] != n:
        raise ValueError(
            f"{path}: row {len(out)} has {hash_ids.shape[0]} hash ids "
            f"for input_length {row['input_length']} (want {n})"
        )
      out.append(
          Request(
              row["timestamp"] / 1000.0,
              int(row["input_length"]),
              int(row["output_length"]),
              hash_ids,
          )
      )
      if max_requests and len(out) >= max_requests:
        break
  return out


def _parse_azure_time(text: str) -> float:
  base, _, frac = text.strip().partition(".")
  t = datetime.datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
  return t + (float("0." + frac) if frac else 0.0)


def load_azure(path: str, max_requests: int = 0) -> list[Request]:
  """Reads an Azure LLM inference CSV trace (length-only)."""
  out = []
  with open(path) as f:
    header = [h.strip() for h in f.readline().split(",")]
    col = {name: i for i, name in enumerate(header)}
    for name in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
      if name not in col:
        raise ValueError(f"{path}: missing column {name} in header {header}")
    t0 = None
    for line in f:
      if not line.strip():
        continue
      cells = line.split(",")
      t = _parse_azure_time(cells[col["TIMESTAMP"]])
      t0 = t if t0 is None else t0
      out.append(
          Request(
              t - t0, int(cells[col["ContextTokens"]]), int(cells[col["GeneratedTokens"]]), None
          )
      )
      if max_requests and len(out) >= max_requests:
        break
  return out


def load_trace(path: str, max_requests: int = 0) -> list[Request]:
  if path.endswith(".jsonl"):
    return load_mooncake(path, max_requests)
  if path.endswith(".csv"):
    return load_azure(path, max_requests)
  raise ValueError(f"unknown trace format (want .jsonl or .csv): {path}")


_BLOCK_OFFSETS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.int64)


def mooncake_tokens(hash_ids: np.ndarray, input_length: int) -> np.ndarray:
  """int32[input_length]: block hash ``h`` -> token ids ``h * 512 + j``, last block cut."""
  if hash_ids.size and int(hash_ids.max()) >= (2**31) // MOONCAKE_BLOCK_TOKENS:
    raise ValueError("hash id too large for int32 token ids")
  tokens = (hash_ids[:, None] * MOONCAKE_BLOCK_TOKENS + _BLOCK_OFFSETS).reshape(-1)
  return tokens[:input_length].astype(np.int32)


class TokenSource:
  """Expands requests into token ids; unique ids for content without prefix info.

  Unique ids start above every Mooncake-derived id, so they never match anything.
  """

  def __init__(self, requests: list[Request]):
    top = max(
        (int(r.hash_ids.max()) for r in requests if r.hash_ids is not None and r.hash_ids.size),
        default=-1,
    )
    self._next_unique = (top + 1) * MOONCAKE_BLOCK_TOKENS

  def unique(self, n: int) -> np.ndarray:
    if self._next_unique + n >= 2**31:
      raise OverflowError("ran out of int32 token ids for unique tokens")
    out = np.arange(self._next_unique, self._next_unique + n, dtype=np.int32)
    self._next_unique += n
    return out

  def prompt(self, request: Request) -> np.ndarray:
    if request.hash_ids is None:
      return self.unique(request.input_length)
    return mooncake_tokens(request.hash_ids, request.input_length)


def exact_hit_bound(requests: Iterable[Request]) -> tuple[int, int]:
  """(hit tokens, prompt tokens) of an unlimited token-level prefix cache.

  Computed from the hash ids alone: a hash id identifies a block and its whole prefix,
  so ``longest[h]`` = longest earlier prompt containing block ``h`` is enough.
  """
  longest: dict[int, int] = {}
  hit = total = 0
  for r in requests:
    total += r.input_length
    if r.hash_ids is None:
      continue
    ids = r.hash_ids.tolist()
    best = 0
    for d, h in enumerate(ids, start=1):
      prev = longest.get(h)
      if prev is None:
        break
      best = max(best, min(MOONCAKE_BLOCK_TOKENS * d, r.input_length, prev))
    hit += best
    for h in ids:
      if longest.get(h, -1) < r.input_length:
        longest[h] = r.input_length
  return hit, total


# ----------------------------------------------------------------------------- pool
class HostBlockPool:
  """Block accounting on the host: ref counts, lowest-address-first allocation.

  ``ref_count[b]`` counts segment references (sequences + cache), as in paged_kv.
  With ``num_blocks=None`` the pool is unlimited (it grows on demand).
  """

  def __init__(self, num_blocks: int | None, block_size: int):
    self.block_size = block_size
    self.unlimited = num_blocks is None
    size = 1 << 16 if num_blocks is None else num_blocks
    self._ref = np.zeros(size, np.int32)
    self._free = np.ones(size, bool)
    self.num_free = size
    self._low = 0  # no free block below this address
    self.peak_used = 0

  @property
  def num_blocks(self) -> int:
    return int(self._ref.shape[0])

  @property
  def ref_count(self) -> np.ndarray:
    return self._ref

  def _grow(self, need: int) -> None:
    size = self.num_blocks
    new = max(2 * size, size + need)
    self._ref = np.concatenate([self._ref, np.zeros(new - size, np.int32)])
    self._free = np.concatenate([self._free, np.ones(new - size, bool)])
    self.num_free += new - size

  def allocate(self, n: int) -> np.ndarray | None:
    """int32[n] fresh block ids with ref_count 1, or None if not enough free blocks."""
    if n > self.num_free:
      if not self.unlimited:
        return None
      self._grow(n - self.num_free)
    ids = np.zeros((0,), np.int64)
    pos, window = self._low, max(4 * n, 1024)
    while ids.shape[0] < n:
      chunk = np.flatnonzero(self._free[pos : pos + window]) + pos
      ids = np.concatenate([ids, chunk[: n - ids.shape[0]]])
      pos += window
      window *= 2
    self._free[ids] = False
    self._ref[ids] = 1
    self.num_free -= n
    if n:
      self._low = int(ids[-1]) + 1
    self.peak_used = max(self.peak_used, self.num_blocks - self.num_free)
    return ids.astype(np.int32)

  def change_refs(self, block_ids: np.ndarray, deltas: np.ndarray | int) -> None:
    """ref_count[block_ids] += deltas (repeats allowed); frees blocks that reach 0."""
    if block_ids.size == 0:
      return
    np.add.at(self._ref, block_ids, deltas)
    after = self._ref[block_ids]
    if (after < 0).any():
      raise RuntimeError("ref_count underflow: the cache's deltas drifted")
    gone = block_ids[after == 0]
    gone = np.unique(gone[~self._free[gone]]) if gone.size else gone
    if gone.size:
      self._free[gone] = True
      self.num_free += int(gone.shape[0])
      self._low = min(self._low, int(gone[0]))

  def fresh_segments(self, num_tokens: int) -> np.ndarray | None:
    """int32[k, 3] segments over newly allocated blocks for ``num_tokens`` tokens."""
    bs = self.block_size
    n = -(-num_tokens // bs)
    ids = self.allocate(n)
    if ids is None:
      return None
    segs = np.zeros((n, 3), np.int32)
    segs[:, 0] = ids
    segs[:, 2] = bs
    if n:
      segs[-1, 2] = num_tokens - bs * (n - 1)
    return segs


# ----------------------------------------------------------------------------- replay
@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  capacity_tokens: int  # 0 = unlimited
  block_size: int = 16
  policy: str = "lru"
  insert_output: bool = False
  namespace: str = "default"
  progress: bool = True
  label: str = ""


@dataclasses.dataclass
class ReplayResult:
  """Totals of one replay; times in seconds."""

  label: str
  capacity_tokens: int
  num_requests: int = 0
  prompt_tokens: int = 0
  hit_tokens: int = 0
  rejected: int = 0
  evicted_nodes: int = 0
  evicted_tokens: int = 0
  eviction_calls: int = 0
  peak_blocks: int = 0
  wall_s: float = 0.0
  match_s: list[float] = dataclasses.field(default_factory=list)
  insert_s: list[float] = dataclasses.field(default_factory=list)

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class SimState:
  """Everything one simulated replay holds: clock, cache, pool, token source."""

  def __init__(self, requests: list[Request], config: ReplayConfig):
    self.config = config
    self.now = 0.0
    cap = config.capacity_tokens
    self.pool = HostBlockPool(cap // config.block_size if cap else None, config.block_size)
    self.cache = PrefixCache(
        block_size=config.block_size, policy=config.policy, clock=lambda: self.now
    )
    self.tokens = TokenSource(requests)

  def make_room(self, num_blocks: int, result: ReplayResult) -> bool:
    """Evicts from the cache until ``num_blocks`` are free; False if impossible."""
    pool = self.pool
    while pool.num_free < num_blocks and not pool.unlimited:
      ev = self.cache.evict(num_blocks=num_blocks - pool.num_free, ref_count=pool.ref_count)
      pool.change_refs(ev.ref_deltas.block_ids, ev.ref_deltas.deltas)
      result.eviction_calls += 1
      result.evicted_nodes += len(ev.nodes)
      result.evicted_tokens += ev.num_tokens
      if not ev.nodes:
        return False
    return True


def serve_request(sim: SimState, request: Request, result: ReplayResult) -> None:
  """One request: match, open, allocate the rest (evicting), insert, release."""
  sim.now = request.arrival_s
  ns = sim.config.namespace
  prompt = sim.tokens.prompt(request)
  result.num_requests += 1
  result.prompt_tokens += request.input_length

  t0 = time.perf_counter()
  m = sim.cache.match(ns, prompt)
  result.match_s.append(time.perf_counter() - t0)
  sim.pool.change_refs(m.segments[:, 0], 1)  # open_sequence: the sequence's refs

  tokens = prompt
  num_new = request.input_length - m.length
  if sim.config.insert_output:
    tokens = np.concatenate([prompt, sim.tokens.unique(request.output_length)])
    num_new += request.output_length
  ok = sim.make_room(-(-num_new // sim.pool.block_size), result)
  fresh = sim.pool.fresh_segments(num_new) if ok else None
  if fresh is None:  # cannot fit even with an empty cache
    result.rejected += 1
    sim.pool.change_refs(m.segments[:, 0], -1)
    if m.node is not None:
      sim.cache.unlock(m.node)
    return
  result.hit_tokens += m.length
  segments = np.concatenate([m.segments, fresh])

  t0 = time.perf_counter()
  out = sim.cache.insert(ns, tokens, segments)
  result.insert_s.append(time.perf_counter() - t0)
  sim.pool.change_refs(out.ref_deltas.block_ids, out.ref_deltas.deltas)
  if m.node is not None:
    sim.cache.unlock(m.node)
  sim.pool.change_refs(segments[:, 0], -1)  # release the sequence


def _progress(items: list, enabled: bool, desc: str):
  if enabled and _tqdm is not None:
    return _tqdm.tqdm(items, desc=desc, unit="req", mininterval=1.0, leave=False)
  return items


def replay_sim(requests: list[Request], config: ReplayConfig) -> ReplayResult:
  """Host simulation: requests served one at a time in arrival order."""
  sim = SimState(requests, config)
  result = ReplayResult(config.label, config.capacity_tokens)
  t0 = time.perf_counter()
  for request in _progress(requests, config.progress, config.label):
    serve_request(sim, request, result)
  result.wall_s = time.perf_counter() - t0
  result.peak_blocks = sim.pool.peak_used
  # Accounting never drifts: pool refs == the tree's own references at the end.
  tree_refs = sim.cache.tree_ref_counts(sim.pool.num_blocks)
  if not np.array_equal(tree_refs, sim.pool.ref_count):
    raise RuntimeError("pool ref_count != cache segment references after replay")
  return result


_REPLAYERS: dict[str, Callable[[list[Request], ReplayConfig], ReplayResult]] = {
    "sim": replay_sim,
}


# ----------------------------------------------------------------------------- report
def _pct_us(xs: list[float], q: float) -> float:
  return float(np.percentile(np.asarray(xs), q)) * 1e6 if xs else float("nan")


def format_table(rows: list[tuple[ReplayResult, float | None]]) -> str:
  """Markdown table; each row is (result, exact bound or None)."""
  head = (
      "| trace | capacity (tokens) | requests | hit rate | exact bound | "
      "evicted tokens | evicted nodes | rejected | match p50 / p99 (us) | "
      "insert p50 / p99 (us) | wall (s) |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r, bound in rows:
    cap = "unlimited" if r.capacity_tokens == 0 else f"{r.capacity_tokens:,}"
    b = f"{bound:.4f}" if bound is not None else "-"
    lines.append(
        f"| {r.label} | {cap} | {r.num_requests:,} | {r.hit_rate:.4f} | {b} | "
        f"{r.evicted_tokens:,} | {r.evicted_nodes:,} | {r.rejected} | "
        f"{_pct_us(r.match_s, 50):.0f} / {_pct_us(r.match_s, 99):.0f} | "
        f"{_pct_us(r.insert_s, 50):.0f} / {_pct_us(r.insert_s, 99):.0f} | "
        f"{r.wall_s:.1f} |"
    )
  return "\n".join(lines)


def run_trace(path: str, capacities: list[int], flags_config: dict) -> list[tuple]:
  """Replays one trace at every capacity; checks the unlimited run against the bound."""
  requests = load_trace(path, _MAX_REQUESTS.value)
  label = os.path.basename(path)
  bound_hit, bound_total = exact_hit_bound(requests)
  bound = bound_hit / bound_total if bound_total else 0.0
  rows = []
  for cap in capacities:
    config = ReplayConfig(capacity_tokens=cap, label=label, **flags_config)
    result = _REPLAYERS[_MODE.value](requests, config)
    print(
        f"{label} capacity={cap or 'unlimited'}: hit rate {result.hit_rate:.6f} "
        f"({result.hit_tokens:,} / {result.prompt_tokens:,} tokens), "
        f"exact bound {bound:.6f} ({bound_hit:,} tokens), "
        f"evicted {result.evicted_tokens:,} tokens in {result.evicted_nodes:,} nodes, "
        f"{result.wall_s:.1f} s",
        flush=True,
    )
    if cap == 0 and result.rejected == 0 and result.hit_tokens != bound_hit:
      raise SystemExit(
          f"unlimited-capacity hit tokens {result.hit_tokens} != exact " f"bound {bound_hit}"
      )
    if cap == 0:
      print(
          f"  unlimited capacity: replay and exact bound agree "
          f"({result.hit_tokens:,} == {bound_hit:,} tokens)"
      )
    rows.append((result, bound if cap == 0 else None))
  return rows


# ----------------------------------------------------------------------------- engine mode
# Each variant: (pack_tails, compaction on, preemption mode, output_reserve_ratio).
ENGINE_VARIANTS = {
    "recompute_no_reserve": (False, False, "recompute", 0.0),
    "swap_no_reserve": (False, False, "swap", 0.0),
    "flat": (False, False, "recompute", 0.5),
    "full_reserve": (False, False, "recompute", 1.0),
    "slotted": (True, False, "recompute", 0.5),
    "compaction": (False, True, "recompute", 0.5),
    "all": (True, True, "recompute", 0.5),
}


@dataclasses.dataclass
class EngineResult:
  """Outcome of one engine-mode replay."""

  label: str
  variant: str
  submitted: int = 0
  rejected: int = 0
  finished: int = 0
  steps: int = 0
  max_running: int = 0
  preemptions: int = 0
  swap_bytes: int = 0
  hit_rate: float = 0.0
  oom: dict = dataclasses.field(default_factory=dict)
  frag_mean: float = 0.0
  frag_p99: float = 0.0
  internal_frag_mean: float = 0.0
  utilization_mean: float = 0.0
  compaction_moves: int = 0
  pack_moves: int = 0
  wall_s: float = 0.0


def scaled_prompt(request: Request, tokens: TokenSource, scale: int) -> np.ndarray:
  """Prompt token ids with every length divided by ``scale`` (prefix structure kept)."""
  n = max(1, -(-request.input_length // scale))
  if request.hash_ids is None:
    return tokens.unique(n)
  per_block = MOONCAKE_BLOCK_TOKENS // scale
  ids = (
      request.hash_ids[:, None] * per_block + np.arange(per_block, dtype=np.int64)[None, :]
  ).reshape(-1)
  return ids[:n].astype(np.int32)


def replay_engine(
    requests: list[Request],
    *,
    variant: str,
    label: str,
    pool_tokens: int,
    block_size: int,
    token_scale: int,
    step_ms: float,
    max_batch: int,
    policy: str = "lru",
    progress: bool = True,
) -> EngineResult:
  """Replays a trace through ``paged_kv.serving.scheduler.Scheduler`` with a ``DryExecutor``.

  Requests arrive at their trace times; each scheduler step advances the clock by
  ``step_ms``. Lengths are divided by ``token_scale`` so an hour-long trace fits a
  CPU run. A request that could never fit the pool is rejected at submission.
  """
  import paged_kv  # the engine mode needs the JAX pool; sim mode does not
  from paged_kv.core import compact
  from paged_kv.serving.scheduler import DryExecutor
  from paged_kv.serving.scheduler import Request as EngineRequest
  from paged_kv.serving.scheduler import Scheduler, SchedulerConfig

  pack, compaction, preemption, reserve = ENGINE_VARIANTS[variant]
  tokens = TokenSource(requests)
  prompts = [scaled_prompt(r, tokens, token_scale) for r in requests]
  outputs = [max(1, -(-r.output_length // token_scale)) for r in requests]
  longest = max(p.size + o for p, o in zip(prompts, outputs))
  config = paged_kv.PoolConfig(
      num_blocks=pool_tokens // block_size,
      block_size=block_size,
      num_layers=1,
      num_kv_heads=1,
      head_dim=2,
      dtype="bfloat16",
      max_seqs=max_batch,
      max_segments=longest // block_size + 8,
  )
  pool = paged_kv.BlockPool(config)
  clock = {"now": 0.0}
  sched = Scheduler(
      pool,
      DryExecutor(config),
      SchedulerConfig(
          max_batch=max_batch,
          prefill_token_budget=4096,
          prefill_chunk=512,
          preemption=preemption,
          pack_tails=pack,
          evict_policy=policy,
          output_reserve_ratio=reserve,
          compaction=compact.CompactionPolicy() if compaction else None,
          snapshot_every=5,
      ),
      clock=lambda: clock["now"],
  )
  result = EngineResult(label, variant)
  nxt = 0
  bar = (
      _tqdm.tqdm(
          total=len(requests), desc=f"{label} {variant}", unit="req", mininterval=1.0, leave=False
      )
      if progress and _tqdm
      else None
  )

  def before_step(s):
    nonlocal nxt
    clock["now"] += step_ms / 1000.0
    while nxt < len(requests) and requests[nxt].arrival_s <= clock["now"]:
      req = EngineRequest(
          nxt,
          prompts[nxt],
          outputs[nxt],
          forced_output=tokens.unique(outputs[nxt]),
          arrival=requests[nxt].arrival_s,
      )
      result.submitted += 1
      try:
        s.submit(req)
      except paged_kv.PoolExhausted:
        result.rejected += 1
      nxt += 1
    if s.idle and nxt < len(requests):  # jump over idle gaps in the trace
      clock["now"] = max(clock["now"], requests[nxt].arrival_s - step_ms / 1000.0)
    if bar is not None:
      bar.n = s.stats.finished
      bar.refresh()

  t0 = time.perf_counter()
  while nxt < len(requests) or not sched.idle:
    sched.run(before_step=before_step, max_steps=256)
  result.wall_s = time.perf_counter() - t0
  if bar is not None:
    bar.close()
  sched.check_invariants()
  st, snaps = sched.stats, sched.snapshots
  frag = np.array([x.fragmentation_ratio for x in snaps] or [0.0])
  result.finished, result.steps, result.max_running = st.finished, st.steps, st.max_running
  result.preemptions, result.swap_bytes = st.preemptions, st.swap_to_host_bytes
  result.hit_rate = st.prefix_cache_hit_rate
  result.oom = dict(sched.counters.oom_by_reason)
  result.frag_mean, result.frag_p99 = float(frag.mean()), float(np.percentile(frag, 99))
  result.internal_frag_mean = float(np.mean([x.internal_fragmentation for x in snaps] or [0]))
  result.utilization_mean = float(np.mean([x.block_pool_utilization for x in snaps] or [0]))
  result.compaction_moves = sched.counters.compaction_moves
  result.pack_moves = sched.counters.pack_moves
  return result


def format_engine_table(results: list[EngineResult]) -> str:
  head = (
      "| trace | variant | finished / submitted | rejected | max concurrent | preemptions | "
      "swap KB | OOMs by reason | hit rate | frag ratio mean / p99 | internal frag | "
      "utilization | compaction moves | packed tails | steps | wall (s) |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in results:
    lines.append(
        f"| {r.label} | {r.variant} | {r.finished} / {r.submitted} | {r.rejected} | "
        f"{r.max_running} | {r.preemptions} | {r.swap_bytes / 1e3:.1f} | "
        f"{r.oom or 'none'} | {r.hit_rate:.3f} | {r.frag_mean:.3f} / {r.frag_p99:.3f} | "
        f"{r.internal_frag_mean:.1%} | {r.utilization_mean:.1%} | {r.compaction_moves} | "
        f"{r.pack_moves} | {r.steps} | {r.wall_s:.0f} |"
    )
  return "\n".join(lines)


def run_engine() -> None:
  results = []
  for path in _TRACE.value:
    requests = load_trace(path, _MAX_REQUESTS.value)
    for variant in _VARIANTS.value:
      if variant not in ENGINE_VARIANTS:
        raise app.UsageError(
            f"unknown variant {variant!r}; " f"choose from {sorted(ENGINE_VARIANTS)}"
        )
      r = replay_engine(
          requests,
          variant=variant,
          label=os.path.basename(path),
          pool_tokens=_POOL_TOKENS.value,
          block_size=_BLOCK_SIZE.value,
          token_scale=_TOKEN_SCALE.value,
          step_ms=_STEP_MS.value,
          max_batch=_MAX_BATCH.value,
          policy=_POLICY.value,
          progress=_PROGRESS.value,
      )
      print(
          f"{r.label} {variant}: {r.finished}/{r.submitted} finished, "
          f"{r.preemptions} preemptions, hit rate {r.hit_rate:.3f}, {r.wall_s:.0f} s",
          flush=True,
      )
      results.append(r)
  print()
  print(format_engine_table(results))


def parse_capacities(values: list[str]) -> list[int]:
  """`--capacity_tokens` as ints >= 0 (0 = unlimited); a usage error otherwise."""
  try:
    capacities = [int(c) for c in values]
  except ValueError as e:
    raise app.UsageError(f"--capacity_tokens must be integers: {e}") from None
  if any(c < 0 for c in capacities):
    raise app.UsageError("--capacity_tokens must be >= 0 (0 = unlimited)")
  return capacities


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _ENGINE.value:
    run_engine()
    return
  capacities = parse_capacities(_CAPACITY.value)
  if _BLOCK_SIZE.value < 1:
    raise app.UsageError("--block_size must be >= 1")
  flags_config = dict(
      block_size=_BLOCK_SIZE.value,
      policy=_POLICY.value,
      insert_output=_INSERT_OUTPUT.value,
      namespace=_NAMESPACE.value,
      progress=_PROGRESS.value,
  )
  rows = []
  for path in _TRACE.value:
    rows.extend(run_trace(path, capacities, flags_config))
  print()
  print(format_table(rows))


if __name__ == "__main__":
  app.run(main)
