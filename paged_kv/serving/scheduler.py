"""A continuous-batching scheduler that carries the memory manager end to end.

Per `step()`:

1. **Admission** (FCFS; swapped-out requests first). The prompt's longest cached
   prefix is matched in the radix cache (and locked); the request is admitted
   only if the *whole* uncached prompt fits now (admission by full input
   length, so an admitted request is not preempted at once in a loop), after
   evicting cached blocks if needed. The sequence opens on the matched
   segments (shared, no copy). With `governance`, the live quota may hold a
   request back (`paged_kv.serving.governance`: watermark quotas, two-phase GC).
2. **Chunked prefill** of admitted prompts under a per-step token budget.
3. **Decode** of one token for every running sequence whose prompt is done.
   Under pressure, cached blocks are evicted first; then the most recently
   admitted sequence is preempted, by recompute (its computed tokens go into
   the cache, it re-queues and re-matches them) or by swap (its K/V is copied
   to host, restored bit-exactly later).
4. **Finish**: a finished sequence's cached tokens are inserted into the radix
   cache (the tree takes references), optionally its short tail is packed into a
   slotted block, then the sequence is released.
5. **Compaction** between steps when the fragmentation ratio crosses the
   policy's threshold, at most `budget` block moves; the cache follows `remap`.
   **Shrink** (after `shrink_to(num_blocks)`): each step moves live blocks above
   the target into the lowest free blocks below it, within the compaction
   policy's byte budget (default 2% of a step), evicting cached-only blocks when
   the room below is short; once nothing above the target is referenced the
   pool is cut there, once, and the executor follows (`Executor.resize`).
   Allocation is lowest-address-first, so new blocks land below the target
   while it has a free block; requests are never held back for the shrink.
6. Telemetry: the cheap per-step pool figures (`metrics.step_stats_async`: one
   jitted reduction of the pool at the step's start, dispatched before step 1 and
   read here, a few scalars; every `stats_every` steps), the full
   host snapshot every `snapshot_every` steps, and a `StepReport` (the figures,
   this step's finished requests and token latencies, the alerts that fired) to
   the `on_step` callback. Nothing per step copies a per-block array to the host.

Exception safety: an exception raised anywhere in `step()` (the executor, a
callback, a `KeyboardInterrupt` at any call site) leaves the scheduler usable:
a request leaves `running` only after the calls that can fail succeeded, and
the step's handler reconciles what a half-done call left (`_recover`): the
`CachedPool` restores pool/cache agreement (dropping the cache if they
disagree), a running request whose row is gone (or holds tokens the scheduler
never accounted for) is re-queued for recompute, a row no request owns is
released, lock counts are rebuilt from the running requests, and the
invariants are checked. Every submitted request is then queued, running or
finished with a reason. Only when the pool's donated state is really gone (an
executor raised after donating without handing the state back, see
`paged_kv.serving.executor`) does the scheduler refuse further use, with
`SchedulerBroken`.

Namespaces are typed keys (`radix.tree.check_namespace`: `str`, `bytes`, `int`
or tuples of them), checked at `submit`.

The pool and the radix cache are one `CachedPool`: it applies every reference
delta of the cache (insert, evict, remap, packing) itself.

The model is behind an `Executor` (prefill / decode on the pool state); the
`DryExecutor` only reserves slots (memory dynamics, no math) for trace replay.
Tokens: after a sequence's prompt is prefilled, its first output token is
*pending* (sampled, not yet in the cache); each decode step caches the pending
token and samples the next, so a running sequence caches
`len(prompt) + len(output) - 1` tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import time
import weakref
from typing import Callable, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import compact, fields, regions
from paged_kv.core import resize as resize_lib
from paged_kv.core.config import PoolConfig
from paged_kv.telemetry import metrics
from paged_kv.core.errors import InvalidArgument, PagedKVError, PoolExhausted, Status
from paged_kv.pool import BlockPool
from paged_kv.core.segment_format import Segments
from paged_kv.serving.cached_pool import CachedPool, CacheView, PoolStateLost, state_lost
from paged_kv.model import ragged
from paged_kv.model.plan import StepPlan
from paged_kv.model.sampling import SamplingBatch
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.executor import DryExecutor, Executor, attached_state
from paged_kv.runtime import counters
from paged_kv.serving import warmup as warmup_lib
from paged_kv.serving.governance import CacheGovernance
from paged_kv.serving.warmup import WarmupReport
from paged_kv.mirror import transitions as host_ops
from paged_kv.serving.swap import SwappedKV, swap_in, swap_out
from radix.cache import POLICIES, PrefixCache
from radix.tree import check_namespace

PREEMPTION_MODES = ("recompute", "swap")
RECLAIM_EVERY = 8  # steps between reclaims of dead slots, when packing tails
MAX_STATS_INTERVAL = 64  # `stats_budget`: the figures at least every this many steps
STATS_COST_SMOOTHING = 0.2  # `stats_budget`: weight of the newest sample in the averages
_I32 = np.iinfo(np.int32)
MAX_KEPT_SNAPSHOTS = 10_000  # `Scheduler.snapshots` keeps the latest this many
MAX_KEPT_ALERTS = 10_000  # `Scheduler.alerts` keeps the latest this many


class UnknownRequest(PagedKVError, KeyError):
  """`Scheduler.abort` of an id no unfinished request holds."""

  def __str__(self) -> str:  # KeyError's repr of the message, otherwise
    return str(self.args[0]) if self.args else ""


class SchedulerBroken(PagedKVError):
  """The scheduler refuses further use: its pool's state is gone (see the message)."""


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _as_token_array(x, what: str) -> np.ndarray:
  """A 1-D int32 copy of integer tokens; refuses floats, bools, 2-D and values outside int32."""
  a = np.asarray(x)
  if a.ndim != 1:
    raise InvalidArgument(f"{what} must be a 1-D array of integer tokens, got shape {a.shape}")
  if a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer)):
    raise InvalidArgument(f"{what} must hold integer tokens, got dtype {a.dtype}")
  if a.size and (int(a.min()) < _I32.min or int(a.max()) > _I32.max):
    raise InvalidArgument(f"{what} has tokens outside int32: {int(a.min())}..{int(a.max())}")
  return a.astype(np.int32)


class Phase(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


_REQUEST_INPUTS = frozenset(("request_id", "prompt", "max_new_tokens", "namespace",
                             "forced_output", "sampling"))


@dataclasses.dataclass
class Request:
  """One generation request and its progress.

  Attributes:
    request_id: caller's id.
    prompt: `i32[n]` prompt tokens (n >= 1).
    max_new_tokens: tokens to generate (>= 1).
    namespace: prefix-cache namespace (tenant / adapter); never matches others. A
      typed key: `str`, `bytes`, `int` (not bool or a numpy scalar) or a tuple of
      them (`radix.tree.check_namespace`), so `1`, `1.0` and `True` never share.
    arrival: arrival time (caller's unit), for the caller's reports; the
      scheduler's latencies are measured on its own clock from `submit_time`.
    forced_output: optional `i32[max_new_tokens]` tokens to emit instead of the
      executor's samples (trace replay, where only lengths are known).
    sampling: how its tokens are drawn (`SamplingParams`; None: greedy), applied
      by an executor that samples (`ModelExecutor`).

  Progress, written by the scheduler (read them; do not assign): `phase` (`Phase`),
  `output` (the tokens emitted so far, a list), `stop_reason` (below), `seq_id` (its
  pool row while running), `num_cached` (tokens whose K/V is in the pool),
  `hit_tokens` (prompt tokens matched in the prefix cache), `num_preemptions`,
  `submit_step` / `admit_step` / `first_token_step` / `finish_step` and the same
  `*_time`s on the scheduler's clock, and with `sampling.logprobs = n > 0`
  `logprobs`: per output token `(its logprob, ((token, logprob), ...) the top n)`.

  `Scheduler.submit` validates these inputs once and freezes them: the arrays become
  read-only copies of the caller's, and assigning an input field afterwards raises
  `InvalidArgument` (the progress fields below are the scheduler's to write).
  `stop_reason` says why it finished: `"length"`, `"stop_token"`, `"table_full"` (its
  row had no room left) or `"abort"` (`Scheduler.abort`).
  """

  request_id: Hashable
  prompt: np.ndarray
  max_new_tokens: int
  namespace: Hashable = "default"
  arrival: float = 0.0
  forced_output: np.ndarray | None = None
  sampling: SamplingParams | None = None
  # Progress (set by the scheduler).
  phase: Phase = Phase.WAITING
  output: list = dataclasses.field(default_factory=list)
  seq_id: int | None = None
  num_cached: int = 0
  prefill_target: int = 0
  lock_node: object = None
  swapped: SwappedKV | None = None
  hit_tokens: int = 0
  num_preemptions: int = 0
  stop_reason: str = ""  # "length", "stop_token", "table_full" or "abort"
  submit_step: int = -1
  admit_step: int = -1
  first_token_step: int = -1
  finish_step: int = -1
  submit_time: float = -1.0  # the scheduler's clock at submit
  admit_time: float = -1.0  # ... at the first admission (queue time = admit - submit)
  first_token_time: float = -1.0
  last_token_time: float = -1.0
  finish_time: float = -1.0
  logprobs: list = dataclasses.field(default_factory=list)
  stop_ids: frozenset = frozenset()  # the tokens that end it (set at submit)
  sample_seed: int = 0  # its sampling seed (`sampling.seed`, else the scheduler's)

  def __post_init__(self):
    self.validate()

  def __setattr__(self, name: str, value) -> None:
    if name in _REQUEST_INPUTS and self.__dict__.get("_frozen", False):
      raise InvalidArgument(f"request {self.request_id!r} was submitted: its {name} is "
                            f"frozen (submit a new Request)")
    object.__setattr__(self, name, value)

  def _freeze(self) -> None:
    """Read-only copies of the input arrays, and no more assignments to the inputs."""
    prompt = np.array(self.prompt, copy=True)
    prompt.flags.writeable = False
    self.prompt = prompt
    if self.forced_output is not None:
      forced = np.array(self.forced_output, copy=True)
      forced.flags.writeable = False
      self.forced_output = forced
    object.__setattr__(self, "_frozen", True)

  def validate(self) -> None:
    """Checks (and normalizes) the caller's fields; `Scheduler.submit` calls it again.

    Raises:
      InvalidArgument: the prompt is not 1-D integer tokens in int32 (or empty),
        `max_new_tokens` is not a positive int, or `forced_output` is bad.
      radix.InvalidNamespaceError: the namespace is not a typed key.
    """
    self.prompt = _as_token_array(self.prompt, f"request {self.request_id!r}: prompt")
    if self.prompt.size < 1:
      raise InvalidArgument(f"request {self.request_id!r}: empty prompt")
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise InvalidArgument(f"request {self.request_id!r}: max_new_tokens must be a positive "
                            f"int, got {self.max_new_tokens!r}")
    self.max_new_tokens = int(self.max_new_tokens)
    check_namespace(self.namespace)
    if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
      raise InvalidArgument(f"request {self.request_id!r}: sampling must be a SamplingParams "
                            f"or None, got {type(self.sampling).__name__}")
    if self.forced_output is not None:
      self.forced_output = _as_token_array(self.forced_output,
                                           f"request {self.request_id!r}: forced_output")
      if self.forced_output.size < self.max_new_tokens:
        raise InvalidArgument(f"request {self.request_id!r}: forced_output shorter than "
                              f"max_new_tokens")

  @property
  def tokens(self) -> np.ndarray:
    """Prompt followed by the output so far."""
    return np.concatenate([self.prompt, np.asarray(self.output, np.int32)])

  @property
  def done(self) -> bool:
    return self.phase == Phase.FINISHED


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Scheduling and memory policies.

  Attributes:
    max_batch: sequences per step (<= the pool's max_seqs).
    prefill_token_budget: prompt tokens computed per step, all sequences together.
    prefill_chunk: prompt tokens per sequence per step (static width of a call).
    preemption: `"recompute"` or `"swap"`.
    enable_prefix_cache: match prompts in, and insert finished sequences into, the cache.
    evict_policy: `"lru"` or `"cost"`.
    pack_tails: pack a finished sequence's short tail segments into slotted blocks.
    compaction: when/how much to compact between steps (None: never).
    promote_readers: every `promote_every` steps, blocks read by at least this
      many references (sequences + cache nodes) move into the base pool
      (`PoolConfig.base_pool_fraction`), where compaction never moves them
      (0: off).
    promote_every: steps between promotion passes.
    output_reserve_ratio: admission keeps free this fraction of the blocks that
      every running sequence and the new one may still need for their output
      (`max_new_tokens` minus tokens generated). 0 admits on the prompt alone
      (more concurrency, preemption storms under pressure); 1 never preempts when
      `max_new_tokens` is exact. Blocks held only by the cache count as free (they
      are evicted to make room).
    watermark_blocks: free blocks admission leaves beyond that.
    stop_token: end-of-sequence token (-1: none).
    stats_every: take the cheap `metrics.StepStats` every this many steps (0:
      never). They are the pool at the start of the step: the reduction is
      dispatched first and read at the step's end, so the device computes it
      while the host schedules (the governance quota reads it at once).
      Compaction's trigger reads the latest ones (up to `stats_every` steps
      old, or the budgeted interval; with 0 it computes the ratio itself).
    stats_budget: None (default): the figures every `stats_every` steps. A
      share of the step's host time (e.g. 0.02): the scheduler measures what
      the figures cost the host (dispatch and read, a moving average) against
      the rest of the step and takes them every `k >= stats_every` steps, the
      smallest `k` that keeps their average cost within the share (at most
      every `MAX_STATS_INTERVAL` steps). On a GPU that is every step; on a CPU,
      where the reduction runs on the host, small batches stretch it.
    snapshot_every: take the full host `metrics.PoolSnapshot` (every block
      copied to the host) every this many steps (0: never); also on demand,
      `Scheduler.take_snapshot()`.
    governance: live/cached quotas with watermarks and the two-phase GC
      (`paged_kv.serving.governance`; None: plain eviction on demand).
    max_logprobs: the most top logprobs a request may ask for
      (`SamplingParams.logprobs`); the step computes this many for every row of a
      sampling executor (a static width: one program), 0 = none.
    seed: the seeds of requests without one: `seed` + their submit order.
  """

  max_batch: int = 32
  prefill_token_budget: int = 512
  prefill_chunk: int = 128
  preemption: str = "recompute"
  enable_prefix_cache: bool = True
  evict_policy: str = "lru"
  pack_tails: bool = False
  compaction: compact.CompactionPolicy | None = compact.CompactionPolicy()
  promote_readers: int = 0
  promote_every: int = 16
  output_reserve_ratio: float = 0.5
  watermark_blocks: int = 0
  stop_token: int = -1
  stats_every: int = 1
  stats_budget: float | None = None
  snapshot_every: int = 100
  governance: CacheGovernance | None = None
  max_logprobs: int = 0
  seed: int = 0

  def __post_init__(self):
    """Checks every field (`paged_kv.core.fields`: `InvalidArgument` naming the field,
    the value and what is allowed); the bounds that depend on the pool
    (`max_batch <= max_seqs`, the watermark below the dynamic blocks) are checked
    when a `Scheduler` is built."""
    own = "SchedulerConfig"
    put = lambda name, value: object.__setattr__(self, name, value)
    for name, low, high in (("max_batch", 1, fields.I32_MAX), ("prefill_token_budget", 1, fields.I32_MAX),
                            ("prefill_chunk", 1, fields.I32_MAX), ("promote_every", 1, fields.I32_MAX),
                            ("promote_readers", 0, fields.I32_MAX), ("watermark_blocks", 0, fields.I32_MAX),
                            ("stats_every", 0, fields.I32_MAX), ("snapshot_every", 0, fields.I32_MAX),
                            ("stop_token", -1, fields.I32_MAX), ("max_logprobs", 0, 1024),
                            ("seed", 0, fields.I32_MAX)):
      put(name, fields.check_int(own, name, getattr(self, name), low, high))
    put("preemption", fields.check_choice(own, "preemption", self.preemption, PREEMPTION_MODES))
    put("evict_policy", fields.check_choice(own, "evict_policy", self.evict_policy, POLICIES))
    for name in ("enable_prefix_cache", "pack_tails"):
      put(name, fields.check_bool(own, name, getattr(self, name)))
    put("output_reserve_ratio", fields.check_number(own, "output_reserve_ratio",
                                                    self.output_reserve_ratio, 0.0, 1.0))
    put("stats_budget", fields.check_number(own, "stats_budget", self.stats_budget, 0.0, 1.0,
                                            low_open=True, optional=True))
    if self.compaction is not None and not isinstance(self.compaction, compact.CompactionPolicy):
      raise InvalidArgument(f"{own}.compaction must be a CompactionPolicy or None, got "
                            f"{self.compaction!r}")
    if self.governance is not None and not isinstance(self.governance, CacheGovernance):
      raise InvalidArgument(f"{own}.governance must be a CacheGovernance or None, got "
                            f"{self.governance!r}")


@dataclasses.dataclass
class SchedulerStats:
  """Cumulative counters of a scheduler run."""

  steps: int = 0
  admitted: int = 0
  finished: int = 0  # aborted requests included
  aborted: int = 0  # `Scheduler.abort` of a request before it finished
  prompt_tokens: int = 0
  hit_tokens: int = 0
  prefill_tokens: int = 0
  decode_tokens: int = 0
  preemptions: int = 0
  preemptions_recompute: int = 0
  preemptions_swap: int = 0
  swap_to_host_bytes: int = 0
  swap_in_bytes: int = 0
  evicted_tokens: int = 0
  evictions: int = 0
  compactions: int = 0
  max_running: int = 0
  quota_holds: int = 0  # admissions held back by the live quota (governance)
  prefix_dropped: int = 0  # heads admitted alone without their cached prefix (it cost more)
  quota_evicted_blocks: int = 0  # cached-only blocks evicted above the cached quota
  gc_marked_nodes: int = 0  # cache nodes marked by the GC's phase 1 (all passes)
  gc_evicted_tokens: int = 0  # tokens evicted from GC-marked nodes
  shrinks: int = 0  # shrinks that reached their cut (`Scheduler.shrink_to`)
  shrink_steps: int = 0  # steps with a shrink pending (the cut's included)
  shrink_moves: int = 0  # blocks the shrinks moved below their cut
  shrink_bytes_moved: int = 0  # their bytes (at the shrink's `block_bytes`)
  shrink_evicted_blocks: int = 0  # cached-only blocks evicted to make room below a cut
  shrink_blocks_returned: int = 0  # blocks the cuts gave back
  # Device traffic (`paged_kv.runtime.counters`): the pool's dispatches and blocking
  # reads, and the process's XLA compiles, since the scheduler was built / warmed up.
  device_dispatches: int = 0  # jitted programs launched (commits, steps, K/V data)
  bookkeeping_dispatches: int = 0  # of which bookkeeping (commits, synchronous calls)
  blocking_reads: int = 0  # host reads that waited on the device (sampled tokens excluded)
  backend_compiles: int = 0  # XLA compiles in the process since the scheduler was built
  compiles_after_warmup: int = 0  # ... since `Scheduler.warmup()` (0 is the goal)
  rewarm_compiles: int = 0  # compiles of a shrink's re-warm at its cut (a new pool size)

  @property
  def prefix_cache_hit_rate(self) -> float:
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def preemption_rate(self) -> float:
    """Preemptions per admitted request."""
    return self.preemptions / self.admitted if self.admitted else 0.0


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What one scheduler step did, handed to `Scheduler(on_step=...)` after it.

  Attributes:
    step: the step's id (0, 1, ...).
    time: the scheduler's clock at the end of the step.
    host_seconds: wall seconds the step took (`time.perf_counter`; the
      executor's call included).
    pool: the cheap pool figures at the start of the step (None on steps
      without them, see `SchedulerConfig.stats_every`).
    snapshot: the full pool snapshot, on the steps that took one.
    stats: the scheduler's cumulative counters (the live object: read, don't keep).
    counters: the pool's cumulative counters (OOMs by reason, compaction...).
    num_running, num_waiting, num_swapped: queue lengths after the step.
    finished: requests that finished in this step (`stop_reason` says why).
    first_token_latencies: seconds from `submit` to the first token, for every
      request whose first token came in this step.
    inter_token_latencies: seconds between consecutive tokens of one request,
      for every token emitted in this step after a request's first (a request
      preempted in between counts its wait).
    alerts: alerts that fired in this step (edge-triggered, `metrics.AlertMonitor`).
    tokens: `(request_id, token)` of every token emitted in this step, in order
      (a stream: `paged_kv.serving.streaming.generate` yields them per request).
  """

  step: int
  time: float
  host_seconds: float
  pool: metrics.StepStats | None
  snapshot: metrics.PoolSnapshot | None
  stats: "SchedulerStats"
  counters: metrics.PoolCounters
  num_running: int
  num_waiting: int
  num_swapped: int
  finished: tuple
  first_token_latencies: tuple
  inter_token_latencies: tuple
  alerts: tuple
  tokens: tuple = ()


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class _Admission(NamedTuple):
  """A waiting request admitted in this step, to open with the others."""

  request: "Request"
  segments: np.ndarray  # i32[n, 3] the matched prefix it shares
  node: object  # the locked match node (None: no match)
  matched: int  # tokens the segments cover
  context_size: int  # tokens to compute before its next output token


class Scheduler:
  """Continuous batching over a `CachedPool` (a `BlockPool` bound to its `PrefixCache`).

  Every reference the cache takes or drops is applied by the `CachedPool`; the
  scheduler never handles a `RefDeltas`. `pool` is the `BlockPool` (the executor
  works on `pool.state`), `cached_pool` the bound pair, `cache` a read-only view
  of the prefix cache (None when caching is off).

  Attributes (the queues: read them, change them only through `submit` and `abort`):
    waiting: `Request`s queued for admission (FCFS; recomputed preemptions first).
    swapped: requests preempted by swap, their K/V on the host.
    running: requests holding a pool row (`Request.seq_id`), in admission order; an
      executor maps a step's batch rows (`StepPlan.seq_ids`: decodes first, then
      prefill chunks) to requests by that row.
    finished: requests finished (or aborted) since the last `take_finished()`.

  Example:
    pool = BlockPool(PoolConfig(num_blocks=4096, block_size=16, max_seqs=64, ...))
    sched = Scheduler(pool, DryExecutor(pool.config), SchedulerConfig(max_batch=32))
    sched.submit(Request(0, prompt_tokens, max_new_tokens=64))
    sched.run()                      # until every submitted request finished
    sched.stats, sched.snapshots
    done = sched.take_finished()     # the finished requests, handed over (a server
                                     # takes them every step: `finished` grows until then)
  """

  def __init__(self, pool: BlockPool | CachedPool, executor: Executor,
               config: SchedulerConfig = SchedulerConfig(), *, cache: PrefixCache | None = None,
               clock: Callable[[], float] = time.monotonic,
               on_snapshot: Callable[[int, metrics.PoolSnapshot, "SchedulerStats"], None] | None = None,
               on_step: Callable[[StepReport], None] | None = None):
    """Builds a scheduler.

    Args:
      pool: a `BlockPool` (bound here to `cache` or to a new cache), or a
        `CachedPool` whose cache is used.
      executor: the model work of a step.
      config: scheduling and memory policies.
      cache: a prefix cache for a plain `pool` (its references must already be
        in the pool: an empty cache, or one `load_prefix_cache` filled); default
        a new one from `config` when `config.enable_prefix_cache`.
      clock: time source for latencies and the new cache's LRU/TTL.
      on_snapshot: called with `(step, snapshot, stats)` after each snapshot.
      on_step: called with a `StepReport` after every step (also settable
        later as `sched.on_step`; `paged_kv.telemetry.export` exporters attach here).
    """
    if not isinstance(config, SchedulerConfig):
      raise InvalidArgument(f"config must be a SchedulerConfig, got {type(config).__name__}")
    if not isinstance(pool, (CachedPool, BlockPool)):
      raise InvalidArgument(f"pool must be a BlockPool or a CachedPool, got "
                            f"{type(pool).__name__}")
    pc = pool.config
    if config.max_batch > pc.max_seqs:
      raise InvalidArgument(f"SchedulerConfig.max_batch must be at most the pool's max_seqs "
                            f"({pc.max_seqs}), got {config.max_batch}")
    if config.watermark_blocks >= pc.num_blocks - pc.num_base_blocks:
      raise InvalidArgument(f"SchedulerConfig.watermark_blocks must be below the pool's "
                            f"{pc.num_blocks - pc.num_base_blocks} dynamic blocks, got "
                            f"{config.watermark_blocks}")
    if isinstance(pool, CachedPool):
      if cache is not None:
        raise InvalidArgument("pass the cache inside the CachedPool, not beside it")
      cached_pool = pool
    else:
      cached_pool = CachedPool(pool, cache, policy=config.evict_policy,
                               pack_tails=config.pack_tails, clock=clock)
    self.cached_pool = cached_pool
    self.pool = cached_pool.pool
    self.executor = executor
    self.config = config
    self.clock = clock
    # Match prompts in and insert finished sequences into the cache.
    self._caching = config.enable_prefix_cache or cache is not None
    self.waiting: collections.deque[Request] = collections.deque()
    self.swapped: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # admission order
    self.finished: list[Request] = []
    self.stats = SchedulerStats()
    self.counters = metrics.PoolCounters()
    # The latest snapshots and alerts (bounded: a long-running server keeps memory
    # flat; every one is also handed to `on_snapshot` / in the `StepReport`).
    self.snapshots: collections.deque[metrics.PoolSnapshot] = collections.deque(
        maxlen=MAX_KEPT_SNAPSHOTS)
    self.alerts: collections.deque[metrics.Alert] = collections.deque(maxlen=MAX_KEPT_ALERTS)
    self._monitor = metrics.AlertMonitor()
    self._on_snapshot = on_snapshot
    self.on_step = on_step
    self._now = 0.0  # the clock at the step's start, then after its forward pass
    # The cheap pool figures of the latest step's start (`take_stats()`: now).
    self.last_stats: metrics.StepStats | None = None
    self._pending_stats: metrics.StepStats | None = None  # the figures of this step's start
    # `stats_budget` pacing: moving averages of the figures' and the rest of a
    # step's host seconds, and the interval they give (1 until measured).
    self._stats_cost: float | None = None
    self._rest_cost = 0.0
    self._next_stats_step = 0
    self.stats_interval = max(1, config.stats_every)
    self._reset_step_record()
    self._step = 0
    self._last_reclaim = -RECLAIM_EVERY
    # id -> request, each object submitted once; weak, so a long-running server does
    # not keep every request it ever served (a dead entry's id may be reused).
    self._submitted: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
    self._live: dict[Hashable, Request] = {}  # request_id -> a submitted, unfinished request
    self._num_submitted = 0
    gov = config.governance
    pc = cached_pool.config
    self._quota = (gov.quota(pc.num_blocks - pc.num_base_blocks)
                   if gov is not None and gov.quotas else None)
    self._live_limit: int | None = None  # this step's live quota (governance)
    self._live_used = 0  # live blocks: the latest figures plus what this step admitted
    self._broken: str | None = None
    self.num_recoveries = 0  # steps that raised and were recovered from
    self.warmup_report: WarmupReport | None = None
    self._runtime_base = self.pool.runtime.snapshot()
    self._compiles_at_warmup: int | None = None

  # ------------------------------------------------------------------ public
  @property
  def cache(self) -> CacheView | None:
    """A read-only view of the prefix cache; None when caching is off."""
    return self.cached_pool.cache if self._caching else None

  def warmup(self, *, progress: bool = True, persistence: bool = True) -> WarmupReport:
    """Compiles (runs once) every program the serving path can run; see
    `paged_kv.serving.warmup`. After it, `stats.compiles_after_warmup` counts
    what compiled anyway (0 for any workload the configs admit). With
    `persistence`, `CachedPool.save` / `restore`'s programs too.

    Returns:
      The `WarmupReport` (also `self.warmup_report`): programs, compiles, cache
      loads, seconds.
    """
    self._check_usable()
    self._warm_persistence = persistence
    self.warmup_report = warmup_lib.warm(self, progress=progress, persistence=persistence)
    self._compiles_at_warmup = counters.backend_compiles()
    self._update_runtime_stats()
    return self.warmup_report

  @property
  def runtime(self) -> counters.RuntimeStats:
    """The pool's device traffic since the scheduler was built (dispatches, reads,
    compiles; see `paged_kv.runtime.counters`)."""
    return self.pool.runtime.snapshot().since(self._runtime_base)

  def _update_runtime_stats(self) -> None:
    rt = self.runtime
    st = self.stats
    st.device_dispatches = rt.num_dispatches
    st.bookkeeping_dispatches = rt.bookkeeping_dispatches
    st.blocking_reads = rt.blocking_reads
    st.backend_compiles = rt.backend_compiles
    if self._compiles_at_warmup is not None:
      st.compiles_after_warmup = counters.backend_compiles() - self._compiles_at_warmup

  def submit(self, request: Request) -> None:
    """Queues a request (FCFS).

    The request's inputs are validated and frozen (`Request`): later changes to the
    caller's arrays change nothing, assignments to its input fields are refused.

    Raises:
      InvalidArgument: not a `Request`, submitted before (the same object), carrying
        progress, bad fields (`Request.validate`), or an id an unfinished request
        holds.
      radix.InvalidNamespaceError: the namespace is not a typed key.
      PoolExhausted: it could not run even in an empty pool (so an accepted
        request always runs once the pool drains).
      SchedulerBroken: the scheduler refuses further use.
    """
    self._check_usable()
    if not isinstance(request, Request):
      raise InvalidArgument(f"submit takes a Request, got {type(request).__name__}")
    if id(request) in self._submitted:
      raise InvalidArgument(f"request {request.request_id!r} was already submitted (the same "
                            f"Request object); submit a new Request")
    if (request.phase != Phase.WAITING or request.output or request.seq_id is not None
        or request.swapped is not None or request.lock_node is not None):
      raise InvalidArgument(f"request {request.request_id!r} carries progress; submit a new "
                            f"Request")
    request.validate()
    try:
      live = request.request_id in self._live
    except TypeError as e:
      raise InvalidArgument(f"request_id must be hashable, got {request.request_id!r}") from e
    if live:
      raise InvalidArgument(f"request id {request.request_id!r} is in use by an unfinished "
                            f"request; ids are unique among live requests")
    bs, pc = self._bs, self.pool.config
    need = self._alone_need(request)
    if need > pc.num_blocks - pc.num_base_blocks:
      raise PoolExhausted(f"request {request.request_id} needs up to {need} blocks; the pool "
                          f"has {pc.num_blocks - pc.num_base_blocks} dynamic blocks",
                          reason="no_free_block")
    if _cdiv(request.prompt.size + request.max_new_tokens, bs) > pc.max_segments:
      raise PoolExhausted(f"request {request.request_id} may need more than "
                          f"max_segments={pc.max_segments} segments", reason="table_full")
    sp = request.sampling
    if sp is not None and sp.logprobs > self.config.max_logprobs:
      raise InvalidArgument(f"request {request.request_id!r} asks {sp.logprobs} logprobs; "
                            f"SchedulerConfig.max_logprobs is {self.config.max_logprobs}")
    request._freeze()  # pylint: disable=protected-access
    stops = set(sp.stop_token_ids) if sp is not None else set()
    if self.config.stop_token >= 0:
      stops.add(self.config.stop_token)
    request.stop_ids = frozenset(stops)
    request.sample_seed = (sp.seed if sp is not None and sp.seed is not None
                           else (self.config.seed + self._num_submitted) % (2**32))
    self._num_submitted += 1
    self._submitted[id(request)] = request
    self._live[request.request_id] = request
    request.submit_time = self.clock()
    request.submit_step = self._step
    self.waiting.append(request)

  def abort(self, request_id: Hashable) -> Request:
    """Ends a request now, in any phase; returns it (`stop_reason="abort"`).

    Waiting: it leaves the queue. Swapped: its host copy of the K/V is dropped.
    Running (mid-prefill or decoding): like a finished request, its computed
    tokens go into the prefix cache (cached-only blocks: evictable) and its row and
    its lock on a cached prefix are released at once. Its tokens so far stay in
    `output`; it joins `finished` (`take_finished`) and the next step's
    `StepReport.finished` (so exporters count it). Call it between steps.

    Raises:
      UnknownRequest: no unfinished request has this id (never submitted, already
        finished or aborted). Nothing changed.
      SchedulerBroken: the scheduler refuses further use.
    """
    self._check_usable()
    try:
      req = self._live.get(request_id)
    except TypeError:
      req = None
    if req is None:
      raise UnknownRequest(f"no unfinished request has id {request_id!r}")
    if req.phase == Phase.WAITING:
      self.waiting.remove(req)
    elif req.phase == Phase.SWAPPED:
      self.swapped.remove(req)
      req.swapped = None
    else:
      try:
        self._store_and_release(req)  # the request stays running until this succeeded
      except BaseException as exc:
        self._recover(exc)
        raise
      self.running.remove(req)
      node, req.lock_node, req.seq_id = req.lock_node, None, None
      if node is not None:
        self.cached_pool.unlock(node)
    req.stop_reason = "abort"
    self.stats.aborted += 1
    self._now = self.clock()
    self._mark_finished(req)
    self._finished_now.remove(req)
    self._aborted.append(req)  # in the next step's report
    return req

  def _alone_need(self, request: Request) -> int:
    """The rule `submit` and admission share: the most dynamic blocks `request` asks
    for alone in a drained pool, computing every token (no cached prefix).

    Its whole prompt and its whole output, a partial block each, plus the watermark.
    `submit` refuses more. Admission asks no more of a head with nothing else running:
    when the usual check (its uncomputed context, the output reserve, the watermark)
    fails there, `_try_admit` admits it on its context and the watermark alone,
    without a cached prefix (whose blocks it would lock): at most `cdiv(prompt +
    output - 1) + 1` blocks plus the watermark, within this bound. So an accepted
    request always runs once the pool drains.
    """
    p, m = int(request.prompt.size), int(request.max_new_tokens)
    return _cdiv(p, self._bs) + _cdiv(m, self._bs) + 2 + self.config.watermark_blocks

  @property
  def idle(self) -> bool:
    return not (self.waiting or self.swapped or self.running)

  def take_finished(self) -> list[Request]:
    """The finished requests since the last call, in finishing order, handed over:
    `finished` is emptied (it holds every finished request until taken, so a
    long-running server takes them after each step, or its memory grows)."""
    done, self.finished = self.finished, []
    return done

  def run(self, *, max_steps: int | None = None,
          before_step: Callable[["Scheduler"], None] | None = None) -> None:
    """Steps until idle (or `max_steps`); `before_step(self)` may submit arrivals."""
    n = 0
    while max_steps is None or n < max_steps:
      if before_step is not None:
        before_step(self)
      if self.idle:
        break
      self.step()
      n += 1

  def step(self) -> None:
    """One scheduling step (see the module docstring).

    Exception-safe: whatever it raises, the scheduler was reconciled first (see
    the module docstring) and stays usable, unless it raises `SchedulerBroken`
    from then on.

    Raises:
      SchedulerBroken: the pool's donated state is gone (now or before).
      Anything a call site raised (the executor, `on_snapshot`, ...), after recovery.
    """
    self._check_usable()
    try:
      self._step_once()
    except BaseException as exc:
      self._recover(exc)
      raise

  def _reset_step_record(self) -> None:
    # Requests aborted since the last step are reported with this one.
    self._finished_now: list[Request] = list(getattr(self, "_aborted", ()))
    self._aborted: list[Request] = []
    self._tokens_now: list[tuple[Hashable, int]] = []
    self._ttft_now: list[float] = []
    self._itl_now: list[float] = []
    self._alerts_now: list[metrics.Alert] = []

  def _step_once(self) -> None:
    t0 = time.perf_counter()
    self._reset_step_record()
    self._now = self.clock()
    stats_seconds = 0.0
    self._pending_stats = None
    if self._takes_stats():
      # The figures of the step's start, from the pool's host mirror (no device work).
      self._pending_stats = metrics.step_stats_host(self.pool.host, self.pool.config,
                                                    counters=self.counters)
      stats_seconds = time.perf_counter() - t0
    self._govern()
    self._admit()
    if not self.running and (self.waiting or self.swapped):
      # `submit` refuses what cannot fit an empty pool, so this is a bug, not load.
      raise RuntimeError(f"scheduler stalled: nothing running, {len(self.waiting)} waiting, "
                         f"{len(self.swapped)} swapped, {self.pool.num_free_blocks} free blocks")
    self._forward()
    self._finish()
    self._maybe_compact()
    self._maybe_shrink()
    self._maybe_promote()
    # The step is done: its id and the counter advance together, before the
    # snapshot's callback (which may raise) runs.
    step_id = self._step
    self._step += 1
    self.stats.steps += 1
    self._update_runtime_stats()
    self.stats.max_running = max(self.stats.max_running, len(self.running))
    pool_stats = snap = None
    if self._pending_stats is not None:
      t1 = time.perf_counter()
      pool_stats = self.last_stats = dataclasses.replace(
          self._pending_stats, oom_by_reason=dict(self.counters.oom_by_reason))
      self._pending_stats = None
      stats_seconds += time.perf_counter() - t1
      self._pace_stats(step_id, stats_seconds, time.perf_counter() - t0 - stats_seconds)
      self._observe_alerts(pool_stats)
    every = self.config.snapshot_every
    if every and step_id % every == 0:
      snap = self._snapshot(step_id)
    if self.on_step is not None:
      self.on_step(StepReport(
          step=step_id, time=self.clock(), host_seconds=time.perf_counter() - t0,
          pool=pool_stats, snapshot=snap, stats=self.stats, counters=self.counters,
          num_running=len(self.running), num_waiting=len(self.waiting),
          num_swapped=len(self.swapped), finished=tuple(self._finished_now),
          first_token_latencies=tuple(self._ttft_now),
          inter_token_latencies=tuple(self._itl_now), alerts=tuple(self._alerts_now),
          tokens=tuple(self._tokens_now)))

  def _takes_stats(self) -> bool:
    every = self.config.stats_every
    if not every:
      return False
    if self.config.stats_budget is None:
      return self._step % every == 0
    return self._step >= self._next_stats_step

  def _pace_stats(self, step_id: int, stats_seconds: float, rest_seconds: float) -> None:
    """With `stats_budget`: the next step to take the figures at (moving averages)."""
    budget = self.config.stats_budget
    if budget is None:
      return
    a = STATS_COST_SMOOTHING
    if self._stats_cost is None:
      self._stats_cost, self._rest_cost = stats_seconds, rest_seconds
    else:
      self._stats_cost += a * (stats_seconds - self._stats_cost)
      self._rest_cost += a * (rest_seconds - self._rest_cost)
    want = self._stats_cost / max(budget * self._rest_cost, 1e-9)
    k = min(MAX_STATS_INTERVAL, max(self.config.stats_every, math.ceil(want)))
    self.stats_interval = k
    self._next_stats_step = step_id + k

  # ------------------------------------------------------------------ exception safety
  @property
  def broken(self) -> str | None:
    """Why the scheduler refuses further use, or None while it is usable."""
    return self._broken

  def _check_usable(self) -> None:
    if self._broken is None and state_lost(self.pool):
      self._broken = ("the pool's state points at deleted buffers (donated to a jitted call "
                      "whose new state never came back); its K/V and bookkeeping are gone")
    if self._broken is not None:
      raise SchedulerBroken(f"scheduler unusable: {self._broken}")

  def _recover(self, exc: BaseException) -> None:
    """Reconciles requests, rows, locks and the cache after `exc` interrupted a step."""
    self.num_recoveries += 1
    try:
      if state_lost(self.pool):
        raise PoolStateLost(f"the pool's state buffers were deleted by {type(exc).__name__}: "
                            f"{exc} (an executor that raises after donating must attach the "
                            f"new state, see paged_kv.serving.executor)")
      if self.cached_pool.recover():  # pool and cache disagreed: the cache was dropped
        for req in self.running:
          req.lock_node = None
      self._reconcile_rows()
      self.cached_pool.reset_locks(
          [r.lock_node for r in self.running if r.lock_node is not None])
      self.cached_pool.check_invariants()
    except BaseException as failure:  # pylint: disable=broad-except
      self._broken = (f"recovery from {type(exc).__name__}({exc}) failed with "
                      f"{type(failure).__name__}: {failure}")

  def _reconcile_rows(self) -> None:
    """Every running request owns a live row holding exactly its cached tokens; every
    live row belongs to a running request."""
    host = self.pool.host  # reloaded from the device after an interrupted step
    active, seq_len = host.active, host.seq_len
    owned: set[int] = set()
    for req in list(self.running):
      row = req.seq_id
      if (row is not None and active[row] and row not in owned
          and int(seq_len[row]) == req.num_cached):
        owned.add(row)
        continue
      # Its row is gone (released by the interrupted call) or holds tokens whose
      # results were lost (an executor raised after reserving): recompute it.
      self.running.remove(req)
      req.seq_id, req.lock_node = None, None
      if self._is_finished(req):  # finished, and its release went through
        self._mark_finished(req)
        continue
      req.num_cached = 0
      req.phase = Phase.WAITING
      self.waiting.appendleft(req)
    stray = [int(r) for r in np.flatnonzero(active) if int(r) not in owned]
    if stray:
      self.pool.release(stray)

  # ------------------------------------------------------------------ helpers
  @property
  def _bs(self) -> int:
    return self.pool.config.block_size

  def _free_rows(self) -> int:
    used = len(self.running)
    return min(self.config.max_batch, self.pool.config.max_seqs) - used

  def _evict(self, num_blocks: int) -> int:
    """Evicts cached-only blocks (the `CachedPool` applies the decrefs); returns blocks freed."""
    if num_blocks <= 0:
      return 0
    before = self.pool.num_free_blocks
    gov = self.config.governance
    if gov is not None and gov.gc_ttl is not None:
      # GC phase 2 first: marked (idle) nodes, highest block address first.
      ev = self.cached_pool.gc_evict(num_blocks=num_blocks)
      if ev.num_segments:
        self.stats.evictions += 1
        self.stats.evicted_tokens += ev.num_tokens
        self.stats.gc_evicted_tokens += ev.num_tokens
      num_blocks -= self.pool.num_free_blocks - before
    if num_blocks > 0:
      ev = self.cached_pool.evict(num_blocks=num_blocks)
      if ev.num_segments:
        self.stats.evictions += 1
        self.stats.evicted_tokens += ev.num_tokens
    return self.pool.num_free_blocks - before

  def _govern(self) -> None:
    """Governance at the start of a step: GC marks, quota update, cached-quota eviction."""
    gov = self.config.governance
    if gov is None or not self._caching:
      return
    if gov.gc_ttl is not None and self._step % gov.gc_every == 0:
      self.stats.gc_marked_nodes += self.cached_pool.gc_mark(gov.gc_ttl).num_nodes
    if self._quota is None:
      return
    # The figures of the step's start (taken already when this step takes them).
    fig = self.last_stats = self._pending_stats or metrics.step_stats_host(
        self.pool.host, self.pool.config, counters=self.counters)
    decision = self._quota.update(fig.used_blocks, fig.cached_blocks)
    self._live_limit, self._live_used = decision.live_limit, fig.used_blocks
    if decision.evict_cached > 0:
      self.stats.quota_evicted_blocks += self._evict(decision.evict_cached)

  def _ensure_free(self, need: int) -> bool:
    short = need - self.pool.num_free_blocks
    if short > 0:
      self._evict(short)
    return self.pool.num_free_blocks >= need

  # ------------------------------------------------------------------ 1. admission
  # Per `_admit` call (None outside it): the output reserve of the running and
  # just-admitted requests, and the free blocks left for the step's admissions.
  _reserve_base: int | None = None
  _admit_free: int | None = None

  def _admit(self) -> None:
    """Swapped requests first, then the waiting ones, FCFS, until one does not fit.

    The waiting requests admitted in a step open together (`CachedPool.open_many`:
    one device call for all rows, one for their tail copies); each is decided as
    if the ones before it were open already: the output reserve and the free
    blocks are tracked on the host (evictions add theirs, tail copies take one).
    """
    if not (self.waiting or self.swapped) or self._free_rows() <= 0:
      return  # nothing can be admitted (and the reserve sum below is O(batch) Python)
    self._reserve_base = self._reserve_sum(self.running)
    try:
      if self._admit_swapped():
        self._admit_waiting()
    finally:
      self._reserve_base = self._admit_free = None

  def _admit_swapped(self) -> bool:
    """Swaps requests back in while they fit; False when the head must wait for room."""
    while self.swapped and self._free_rows() > 0:
      req = self.swapped[0]
      need = _cdiv(req.swapped.length, self._bs) + 1
      wm = self.config.watermark_blocks
      if not self._ensure_free(need + self._output_reserve(req) + wm) and (
          self.running or not self._ensure_free(need + wm)):  # alone: as `_try_admit`
        return False  # swapped requests go first: wait for room
      seq = swap_in(self.pool, req.swapped)  # atomic: nothing opened on an exception
      self.swapped.popleft()
      req.seq_id = seq
      self.stats.swap_in_bytes += req.swapped.nbytes
      req.swapped = None
      req.phase = Phase.RUNNING
      self.running.append(req)
      self._reserve_base += self._request_reserve(req)
    return True

  def _admit_waiting(self) -> None:
    admits: list[_Admission] = []
    rows = self._free_rows()
    tails: set = set()  # continuable tails this step's opens copy
    for req in self.waiting:  # nothing below changes the queue until the opens succeed
      if len(admits) >= rows:
        break
      admission = self._try_admit(req, tails, len(admits))
      if admission is None:
        break
      admits.append(admission)
    if not admits:
      return
    try:
      seqs = self.cached_pool.open_many([a.segments for a in admits])
    except PagedKVError:
      for a in admits:
        if a.node is not None:
          self.cached_pool.unlock(a.node)
      raise  # (other exceptions: the step's recovery rebuilds the lock counts)
    for a, seq in zip(admits, seqs):
      req = a.request
      req.seq_id, req.lock_node, req.num_cached = int(seq), a.node, a.matched
      req.prefill_target = a.context_size
      req.phase = Phase.RUNNING
      if req.admit_step < 0:
        req.admit_step = self._step
        req.admit_time = self._now
        req.hit_tokens = a.matched
        self.stats.admitted += 1
        self.stats.prompt_tokens += int(req.prompt.size)
        self.stats.hit_tokens += a.matched
      self.waiting.popleft()
      self.running.append(req)

  def _admit_room(self, need: int) -> bool:
    """`_ensure_free` for the waiting requests of a step: the free blocks are read
    once and tracked (an eviction adds what it freed, a pending tail copy takes one)."""
    if self._admit_free is None:
      self._admit_free = self.pool.num_free_blocks
    if need > self._admit_free:
      self._admit_free += self._evict(need - self._admit_free)
    return self._admit_free >= need

  def _try_admit(self, req: Request, tails: set, pending: int = 0) -> "_Admission | None":
    """Matches `req`'s prefix (locked) and decides whether it fits now; None: it waits.

    Admitted, it opens with the others of the step (`_admit_waiting`): `pending`
    of them were admitted before it, and `tails` are the continuable tails their
    opens copy (a copy takes a block).
    """
    resumed = bool(req.output)
    # A resumed request recomputes everything but its pending token; a fresh one
    # keeps at least one prompt token to compute (for the first token's logits).
    context = req.tokens[:-1] if resumed else req.prompt
    probe = context if resumed else context[:-1]
    matched, segs, node = 0, np.zeros((0, 3), np.int32), None
    if self._caching and probe.size:
      m = self.cached_pool.match(req.namespace, probe, lock=True, record=not resumed)
      matched, segs, node = m.length, m.segments, m.node
    # Keep the segment table from overflowing: a matched prefix may hold more segments
    # than its tokens need (nodes split mid-block), and the tokens still to come take
    # one segment per fresh block (they start at slot 0 after a shared tail and then
    # fill in place). Share fewer segments (compute more) when it would not fit; with
    # no shared segment it fits, by `submit`'s check.
    out_left = req.max_new_tokens - len(req.output)
    while len(segs) and len(segs) + _cdiv(context.size - matched + out_left, self._bs) > (
        self.pool.config.max_segments):
      segs = segs[:-1]
      matched = int(segs[:, 2].sum())
    need = _cdiv(context.size - matched, self._bs) + 1
    held = (self._live_limit is not None and (self.running or pending)
            and self._live_used + need > self._live_limit)  # never when nothing runs
    if held:
      self.stats.quota_holds += 1
    alone = not self.running and not pending
    if held or not self._admit_room(need + self._output_reserve(req)
                                    + self.config.watermark_blocks):
      if node is not None:
        self.cached_pool.unlock(node)
      if held or not alone:
        return None
      # Alone, the usual check can ask more than the drained pool holds: a cached prefix
      # locks its blocks (not evictable) while the tokens after it take fresh ones (a
      # copied partial tail, a partial block), and a resumed request's context plus its
      # output reserve can pass `submit`'s bound by a block. The reserve guards others'
      # growth (there are none) and the prefix is optional: without both the request
      # asks at most `_alone_need`, which `submit` checked. Admit it so, never stall.
      dropped = bool(matched)
      matched, segs, node = 0, segs[:0], None
      need = _cdiv(context.size, self._bs) + 1
      if not self._admit_room(need + self.config.watermark_blocks):
        return None  # only pinned cached blocks can hold the drained pool
      self.stats.prefix_dropped += dropped
    self._live_used += need
    self._reserve_base += self._reserve_blocks(int(context.size) - matched, out_left)
    if self.cached_pool.continues_tail(segs):
      tail = tuple(int(x) for x in segs[-1])
      if tail not in tails and tail[2] < self._bs:
        tails.add(tail)
        if self._admit_free > 0:  # the copy takes a block when one is free
          self._admit_free -= 1
    return _Admission(req, segs, node, matched, int(context.size))

  def _reserve_blocks(self, prompt_left: int, out_left: int) -> int:
    """Blocks one sequence keeps free: its uncomputed prompt and `output_reserve_ratio`
    of its output to come (one more block for a partial tail)."""
    tokens = max(prompt_left, 0) + int(self.config.output_reserve_ratio * max(out_left, 0))
    return _cdiv(tokens, self._bs) + 1 if tokens else 0

  def _request_reserve(self, r: Request) -> int:
    return self._reserve_blocks(r.prefill_target - r.num_cached, r.max_new_tokens - len(r.output))

  def _reserve_sum(self, requests) -> int:
    """`sum(_request_reserve(r) for r in requests)`, inlined: O(batch) Python every
    step that admits, so without two calls per request."""
    bs, ratio, total = self._bs, self.config.output_reserve_ratio, 0
    for r in requests:
      tokens = max(r.prefill_target - r.num_cached, 0)
      if ratio:
        tokens += int(ratio * max(r.max_new_tokens - len(r.output), 0))
      if tokens:
        total += -(-tokens // bs) + 1
    return total

  def _output_reserve(self, new: Request) -> int:
    """Blocks to keep free for what admitted sequences will still need.

    Every running sequence's uncomputed prompt (admission is by full input
    length, so a prompt admitted earlier keeps its room), plus
    `output_reserve_ratio` of the output still to come of the running sequences
    and of `new`, counted per sequence (one more block for a partial tail).
    During `_admit` the running part is kept as a sum (O(1) per admission).
    """
    base = self._reserve_base
    if base is None:
      base = self._reserve_sum(self.running)
    return base + self._reserve_blocks(0, new.max_new_tokens - len(new.output))

  # ------------------------------------------------------------------ 2-3. one forward pass
  def _prefill_chunks(self) -> list[tuple[Request, int]]:
    """This step's prompt chunks `(request, tokens)`: FCFS under the token budget."""
    budget = self.config.prefill_token_budget
    chunk = self.config.prefill_chunk
    chunks = []
    for req in self.running:
      left = req.prefill_target - req.num_cached
      if left > 0 and budget > 0:
        n = min(left, chunk, budget)
        chunks.append((req, n))
        budget -= n
    return chunks

  def _decode_batch(self) -> list[Request]:
    """The running requests with a token to decode: prompt done, an output, not
    finished (`_is_finished`, inlined: O(batch) Python every step)."""
    out = []
    for r in self.running:
      o = r.output
      if r.num_cached < r.prefill_target or not o or r.stop_reason:
        continue
      if len(o) >= r.max_new_tokens:
        r.stop_reason = "length"
      elif r.stop_ids and o[-1] in r.stop_ids:
        r.stop_reason = "stop_token"
      else:
        out.append(r)
    return out

  def _forward(self) -> None:
    """ONE forward pass: a decode token of every running sequence whose prompt is
    done, and the next prompt chunks under the budget, in one mixed batch."""
    decodes, chunks = self._decode_batch(), self._prefill_chunks()
    if not decodes and not chunks:
      return
    # Blocks this step may need: decodes whose tail block is full, and the blocks
    # the chunks spill into (shared tails may need one more: the retry below).
    bs = self._bs
    need = (sum(1 for r in decodes if r.num_cached % bs == 0)
            + sum(_cdiv(r.num_cached + n, bs) - _cdiv(r.num_cached, bs) for r, n in chunks))
    if not self._ensure_free(need):
      self._relieve_pressure(need - self.pool.num_free_blocks)
      decodes, chunks = self._decode_batch(), self._prefill_chunks()
      if not decodes and not chunks:
        return
    # Decode rows first (tpu-inference's convention); blocks go to rows in this order.
    plan = self._plan(decodes, chunks)
    num_rows = len(decodes) + len(chunks)
    # The reservation the step makes on the device, decided on the host mirror first
    # (the same algorithm on the same state): the host needs nothing back but tokens.
    pred = self.pool.predict_step(plan.seq_ids, plan.num_new,
                                  max_new_tokens=plan.max_query_len)
    try:
      state, nxt, dev_status, *extra = self.executor.step(pred.state, plan)
    except BaseException as exc:
      # Raised after the donation: the executor's new state (else the old one stands).
      self.pool.abandon_step(attached_state(exc))
      raise
    try:
      if isinstance(nxt, jax.Array):  # sampled tokens: the one read a model step needs
        nxt = np.asarray(nxt)
        self.pool.runtime.read("tokens")
      nxt = np.asarray(nxt).reshape(-1)
      dev_status = (dev_status.reshape(-1) if isinstance(dev_status, jax.Array)
                    else np.asarray(dev_status).reshape(-1))
      if nxt.shape[0] < num_rows or dev_status.shape[0] < num_rows:
        raise InvalidArgument(f"executor returned {nxt.shape[0]} tokens / "
                              f"{dev_status.shape[0]} statuses for {num_rows} rows")
      self.pool.adopt_step(state, pred, device_status=dev_status)
      logprobs = self._read_logprobs(extra, decodes, chunks)
    except BaseException:
      if not pred.adopted:  # the pool never took the step's state: hand it over
        self.pool.abandon_step(state)
      raise
    status = pred.status
    self._now = self.clock()  # the tokens of this pass exist from now
    failed = 0
    bad = (status[:len(decodes)] != Status.OK).tolist()
    tokens = nxt[:len(decodes)].tolist()
    now, itl, stream = self._now, self._itl_now, self._tokens_now
    for i, (req, is_bad, token) in enumerate(zip(decodes, bad, tokens)):
      if is_bad:
        self._record_failure(req, int(status[i]), req.num_cached + 1)
        failed += 1
        continue
      req.num_cached += 1
      if req.forced_output is not None or req.first_token_step < 0:
        self._emit(req, token)
      else:  # `_emit`'s common case, inlined (O(batch) Python every step)
        req.output.append(token)
        stream.append((req.request_id, token))
        itl.append(now - req.last_token_time)
        req.last_token_time = now
    self.stats.decode_tokens += len(decodes) - failed
    for i, (req, n) in enumerate(chunks, start=len(decodes)):
      if status[i] != Status.OK:
        self._record_failure(req, int(status[i]), req.num_cached + n)
        failed += 1
        continue
      req.num_cached += n
      self.stats.prefill_tokens += n
      if req.num_cached == req.prefill_target and not req.output:
        self._emit(req, int(nxt[i]))
    if logprobs is not None:
      self._record_logprobs(logprobs, decodes, chunks)
    if failed:
      self._relieve_pressure(failed)

  def _read_logprobs(self, extra: list, decodes: list[Request],
                     chunks: list[tuple[Request, int]]) -> tuple | None:
    """The step's `SampleOutput` on the host when a row asked for logprobs (one more
    read of this step's results, counted with the tokens), else None."""
    if not extra or not self.config.max_logprobs:
      return None
    if not any(r.sampling is not None and r.sampling.logprobs
               for r in (*decodes, *(r for r, _ in chunks))):
      return None
    out = extra[0]
    self.pool.runtime.read("tokens")
    return (np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs))

  def _record_logprobs(self, logprobs: tuple, decodes: list[Request],
                       chunks: list[tuple[Request, int]]) -> None:
    """Appends each emitted token's logprobs to its request (those that asked)."""
    chosen, top_ids, top_lps = logprobs
    rows = [(i, r) for i, r in enumerate(decodes)] + [
        (i, r) for i, (r, _) in enumerate(chunks, start=len(decodes))]
    for i, r in rows:
      sp = r.sampling
      if sp is None or not sp.logprobs or len(r.logprobs) >= len(r.output):
        continue  # nothing asked, or no token emitted for it in this step
      n = sp.logprobs
      r.logprobs.append((float(chosen[i]), tuple(zip(top_ids[i, :n].tolist(),
                                                     top_lps[i, :n].tolist()))))

  def _plan(self, decodes: list[Request], chunks: list[tuple[Request, int]]) -> StepPlan:
    """`StepPlan.build` of the step's rows (decodes, then chunks), from arrays.

    The same plan, without `build`'s per-row checks (the rows are running
    requests' with 1..`prefill_chunk` tokens each) and per-row array copies.
    """
    nd, num_rows = len(decodes), self.config.max_batch
    ids = np.full((num_rows,), -1, np.int32)
    num_new = np.zeros((num_rows,), np.int32)
    ids[:nd] = [r.seq_id for r in decodes]
    num_new[:nd] = 1
    ids[nd:nd + len(chunks)] = [r.seq_id for r, _ in chunks]
    num_new[nd:nd + len(chunks)] = [n for _, n in chunks]
    total = nd + sum(n for _, n in chunks)
    tokens = np.zeros((ragged.bucket(total),), np.int32)  # the width StepPlan.build pads to
    tokens[:nd] = [r.output[-1] for r in decodes]
    pos = nd
    for r, n in chunks:
      a = r.num_cached
      tokens[pos:pos + n] = (r.prompt[a:a + n] if a + n <= r.prompt.size
                             else r.tokens[a:a + n])
      pos += n
    sampling = None
    if getattr(self.executor, "samples", False):
      sampling = self._sampling_batch(decodes, chunks)
    return StepPlan(seq_ids=ids, num_new=num_new, tokens=tokens,
                    max_query_len=self.config.prefill_chunk if chunks else 1,
                    sampling=sampling, num_logprobs=self.config.max_logprobs)

  def _sampling_batch(self, decodes: list[Request],
                      chunks: list[tuple[Request, int]]) -> SamplingBatch:
    """The rows' sampling parameters (decodes, then chunks; padding rows greedy)."""
    batch = SamplingBatch.greedy(self.config.max_batch)
    rows = decodes + [r for r, _ in chunks]
    for i, r in enumerate(rows):
      sp = r.sampling
      if sp is not None and not sp.greedy:
        batch.temperature[i], batch.top_k[i], batch.top_p[i] = sp.temperature, sp.top_k, sp.top_p
        batch.min_p[i], batch.seed[i], batch.index[i] = sp.min_p, r.sample_seed, len(r.output)
    return batch

  def _record_failure(self, req: Request, status: int, seq_len: int) -> None:
    """Counts a failed reservation; a full segment table ends the request (no retry helps)."""
    self.counters.record_status(np.array([status]), [seq_len])
    if status == Status.TABLE_FULL:
      req.stop_reason = "table_full"

  def _emit(self, req: Request, token: int) -> None:
    if req.forced_output is not None:
      token = int(req.forced_output[len(req.output)])
    req.output.append(token)
    self._tokens_now.append((req.request_id, token))
    now = self._now
    if req.first_token_step < 0:
      req.first_token_step = self._step
      req.first_token_time = now
      self._ttft_now.append(now - req.submit_time)
    else:
      self._itl_now.append(now - req.last_token_time)
    req.last_token_time = now

  def _is_finished(self, req: Request) -> bool:
    if not req.stop_reason:
      if len(req.output) >= req.max_new_tokens:
        req.stop_reason = "length"
      elif req.stop_ids and req.output and req.output[-1] in req.stop_ids:
        req.stop_reason = "stop_token"
    return bool(req.stop_reason)

  def _relieve_pressure(self, blocks: int) -> None:
    """Evict cached blocks, then preempt the most recently admitted sequences."""
    blocks = max(blocks, 1)
    if self._evict(blocks) >= blocks:
      return
    while self.pool.num_free_blocks < blocks and len(self.running) > 1:
      self._preempt(self.running[-1])
      # A recomputed victim's blocks went into the cache: evict them, unlocked now.
      self._evict(blocks - self.pool.num_free_blocks)

  def _preempt(self, req: Request) -> None:
    # The request leaves `running` only once its row is handled (swap_out or
    # insert + release succeeded): an exception before leaves it running.
    if self.config.preemption == "swap" and req.output:
      swapped = swap_out(self.pool, req.seq_id)
      self.running.remove(req)
      req.swapped = swapped
      self.stats.preemptions_swap += 1
      self.stats.swap_to_host_bytes += swapped.nbytes
      req.phase = Phase.SWAPPED
      self.swapped.append(req)
    else:
      self._store_and_release(req)
      self.running.remove(req)
      self.stats.preemptions_recompute += 1
      req.num_cached = 0
      req.phase = Phase.WAITING
      self.waiting.appendleft(req)
    self.stats.preemptions += 1
    req.num_preemptions += 1
    node, req.lock_node, req.seq_id = req.lock_node, None, None
    if node is not None:
      self.cached_pool.unlock(node)

  # ------------------------------------------------------------------ 4. finish
  def _store_and_release(self, req: Request) -> None:
    """Inserts the sequence's cached tokens into the cache, then releases it.

    With `pack_tails`, the new cache leaf's short segments (partial tail blocks)
    are then packed into slotted blocks, and the cache rebinds to their new place.
    """
    pack = ()
    if self._caching and req.num_cached > 0:
      # The CachedPool reads the segments from the pool; the tree's increfs and the
      # release go in one device call.
      outcome = self.cached_pool.insert(req.namespace, req.tokens[:req.num_cached], req.seq_id,
                                        release=True)
      pack = outcome.pack
    else:
      self.cached_pool.release([req.seq_id])
    if pack:
      self._pack(pack)

  def _store_and_release_many(self, reqs: list[Request]) -> None:
    """`_store_and_release` of several requests: one segment read, one device call for
    the cache's references and the release of every row, one packing pass."""
    if len(reqs) == 1:
      return self._store_and_release(reqs[0])
    pack = []
    entries = [(r.namespace, r.tokens[:r.num_cached], r.seq_id) for r in reqs
               if r.num_cached > 0] if self._caching else []
    # The CachedPool reads the segments from the pool; the tree's increfs and the
    # release go in one device call.
    for outcome in self.cached_pool.insert_and_release(entries, [r.seq_id for r in reqs]):
      pack.extend(outcome.pack)
    if pack:
      self._pack(pack)

  def _pack(self, candidates) -> None:
    if self._step - self._last_reclaim >= RECLAIM_EVERY:
      # Slots of segments that left slotted blocks become reusable (checked
      # against ref_count: every holder, tables and cache, is accounted for).
      self.cached_pool.reclaim_slots()
      self._last_reclaim = self._step
    try:
      # Base-region (promoted, shared) blocks are skipped; the pool moves the
      # tree's references and the cache rewrites its records.
      self.counters.pack_moves += self.cached_pool.pack(candidates)
    except PoolExhausted:
      pass  # nowhere to pack now (atomic: nothing changed); the tails stay as they are

  def _finish(self) -> None:
    done = [r for r in self.running if r.stop_reason or len(r.output) >= r.max_new_tokens
            or (r.stop_ids and r.output and r.output[-1] in r.stop_ids)]
    for r in done:
      self._is_finished(r)  # names the stop reason
    if not done:
      return
    self._store_and_release_many(done)  # the requests stay running until this succeeded
    gone = {id(r) for r in done}
    self.running[:] = [r for r in self.running if id(r) not in gone]
    nodes = []
    for req in done:
      node, req.lock_node, req.seq_id = req.lock_node, None, None
      self._mark_finished(req)
      if node is not None:
        nodes.append(node)
    for node in nodes:  # (an exception here: the step's recovery rebuilds the lock counts)
      self.cached_pool.unlock(node)

  def _mark_finished(self, req: Request) -> None:
    if self._live.get(req.request_id) is req:
      del self._live[req.request_id]
    req.phase = Phase.FINISHED
    req.finish_step = self._step
    req.finish_time = self._now
    self.finished.append(req)
    self._finished_now.append(req)
    self.stats.finished += 1

  # ------------------------------------------------------------------ 5. compaction
  def _maybe_compact(self) -> None:
    policy = self.config.compaction
    if policy is None or self._shrink is not None:  # a shrink's moves compact downwards
      return
    # The latest cheap figures (no extra device reduction); without them, the ratio now.
    ratio = (self.last_stats.fragmentation_ratio if self.last_stats is not None
             else metrics.step_stats_host(self.pool.host, self.pool.config).fragmentation_ratio)
    if not policy.should_compact(ratio):
      return
    t0 = time.perf_counter()
    # The policy's byte budget (a share of a step's time at the copy bandwidth), in
    # moves of this pool's blocks.
    src, dst = self.pool.plan(policy)
    num_moves = int(np.sum(src >= 0))
    if num_moves == 0:
      return
    self.cached_pool.move_blocks(src, dst)  # tables and the cache follow the remap
    self.counters.record_compaction(num_moves, time.perf_counter() - t0)
    self.stats.compactions += 1

  def _maybe_promote(self) -> None:
    """Moves widely shared blocks (system prompts) into the base pool."""
    cfg = self.config
    if (not cfg.promote_readers or not self.pool.config.num_base_blocks
        or self._step % cfg.promote_every):
      return
    remap = self.cached_pool.promote(cfg.promote_readers)  # the cache follows the remap
    moved = int(np.sum(remap != np.arange(remap.shape[0])))
    if moved:
      self.counters.promotions += moved

  # ------------------------------------------------------------------ 5b. shrink
  # The pending shrink and the latest one (class defaults; set per instance).
  _shrink: regions.ShrinkProgress | None = None
  _shrink_policy: compact.CompactionPolicy | None = None
  last_shrink: regions.ShrinkProgress | None = None

  def shrink_to(self, num_blocks: int, policy: compact.CompactionPolicy | None = None, *,
                block_bytes: int | None = None, evict_cached: bool = True,
                margin: int | None = None, staging: str = "auto") -> regions.ShrinkProgress:
    """Gives memory back while serving: the pool ends with `num_blocks` blocks.

    Sets a target; from the next step on, each step (after compaction) moves up
    to `policy.max_moves(block_bytes)` referenced blocks above the target into
    the lowest free blocks below it (`regions.plan_shrink`; tables and the
    prefix cache follow the remap), and once no block above it is referenced
    the pool is cut to `num_blocks`, once, and the executor follows
    (`executor.resize(config)`). Requests keep running and are never held back:
    allocation takes the lowest free blocks, so nothing new lands above the
    target while a block below it is free. When the room below is short of the
    blocks still above plus `margin`, cached-only blocks are evicted (with
    `evict_cached`); when live data needs the room (the target is too tight for
    the load of the moment), the shrink waits, moving what it can, and never
    drops data. Compaction pauses while the shrink is pending (the shrink's
    moves compact toward low addresses) and resumes after the cut or
    `cancel_shrink`. Progress: the returned record
    (`shrink_status`, updated every step) and `stats.shrink_*`. The work runs
    in `step()`; `run()` returns at once on an idle scheduler, so an idle one
    finishes its shrink by calling `step()` (each call moves one budget).

    Args:
      num_blocks: pool size after the cut: an int above the base pool and
        below the current size.
      policy: the byte budget per step (default: the scheduler's compaction
        policy, else `CompactionPolicy()`: 2% of a 20 ms step at 4.3 TB/s).
      block_bytes: bytes per block the budget counts (default the pool's
        `block_bytes`; a simulation with small pages passes the modelled model's).
      evict_cached: evict cached-only blocks when the room below is short.
      margin: free blocks to keep below the target beyond what the moves need,
        so a step's allocations find room there (default `max_batch` + the
        prefill budget's blocks).
      staging: how the cut resizes the pages (`BlockPool.resize`): `"host"`
        holds at most the old pool plus one layer of K on the device (the kept
        pages go through host memory), `"device"` builds the new pages beside
        the old ones (fast, both pools at once), `"auto"` stages only when the
        device lacks room for both. The cut's `ResizeReport` lands in the
        returned record's `cut`.

    Returns:
      The shrink's `regions.ShrinkProgress` (the scheduler updates it).

    Raises:
      InvalidArgument: a shrink is pending, `num_blocks` is not an int in
        `(num_base_blocks, num_blocks)`, a bad `policy`/`block_bytes`/`margin`/`staging`,
        or an executor that holds the pool config without `resize`.
      PoolExhausted: the target cannot hold the live sequences' blocks (or,
        without `evict_cached`, everything referenced now), or a submitted
        request could not run in a pool of that size (`reason="no_free_block"`).
      SchedulerBroken: the scheduler refuses further use.
      Nothing changed when it raises. Anything else raised while it makes room
      (an interrupted eviction) is raised after the scheduler was reconciled as
      `step()` reconciles; no shrink is pending then.
    """
    self._check_usable()
    pc = self.pool.config
    if self._shrink is not None:
      raise InvalidArgument(f"a shrink to {self._shrink.target} blocks is pending; "
                            f"cancel_shrink() first")
    if not _is_int(num_blocks) or not pc.num_base_blocks < num_blocks < pc.num_blocks:
      raise InvalidArgument(f"num_blocks must be an int in ({pc.num_base_blocks}, "
                            f"{pc.num_blocks}) (above the base pool, below the pool's "
                            f"size), got {num_blocks!r}")
    num_blocks = int(num_blocks)
    if policy is None:
      policy = self.config.compaction or compact.CompactionPolicy()
    elif not isinstance(policy, compact.CompactionPolicy):
      raise InvalidArgument(f"policy must be a CompactionPolicy or None, got "
                            f"{type(policy).__name__}")
    if block_bytes is None:
      block_bytes = pc.block_bytes
    elif not _is_int(block_bytes) or block_bytes < 1:
      raise InvalidArgument(f"block_bytes must be a positive int, got {block_bytes!r}")
    if margin is None:
      margin = self.config.max_batch + _cdiv(self.config.prefill_token_budget, self._bs)
    elif not _is_int(margin) or margin < 0:
      raise InvalidArgument(f"margin must be an int >= 0, got {margin!r}")
    if not isinstance(evict_cached, (bool, np.bool_)):
      raise InvalidArgument(f"evict_cached must be a bool, got {evict_cached!r}")
    if not isinstance(staging, str) or staging not in resize_lib.STAGINGS:
      raise InvalidArgument(f"staging must be one of {resize_lib.STAGINGS}, got {staging!r}")
    if (not callable(getattr(self.executor, "resize", None))
        and isinstance(getattr(self.executor, "config", None), PoolConfig)):
      raise InvalidArgument(f"{type(self.executor).__name__} holds the pool config but has no "
                            f"resize(config): it could not follow the cut")
    dynamic = num_blocks - pc.num_base_blocks
    live, cached = self.pool.host.block_usage()
    if live > dynamic or (not evict_cached and live + cached > dynamic):
      held = live if live > dynamic else live + cached
      raise PoolExhausted(f"cannot shrink to {num_blocks} blocks: {dynamic} dynamic blocks "
                          f"would hold {held} referenced now", reason="no_free_block")
    need = self._largest_need()
    if need > dynamic:
      raise PoolExhausted(f"cannot shrink to {num_blocks} blocks: a submitted request needs "
                          f"up to {need} of its {dynamic} dynamic blocks", reason="no_free_block")
    held_above, _ = self._shrink_progress(num_blocks)
    max_moves = max(1, min(policy.max_moves(int(block_bytes)), pc.num_blocks // 2))
    progress = regions.ShrinkProgress(
        target=num_blocks, start_blocks=pc.num_blocks, start_step=self._step,
        max_moves=max_moves, block_bytes=int(block_bytes), margin=int(margin),
        evict_cached=bool(evict_cached), held_at_start=held_above, held_above=held_above,
        staging=staging)
    previous = self.last_shrink
    self._shrink_policy = policy
    self._shrink = self.last_shrink = progress
    # Room below the target now, so the next step's allocations already land there.
    t0 = time.perf_counter()
    try:
      progress.held_above, _ = self._make_room(progress, *self._shrink_progress(num_blocks))
    except BaseException as exc:
      # Interrupted (the eviction can be, between the cache's side and the pool's):
      # reconcile as `step()` does, and register no shrink (evictions done stay).
      self._shrink, self.last_shrink = None, previous
      self._recover(exc)
      raise
    progress.move_seconds += time.perf_counter() - t0
    return progress

  @property
  def shrink_status(self) -> regions.ShrinkProgress | None:
    """The pending shrink's progress, else the latest shrink's (None: never shrunk)."""
    return self.last_shrink

  def cancel_shrink(self) -> regions.ShrinkProgress | None:
    """Ends a pending shrink without cutting (moves done stay; compaction resumes)."""
    s = self._shrink
    if s is not None:
      s.cancelled = True
      self._end_shrink()
    return s

  def _end_shrink(self) -> None:
    self._shrink = None

  def _largest_need(self) -> int:
    """The most blocks any unfinished request may need alone in the pool (as `submit`)."""
    bs, wm = self._bs, self.config.watermark_blocks
    reqs = list(self.waiting) + list(self.swapped) + self.running
    return max((_cdiv(r.prompt.size, bs) + _cdiv(r.max_new_tokens, bs) + 2 + wm for r in reqs),
               default=0)

  def _maybe_shrink(self) -> None:
    """One step of the pending shrink: budgeted moves below the target, then the cut."""
    s = self._shrink
    if s is None:
      return
    t0 = time.perf_counter()
    s.steps += 1
    self.stats.shrink_steps += 1
    held, free_below = self._shrink_progress(s.target)
    s.spilled_blocks += max(0, held - s.held_above)  # allocations that found no room below
    held, free_below = self._make_room(s, held, free_below)
    moved = 0
    if held:
      src, dst = host_ops.plan_shrink(self.pool.host, s.target, budget=s.max_moves)
      moved = int(np.sum(src >= 0))
      if moved:
        self.cached_pool.move_blocks(src, dst)  # tables and the cache follow the remap
        held -= moved
        s.moves += moved
        self.stats.shrink_moves += moved
        self.stats.shrink_bytes_moved += moved * s.block_bytes
        s.max_step_share = max(s.max_step_share,
                               self._shrink_policy.step_time_share(moved, s.block_bytes))
      else:
        s.wait_steps += 1
    s.last_moves, s.held_above = moved, held
    if held == 0:
      if self._largest_need() <= s.target - self.pool.config.num_base_blocks:
        self._cut(s)
      else:
        s.wait_steps += 1  # a request submitted since needs the bigger pool: it runs first
    s.move_seconds += time.perf_counter() - t0

  def _shrink_progress(self, target: int) -> tuple[int, int]:
    """`(held_above, free_below)` of `target` (one reduction, two scalars to the host)."""
    return host_ops.shrink_progress(self.pool.host, target)

  def _make_room(self, s: regions.ShrinkProgress, held: int, free_below: int) -> tuple[int, int]:
    """Evicts cached-only blocks until the room below the target holds what is above
    plus the margin (as far as the cache allows); returns the new `(held, free_below)`."""
    short = held + s.margin - free_below
    if short <= 0 or not s.evict_cached or not self._caching:
      return held, free_below
    freed = self._evict(short)
    if not freed:
      return held, free_below
    s.evicted_blocks += freed
    self.stats.shrink_evicted_blocks += freed
    return self._shrink_progress(s.target)

  def _cut(self, s: regions.ShrinkProgress) -> None:
    """Cuts the (free) tail above the target; the executor and the quota follow."""
    old = self.pool.config.num_blocks
    compiles = counters.backend_compiles()  # the cut's own: the resize and the re-warm
    # Refuses (nothing changed) if the tail is referenced.
    report = self.cached_pool.resize(s.target, staging=s.staging)
    resize = getattr(self.executor, "resize", None)
    if callable(resize):
      try:
        resize(self.pool.config)
      except BaseException:
        # The cut blocks were free: growing back restores them.
        self.cached_pool.resize(old, staging=s.staging)
        raise
    s.cut = report
    if self._quota is not None:
      self._quota.total_blocks = s.target - self.pool.config.num_base_blocks
      self._quota.borrowed = min(self._quota.borrowed, self._quota.cached_quota)
    if self.warmup_report is not None:
      # The programs of the old size are dead: release them, and compile the new
      # size's set now (a warm-up of the new config, not counted after warm-up).
      warmup_lib.release_programs()
      warmup_lib.warm(self, progress=False, persistence=self._warm_persistence)
      cut = counters.backend_compiles() - compiles
      self.stats.rewarm_compiles += cut
      self._compiles_at_warmup += cut
    s.done_step = self._step
    self.stats.shrinks += 1
    self.stats.shrink_blocks_returned += old - s.target
    self._end_shrink()

  # ------------------------------------------------------------------ 6. metrics
  def extra_segments(self) -> Segments:
    """`i32[n, 3]` `(block, start, length)` references the cache holds (for metrics)."""
    return self.cached_pool.segment_refs()

  def take_stats(self) -> metrics.StepStats:
    """The cheap pool figures now, from the pool's host mirror (not recorded).

    `last_stats` holds those of the latest step's start; this is the pool as
    it is, e.g. after `run()` drained the queue.
    """
    self._check_usable()
    return metrics.step_stats_host(self.pool.host, self.pool.config, counters=self.counters)

  def take_snapshot(self) -> metrics.PoolSnapshot:
    """The full pool snapshot now, from the pool's host mirror (O(num_blocks) host
    work; not recorded)."""
    self._check_usable()
    return metrics.snapshot(self.pool.host, self.pool.config,
                            extra_segments=self.extra_segments(), counters=self.counters)

  def _observe_alerts(self, figures) -> None:
    fired = self._monitor.observe(figures)
    self.alerts.extend(fired)
    self._alerts_now.extend(fired)

  def _snapshot(self, step_id: int) -> metrics.PoolSnapshot:
    snap = metrics.snapshot(self.pool.host, self.pool.config,
                            extra_segments=self.extra_segments(), counters=self.counters)
    self.snapshots.append(snap)
    self._observe_alerts(snap)
    if self._on_snapshot is not None:
      self._on_snapshot(step_id, snap, self.stats)
    return snap

  def check_invariants(self) -> None:
    """The pool's invariants with the cache's references included.

    Raises:
      InvariantViolation: a violation. SchedulerBroken: the scheduler is unusable.
    """
    self._check_usable()
    self.cached_pool.check_invariants()
