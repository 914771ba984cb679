"""Parallel sampling (`SamplingParams.n > 1`): one prompt computed once, n outputs.

`Scheduler.submit` of a request with `n > 1` queues it (sample 0) and right behind it
`n - 1` requests (`samples_of`) with `n = 1`, ids `SampleId(request_id, i)` and seeds
`seed + i`: each draws what an `n = 1` request with that seed draws, and is a
request of its own from then on.

Admission holds a sample back until its first request has computed `p - 1` prompt
tokens, then opens it on their segments (`fork_prefix`: shared, the partial tail
copied on write); it computes the last prompt token itself, so its first token is
drawn with its own seed by the ordinary prefill. A penalized sample never shares;
`prompt_logprobs` come with the first request only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping

import numpy as np

from paged_kv.core.errors import InvalidArgument
from paged_kv.core.segment_format import take_tokens
from paged_kv.scheduler.request import Phase, Request

__all__ = ["SampleId", "fork_prefix", "held_back", "sample_ids", "samples_of"]


@dataclasses.dataclass(frozen=True)
class SampleId:
  """The request id of sample `index` (in `[1, n)`) of the `n > 1` request whose id is
  `parent` (sample 0 keeps the caller's id); equal only to another `SampleId`."""

  parent: Hashable
  index: int

  def __str__(self) -> str:
    return f"{self.parent}#{self.index}"


def sample_ids(request_id: Hashable, n: int) -> list[Hashable]:
  """The ids of the `n` samples of `request_id`: itself, then `SampleId(request_id, i)`."""
  return [request_id] + [SampleId(request_id, i) for i in range(1, n)]


def samples_of(request: Request, live: Mapping) -> list[Request]:
  """The other `n - 1` samples of `request` (none when `n == 1`), checked, not queued;
  also kept in `request.samples`. `InvalidArgument` (nothing changed) when an
  unfinished request in `live` holds one of their ids."""
  sp = request.sampling
  if sp is None or sp.n == 1:
    return []
  ids = sample_ids(request.request_id, sp.n)[1:]
  taken = [i for i in ids if i in live]
  if taken:
    raise InvalidArgument(f"request {request.request_id!r} has n={sp.n}: the id of its sample "
                          f"{taken[0]!s} is in use by an unfinished request")
  out = []
  for i, rid in enumerate(ids, start=1):
    seed = None if sp.seed is None else (sp.seed + i) % 2**32  # else: assigned in order
    sampling = dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=None)
    sample = Request(rid, request.prompt, request.max_new_tokens, namespace=request.namespace,
                     arrival=request.arrival, forced_output=request.forced_output,
                     sampling=sampling)
    sample.sample_of = request
    out.append(sample)
  request.samples = tuple(out)
  return out


def _first_ready(req: Request) -> Request | None:
  """`req`'s first request when it runs with its prompt's first `p - 1` tokens
  computed, else None."""
  first = req.sample_of
  if first is None or first.phase != Phase.RUNNING or req.sampling.penalized:
    return None
  return first if first.num_cached >= first.prompt.size - 1 else None


def held_back(req: Request) -> bool:
  """Whether admission should skip `req` now: a sample not started yet whose first
  request is still queued or computing its prompt (it forks that row later)."""
  first = req.sample_of
  if first is None or req.output or first.phase == Phase.FINISHED or req.sampling.penalized:
    return False
  return _first_ready(req) is None


def fork_prefix(req: Request, host) -> tuple[np.ndarray, int] | None:
  """`(segments, tokens)` of the first `p - 1` prompt tokens in the row of `req`'s
  first request (from the host mirror `host`), for `req` to open on; None when `req`
  does not fork (not a sample, started already, or its first request not ready)."""
  if req.output:
    return None
  first = _first_ready(req)
  if first is None:
    return None
  count = int(req.prompt.size) - 1
  return take_tokens(host.row_segments(first.seq_id), count), count
