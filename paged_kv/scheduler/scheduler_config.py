"""`SchedulerConfig`: the scheduling and memory policies of a `Scheduler`."""

from __future__ import annotations

import dataclasses

from paged_kv.core import compact, fields
from paged_kv.core.errors import InvalidArgument
from paged_kv.cache.governance import CacheGovernance
from radix.cache import POLICIES

PREEMPTION_MODES = ("recompute", "swap")


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
    mix_namespaces: let packing put different namespaces' tails in one block (more
      blocks saved; `CachedPool`'s `mix_namespaces` says the risk). Default: a block
      holds one namespace's tokens only.
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
      (`paged_kv.cache.governance`; None: plain eviction on demand).
    max_logprobs: the most top logprobs a request may ask for
      (`SamplingParams.logprobs`); the step computes this many for every row of a
      sampling executor (a static width: one program), 0 = none.
    seed: the seeds of requests without one: `seed` + their submit order.
    max_seq_len: the longest sequence a request may ask for (prompt +
      `max_new_tokens`), e.g. a checkpoint's context length
      (`hf_checkpoint.HFCheckpoint.max_seq_len`): `submit` refuses a longer one.
      None: only the pool bounds it.
    overlap: plan and dispatch step t+1 before reading step t's sampled tokens,
      which stay on the device and feed step t+1 (`paged_kv.model.plan.CarriedTokens`);
      the host reads step t's tokens while t+1 runs. Outputs equal the
      synchronous loop's (`overlap=False`); a stop is seen one step late and the
      token produced past it is dropped (never streamed, never cached).
    decode_steps: the most decode steps one dispatch may run (k): when a step has
      no prompt chunk and nothing waits for admission, an executor with
      `decode_steps` runs k steps in one call (allocation inside the jitted
      step). Bounds how late a stop is seen and how tokens are grouped when
      streamed; 1 = one step per dispatch. Tokens equal k = 1's.
    min_mixed_width: the fewest tokens a mixed (prompt chunk + decode) step program
      takes; a smaller step is padded to it (`batching.token_widths`). Each width is
      one more program to compile, and below a few hundred tokens a step's cost on a
      GPU is the weights' read, which padding does not add to; on a CPU a padded
      token costs its compute. 16: the finest widths (halves down to `max_batch`).
    max_stalled_steps: steps in a row with requests to serve that compute no token
      and finish none before `step()` raises `SchedulerStalled` naming what holds
      the pool (`paged_kv.scheduler.progress`; 0: never). The scheduler's rules make
      such a run a bug, never load: the guard turns it into a typed error.
  """

  max_batch: int = 32
  prefill_token_budget: int = 512
  prefill_chunk: int = 128
  preemption: str = "recompute"
  enable_prefix_cache: bool = True
  evict_policy: str = "lru"
  pack_tails: bool = False
  mix_namespaces: bool = False
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
  max_seq_len: int | None = None
  overlap: bool = True
  decode_steps: int = 1
  min_mixed_width: int = 64
  max_stalled_steps: int = 256

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
                            ("seed", 0, fields.I32_MAX), ("decode_steps", 1, 1024),
                            ("max_stalled_steps", 0, fields.I32_MAX),
                            ("min_mixed_width", 1, fields.I32_MAX)):
      put(name, fields.check_int(own, name, getattr(self, name), low, high))
    put("max_seq_len", fields.check_int(own, "max_seq_len", self.max_seq_len, 1, optional=True))
    put("preemption", fields.check_choice(own, "preemption", self.preemption, PREEMPTION_MODES))
    put("evict_policy", fields.check_choice(own, "evict_policy", self.evict_policy, POLICIES))
    for name in ("enable_prefix_cache", "pack_tails", "overlap", "mix_namespaces"):
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


  def check_pool(self, pool_config) -> None:
    """The bounds that depend on the pool (`PoolConfig`), checked when a `Scheduler`
    is built.

    Raises:
      InvalidArgument: `max_batch` above the pool's `max_seqs`, or the watermark not
        below its dynamic blocks.
    """
    pc = pool_config
    if self.max_batch > pc.max_seqs:
      raise InvalidArgument(f"SchedulerConfig.max_batch must be at most the pool's max_seqs "
                            f"({pc.max_seqs}), got {self.max_batch}")
    if self.watermark_blocks >= pc.num_blocks - pc.num_base_blocks:
      raise InvalidArgument(f"SchedulerConfig.watermark_blocks must be below the pool's "
                            f"{pc.num_blocks - pc.num_base_blocks} dynamic blocks, got "
                            f"{self.watermark_blocks}")
