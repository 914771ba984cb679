"""`Scheduler.submit`'s checks of what a request asks against the model and the loop.

Token ids are checked against the executor's `vocab_size` (when it has one): inside
the jitted step an id outside it is no error, just wrong tokens. Sampling the loop
cannot apply is refused by name, not ignored (penalties without token histories,
`prompt_logprobs` without the programs, stop strings without a tokenizer, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paged_kv.core.errors import InvalidArgument
from paged_kv.scheduler.sampling_params import MAX_LOGIT_ADJUSTMENTS
from paged_kv.scheduler.stop_strings import StopStringWatch

if TYPE_CHECKING:
  from paged_kv.scheduler.request import Request
  from paged_kv.scheduler.scheduler import Scheduler

__all__ = ["accept", "check_request", "check_token_ids"]


def _outside(name: str, ids: np.ndarray, vocab_size: int) -> str | None:
  bad = (ids < 0) | (ids >= vocab_size)
  if not bad.any():
    return None
  where = np.flatnonzero(bad)
  return (f"{name} has {where.size} id(s) outside the vocabulary [0, {vocab_size}) "
          f"(e.g. {ids[where[:4]].tolist()} at {where[:4].tolist()})")


def check_token_ids(request: "Request", vocab_size: int | None, *, stop_token: int) -> None:
  """Raises `InvalidArgument` (naming the field and a few ids) unless every id
  `request` brings, and `stop_token`, is in `[0, vocab_size)`; None: no check."""
  if vocab_size is None:
    return
  sp = request.sampling
  fields = [("prompt", np.asarray(request.prompt))]
  if request.forced_output is not None:
    fields.append(("forced_output", np.asarray(request.forced_output)))
  if sp is not None:
    fields.append(("sampling.stop_token_ids", np.asarray(sp.stop_token_ids, np.int64)))
    if sp.logit_bias:
      fields.append(("sampling.logit_bias", np.asarray(sorted(sp.logit_bias), np.int64)))
  for name, ids in fields:
    problem = _outside(name, ids.reshape(-1).astype(np.int64), vocab_size)
    if problem:
      raise InvalidArgument(f"request {request.request_id!r}: {problem}")
  if stop_token >= vocab_size:
    raise InvalidArgument(f"SchedulerConfig.stop_token {stop_token} is outside the model's "
                          f"vocabulary [0, {vocab_size}): it could never end a request")


def check_request(request: "Request", vocab_size: int | None, *, stop_token: int,
                  has_tokenizer: bool, history_len: int | None = None,
                  prompt_logprobs: bool = False) -> None:
  """`check_token_ids`, then the sampling the serving loop cannot apply (module
  docstring). `has_tokenizer`, `history_len` (None: no penalties) and
  `prompt_logprobs` say what the executor can do. Raises `InvalidArgument`."""
  check_token_ids(request, vocab_size, stop_token=stop_token)
  sp = request.sampling
  if sp is None:
    return
  rid = request.request_id
  if sp.penalized:
    _check_penalties(request, history_len)
  if sp.prompt_logprobs is not None and not prompt_logprobs:
    raise InvalidArgument(f"request {rid!r}: sampling.prompt_logprobs needs an executor "
                          f"built to compute them: ModelExecutor(..., prompt_logprobs=True)")
  if sp.stop and not has_tokenizer:
    raise InvalidArgument(f"request {rid!r}: sampling.stop needs the executor's tokenizer "
                          f"to decode text: ModelExecutor(..., tokenizer=)")
  if sp.min_tokens > request.max_new_tokens:
    raise InvalidArgument(f"request {rid!r}: sampling.min_tokens={sp.min_tokens} > "
                          f"max_new_tokens={request.max_new_tokens}")
  if sp.min_tokens > 0:
    stops = set(sp.stop_token_ids)
    if stop_token >= 0 and not sp.ignore_eos:
      stops.add(stop_token)
    ids, _ = sp.adjustments(stops)
    if len(ids) > MAX_LOGIT_ADJUSTMENTS:
      raise InvalidArgument(
          f"request {rid!r}: {len(sp.logit_bias or ())} logit_bias entries and {len(stops)} "
          f"stop ids held back by min_tokens make {len(ids)} logit adjustments; at most "
          f"{MAX_LOGIT_ADJUSTMENTS} fit the step")


def _check_penalties(request: "Request", history_len: int | None) -> None:
  sp, rid = request.sampling, request.request_id
  if history_len is None:
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
      if getattr(sp, name) != default:
        raise InvalidArgument(
            f"request {rid!r}: sampling.{name}={getattr(sp, name)} needs an executor that "
            f"keeps token histories (ModelExecutor with history_len > 0); use {default}")
  longest = request.prompt.size + request.max_new_tokens
  if longest > history_len:
    raise InvalidArgument(
        f"request {rid!r}: a penalized request of {request.prompt.size} prompt + "
        f"{request.max_new_tokens} new tokens = {longest} is longer than the executor's "
        f"token history ({history_len} positions: ModelExecutor(history_len=))")


def accept(request: "Request", sched: "Scheduler") -> None:
  """`Scheduler.submit`'s checks after the request's own: `check_request` against the
  executor, the prompt logprobs limit, `Admission.check_fits`; then stop strings are
  registered. Raises `InvalidArgument` or `PoolExhausted`."""
  executor = sched.executor
  tokenizer = getattr(executor, "tokenizer", None)
  history_len = (getattr(executor, "history_len", None)
                 if getattr(executor, "applies_penalties", False) else None)
  check_request(request, getattr(executor, "vocab_size", None),
                stop_token=sched.config.stop_token, has_tokenizer=tokenizer is not None,
                history_len=history_len,
                prompt_logprobs=bool(getattr(executor, "prompt_logprobs", False)))
  sp, limit = request.sampling, sched.config.max_logprobs
  if sp is not None and sp.prompt_logprobs is not None and sp.prompt_logprobs > limit:
    raise InvalidArgument(f"request {request.request_id!r} asks {sp.prompt_logprobs} prompt "
                          f"logprobs; SchedulerConfig.max_logprobs is {limit}")
  sched.admission.check_fits(request)
  if request.sampling is not None and request.sampling.stop:
    if sched.finishing.stop_strings is None:
      sched.finishing.stop_strings = StopStringWatch(tokenizer)
    sched.finishing.stop_strings.register(request)
