"""`SamplingParams`: how a request's tokens are drawn (`Request(sampling=...)`).

Applied inside the jitted step, batched (`paged_kv.model.sampling`); the default is
greedy, bit-equal to a scheduler without sampling. A request with a seed draws the
same tokens whatever else shares its batches; without one, the scheduler gives it a
seed of its own (`Scheduler(seed=...)`, then submit order), so a run is reproducible.
"""

from __future__ import annotations

import dataclasses

from paged_kv.core import fields
from paged_kv.core.errors import InvalidArgument

__all__ = ["SamplingParams"]

MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling (checked when built: `InvalidArgument` naming the field).

  Attributes:
    temperature: 0 = greedy (the argmax; the other fields but `stop_token_ids` and
      `logprobs` are then unused); > 0 divides the logits.
    top_k: keep the `k` most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches
      `top_p` (1: all).
    min_p: keep tokens at least `min_p` times as likely as the most likely (0: all).
    seed: the request's seed (None: the scheduler assigns one).
    stop_token_ids: tokens that end the request when emitted (`stop_reason
      "stop_token"`), besides `SchedulerConfig.stop_token`.
    logprobs: return the sampled token's logprob and the top-`logprobs` logprobs
      of each step (`Request.logprobs`); at most `SchedulerConfig.max_logprobs`.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  logprobs: int = 0

  def __post_init__(self):
    own = "SamplingParams"
    put = lambda name, value: object.__setattr__(self, name, value)
    put("temperature", fields.check_number(own, "temperature", self.temperature, 0.0, 1e6))
    put("top_k", fields.check_int(own, "top_k", self.top_k, 0))
    put("top_p", fields.check_number(own, "top_p", self.top_p, 0.0, 1.0, low_open=True))
    put("min_p", fields.check_number(own, "min_p", self.min_p, 0.0, 1.0))
    put("seed", fields.check_int(own, "seed", self.seed, 0, MAX_SEED, optional=True))
    put("logprobs", fields.check_int(own, "logprobs", self.logprobs, 0, 1024))
    ids = self.stop_token_ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
      raise InvalidArgument(f"{own}.stop_token_ids must be a sequence of ints in "
                                   f"[0, {fields.I32_MAX}], got {ids!r}")
    put("stop_token_ids", tuple(fields.check_int(own, "stop_token_ids[]", t) for t in ids))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0
