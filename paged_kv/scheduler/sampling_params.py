"""`SamplingParams`: how a request's tokens are drawn (`Request(sampling=...)`).

Applied inside the jitted step, batched (`paged_kv.model.sampling`). The fields carry
vLLM's names and meanings, but `temperature` defaults to 0 (greedy, bit-equal to a
scheduler without sampling), where vLLM's is 1. A seeded request draws the same
tokens whatever shares its batches; one without a seed gets `SchedulerConfig.seed`
plus its submit order, so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


from paged_kv.core import fields
from paged_kv.core.errors import InvalidArgument

__all__ = ["MAX_LOGIT_ADJUSTMENTS", "SamplingParams"]

MAX_SEED = 2**32 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a bias: [-100, 100]
# Per request: `logit_bias` entries, plus the stop ids `min_tokens` holds back while
# it applies (the width of `paged_kv.model.sampling.SamplingBatch.adjust_ids`).
MAX_LOGIT_ADJUSTMENTS = 16

_OWN = "SamplingParams"


def _check_logit_bias(value: Any) -> dict[int, float] | None:
  """`value` as `{token id: bias}` (ids as ints or decimal strings, as JSON carries them)."""
  if value is None:
    return None
  items = value.items() if isinstance(value, Mapping) else None
  if items is None:
    raise InvalidArgument(f"{_OWN}.logit_bias must be a mapping of token id to bias in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] or None, got {value!r}")
  out: dict[int, float] = {}
  for key, bias in items:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
      key = int(key)
    token = fields.check_int(_OWN, "logit_bias key", key)
    out[token] = fields.check_number(_OWN, f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS,
                                     MAX_LOGIT_BIAS)
  if len(out) > MAX_LOGIT_ADJUSTMENTS:
    raise InvalidArgument(f"{_OWN}.logit_bias has {len(out)} entries; at most "
                          f"{MAX_LOGIT_ADJUSTMENTS} are applied in the step")
  return out or None


def _check_stop(value: Any) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    value = (value,)
  if isinstance(value, bytes) or not hasattr(value, "__iter__"):
    raise InvalidArgument(f"{_OWN}.stop must be a str, a sequence of str or None, got "
                          f"{value!r}")
  out = tuple(value)
  for s in out:
    if not isinstance(s, str) or not s:
      raise InvalidArgument(f"{_OWN}.stop must hold non-empty strings, got {s!r}")
  return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling (checked when built: `InvalidArgument` naming the field).

  Attributes:
    temperature: 0 = greedy (the argmax); > 0 divides the logits.
    top_k: keep the `k` most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens reaching `top_p` (1: all).
    min_p: keep tokens at least `min_p` times as likely as the most likely (0: all).
    seed: the request's seed (None: the scheduler assigns one).
    stop_token_ids: tokens that end the request, besides `SchedulerConfig.stop_token`.
    logprobs: each token's logprob and the top-`logprobs` (at most `max_logprobs`).
    presence_penalty: in [-2, 2], subtracted from the logit of every token in the output.
    frequency_penalty: in [-2, 2], times a token's count in the output, subtracted.
    repetition_penalty: > 0; divides a positive logit of a token in the prompt or
      output, multiplies a negative one (1: off). The penalties need an executor
      that keeps token histories; a penalized request shares no cached prefix.
    min_tokens: the stop tokens cannot be sampled before the output has this many.
    logit_bias: `{token id: bias in [-100, 100]}` added to the logits (greedy too);
      ids as ints or decimal strings; with the stop ids `min_tokens` holds back, at
      most `MAX_LOGIT_ADJUSTMENTS`.
    ignore_eos: `SchedulerConfig.stop_token` does not end this request.
    prompt_logprobs: logprobs of the prompt's tokens (vLLM's); None: none.
    stop: strings that end the request when its text holds one (`stop_strings`).
    n: output sequences per prompt (`parallel_sampling`).

  The step applies them in vLLM's order: `min_tokens`, `logit_bias`, the penalties,
  then greedy or the temperature and filters; logprobs are of the raw logits.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  logprobs: int = 0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  logit_bias: dict[int, float] | None = None
  ignore_eos: bool = False
  prompt_logprobs: int | None = None
  stop: tuple[str, ...] = ()
  n: int = 1

  def __post_init__(self):
    own = _OWN
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
    put("presence_penalty", fields.check_number(own, "presence_penalty",
                                                self.presence_penalty, -2.0, 2.0))
    put("frequency_penalty", fields.check_number(own, "frequency_penalty",
                                                 self.frequency_penalty, -2.0, 2.0))
    put("repetition_penalty", fields.check_number(own, "repetition_penalty",
                                                  self.repetition_penalty, 0.0, 1e6,
                                                  low_open=True))
    put("min_tokens", fields.check_int(own, "min_tokens", self.min_tokens, 0))
    put("logit_bias", _check_logit_bias(self.logit_bias))
    put("ignore_eos", fields.check_bool(own, "ignore_eos", self.ignore_eos))
    put("prompt_logprobs", fields.check_int(own, "prompt_logprobs", self.prompt_logprobs, 0,
                                            1024, optional=True))
    put("stop", _check_stop(self.stop))
    put("n", fields.check_int(own, "n", self.n, 1, 1024))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def penalized(self) -> bool:
    """Whether any of the presence, frequency and repetition penalties is on."""
    return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0)

  def adjustments(self, stop_ids) -> tuple[list[int], list[float]]:
    """`(ids, values)` the step adds to the logits: the `logit_bias` entries, then
    `-inf` for each of `stop_ids` when `min_tokens > 0` (applied until then)."""
    ids, vals = [], []
    if self.logit_bias:
      ids += list(self.logit_bias)
      vals += list(self.logit_bias.values())
    if self.min_tokens > 0:
      bans = sorted(int(t) for t in stop_ids)
      ids += bans
      vals += [-math.inf] * len(bans)
    return ids, vals
