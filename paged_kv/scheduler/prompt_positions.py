"""Prompt logprobs on the host: which positions a step asks for, and the answers read.

A request with `SamplingParams.prompt_logprobs = k` gets, for each prompt token after
the first, its logprob given the tokens before it, its rank, and the top `k` there
(`Request.prompt_logprobs`; vLLM's `prompt_logprobs`). Its prompt chunks are computed
by the ordinary steps; a step holding one carries `PromptPositions` (`positions`: for
every token of the chunk whose next token is still in the prompt, that position and
that token; `prefill_token_budget` entries, the most a step holds) and its program
computes them (`paged_kv.model.prompt_logprobs`); `store` writes what a step computed
into the requests once its tokens are read (rows whose request moved on meanwhile
are dropped; a recomputed prompt writes the same values again).

Rules the scheduler keeps: such a request is admitted without a cached prefix
(`paged_kv.scheduler.admission`: every prompt position is then computed by its own
steps); the executor must declare it computes them (`ModelExecutor(prompt_logprobs=
True)`, which also has `Scheduler.warmup` compile the steps with positions: one
more program per mixed token width), else `submit` refuses the request; `k` is at
most `SchedulerConfig.max_logprobs` (the static top width of the step). Steps with
no such chunk build no positions and run the programs they always ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paged_kv.model.plan import PromptPositions

if TYPE_CHECKING:
  from paged_kv.scheduler.request import Request

__all__ = ["positions", "store", "wants"]


def wants(req: "Request") -> bool:
  """Whether `req` asks for its prompt's logprobs."""
  sp = req.sampling
  return sp is not None and sp.prompt_logprobs is not None


def positions(chunks, num_decodes: int, width: int) -> PromptPositions | None:
  """The `PromptPositions` of a step's chunks (after `num_decodes` decode tokens in the
  layout), `width` entries; None when no chunk's request asks.

  Raises:
    ValueError: more positions than `width` (the scheduler's chunks never hold more
      tokens than its `prefill_token_budget`).
  """
  if not any(wants(r) for r, _ in chunks):
    return None
  out = PromptPositions.empty(width)
  start, used = num_decodes, 0
  for c, (r, n) in enumerate(chunks):
    if wants(r):
      a, p = int(r.num_cached), int(r.prompt.size)
      k = max(0, min(n, p - 1 - a))  # tokens whose next token is in the prompt
      if used + k > width:
        raise ValueError(f"{used + k} prompt positions > width {width}")
      sl = slice(used, used + k)
      out.index[sl] = np.arange(start, start + k)
      out.target[sl] = r.prompt[a + 1:a + 1 + k]
      out.row[sl] = num_decodes + c
      out.position[sl] = np.arange(a + 1, a + 1 + k)
      used += k
    start += n
  return out


def store(result, chunks, num_decodes: int, epochs) -> None:
  """Writes a read step's `PromptLogprobs` (`result`) into its chunks' requests.

  Args:
    result: the step's `paged_kv.model.prompt_logprobs.PromptLogprobs` (host arrays).
    chunks: the step's `(request, tokens)` chunks, rows `num_decodes` on.
    num_decodes: the step's decode rows.
    epochs: each row's request epoch at dispatch (a later one: dropped).
  """
  rows = np.asarray(result.row)
  live = np.flatnonzero(rows >= 0)
  if not live.size:
    return
  pos, lp, rank = (np.asarray(a)[live].tolist() for a in (result.position, result.logprob,
                                                           result.rank))
  top_ids, top_lps = np.asarray(result.top_ids)[live], np.asarray(result.top_logprobs)[live]
  for i, row in enumerate(rows[live].tolist()):
    req = chunks[row - num_decodes][0]
    if epochs[row] != req.epoch:
      continue
    if req.prompt_logprobs is None:
      req.prompt_logprobs = [None] * int(req.prompt.size)
    k = req.sampling.prompt_logprobs
    req.prompt_logprobs[pos[i]] = (lp[i], rank[i], tuple(zip(top_ids[i, :k].tolist(),
                                                             top_lps[i, :k].tolist())))
