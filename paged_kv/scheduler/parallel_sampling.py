"""Parallel sampling (`SamplingParams.n > 1`): one prompt computed once, n outputs.

`Scheduler.submit` of a request with `n > 1` queues it (sample 0) and, right behind
it, `n - 1` more requests (`samples_of`): the same prompt, budget, namespace and
sampling with `n = 1`, ids `SampleId(request_id, i)`, and seeds `seed + i` (mod
2**32; `seed` is the request's own, or the one the scheduler assigned it: sample i
draws what an `n = 1` request with seed `seed + i` draws). Each sample is a request
of its own from then on: its own output, logprobs, stop reason, preemption, and
`Scheduler.abort(its id)` (aborting the first request leaves the others running; the
`LLM` facade and the server abort them all).

Admission (`paged_kv.scheduler.admission`) holds a sample back (skipping it, FCFS
otherwise unchanged) while its first request is queued or computing its prompt.
Once that request runs with its prompt's first `p - 1` tokens computed (dispatched:
the device orders the sample's step after the writes), the sample opens on the
segments holding them in that request's row (`fork_prefix`: their blocks shared,
each gaining a reference, as `BlockPool.fork` shares them), its partial tail block
copied into a block of its own (`BlockPool.cow_split`: copy-on-write, so its tokens
continue in place and its segment count stays within `submit`'s bound), and it
computes the prompt's last token itself: its first token is drawn from that
position's logits with its own seed, by the ordinary prefill path (one token of
compute per sample; no step program changes). The samples start one step after the
first request's last prompt chunk. In the scheduler's stats a sample is admitted as
any request, and the tokens it shares count as its `hit_tokens` (not computed).

When the first request is gone before (finished or aborted), a sample is admitted
as any request (its prompt from the prefix cache, when cached). A penalized sample
(`SamplingParams.penalized`) never shares: the step's token history holds only the
tokens its own row computed (`paged_kv.model.penalties`). `prompt_logprobs` come
with the first request only (they are the prompt's).
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
  """The request id of sample `index` (>= 1) of the `n > 1` request `parent` (sample 0
  keeps the caller's id); equal only to another `SampleId`.

  Attributes:
    parent: the first request's `request_id`.
    index: the sample, in `[1, n)`.
  """

  parent: Hashable
  index: int

  def __str__(self) -> str:
    return f"{self.parent}#{self.index}"


def sample_ids(request_id: Hashable, n: int) -> list[Hashable]:
  """The ids of the `n` samples of `request_id`: itself, then `SampleId(request_id, i)`."""
  return [request_id] + [SampleId(request_id, i) for i in range(1, n)]


def samples_of(request: Request, live: Mapping) -> list[Request]:
  """The other `n - 1` samples of `request` (none when `n == 1`), checked, not queued;
  `request.samples` holds them from then on.

  Args:
    request: a validated request.
    live: the scheduler's unfinished requests by id.

  Raises:
    InvalidArgument: an unfinished request holds one of their ids (nothing changed).
  """
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
  """`(segments, tokens)`: the segments of the first `p - 1` prompt tokens in the row
  of `req`'s first request (read from the pool's host mirror `host`), for `req` to
  open on; None when `req` does not fork (not a sample, started already, or its first
  request is not ready)."""
  if req.output:
    return None
  first = _first_ready(req)
  if first is None:
    return None
  count = int(req.prompt.size) - 1
  return take_tokens(host.row_segments(first.seq_id), count), count
