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
  """Scheduling and memory policies (checked when built: `InvalidArgument` naming the field).

  Attributes:
    max_batch: sequences per step (<= the pool's `max_seqs`).
    prefill_token_budget: prompt tokens computed per step, all sequences together.
    prefill_chunk: prompt tokens per sequence per step (static width of a call).
    preemption: `"recompute"` or `"swap"`.
    enable_prefix_cache: match prompts in, and insert finished sequences into, the cache.
    evict_policy: `"lru"` or `"cost"`.
    pack_tails: pack a finished sequence's short tail segments into slotted blocks.
    mix_namespaces: let packing mix namespaces' tails in a block (`CachedPool` says the risk).
    compaction: when and how much to compact between steps (None: never).
    promote_readers: every `promote_every` steps, blocks read by at least this many
      references move into the base pool, where compaction never moves them (0: off).
    promote_every: steps between promotion passes.
    output_reserve_ratio: the share of the running and new sequences' remaining output
      whose blocks admission keeps free: 0 admits on the prompt alone (preemption
      storms under pressure); 1 never preempts when `max_new_tokens` is exact.
    watermark_blocks: free blocks admission leaves beyond that.
    stop_token: end-of-sequence token (-1: none).
    stats_every: steps between the cheap `metrics.StepStats`, from the host mirror at
      the step's start (0: never); compaction's trigger reads the latest.
    stats_budget: a share of the step's host time (e.g. 0.02) the figures may cost,
      taking them less often (`stats_pacing`); None: every `stats_every` steps.
    snapshot_every: steps between full `metrics.PoolSnapshot`s (0: never).
    governance: quotas and the two-phase GC (`paged_kv.cache.governance`; None: off).
    max_logprobs: the most top logprobs a request may ask for; the step computes this
      many for every row of a sampling executor (a static width), 0 = none.
    seed: the seeds of requests without one: `seed` + their submit order.
    max_seq_len: the longest prompt + `max_new_tokens` a request may ask for (e.g. a
      checkpoint's context length); None: only the pool bounds it.
    overlap: dispatch step t+1 before reading step t's tokens, which feed it on the
      device; outputs equal `overlap=False`'s (`docs/serving_loop.md`).
    decode_steps: the most decode steps one dispatch runs when a step has no prompt
      chunk and nothing waits (outputs equal 1's; a stop is seen up to k - 1 late).
    min_mixed_width: the fewest tokens a mixed step program takes; smaller steps are
      padded to it (fewer programs; `batching.token_widths`).
    max_stalled_steps: steps in a row with work that compute no token and finish
      none before `step()` raises `SchedulerStalled` (`progress`; 0: never).
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
    """Checks every field (`paged_kv.core.fields`); the bounds that depend on the pool
    are `check_pool`'s."""
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
    """The bounds that depend on the pool, checked when a `Scheduler` is built:
    `InvalidArgument` unless `max_batch <= max_seqs` and the watermark is below the
    pool's dynamic blocks."""
    pc = pool_config
    if self.max_batch > pc.max_seqs:
      raise InvalidArgument(f"SchedulerConfig.max_batch must be at most the pool's max_seqs "
                            f"({pc.max_seqs}), got {self.max_batch}")
    if self.watermark_blocks >= pc.num_blocks - pc.num_base_blocks:
      raise InvalidArgument(f"SchedulerConfig.watermark_blocks must be below the pool's "
                            f"{pc.num_blocks - pc.num_base_blocks} dynamic blocks, got "
                            f"{self.watermark_blocks}")
