"""Prompt logprobs on the host: which positions a step asks for, and the answers read.

A request with `SamplingParams.prompt_logprobs = k` gets, for each prompt token after
the first, its logprob given the tokens before it, its rank and the top `k` there
(`Request.prompt_logprobs`, vLLM's). A step holding its prompt chunk carries
`PromptPositions` (`positions`) that its program computes; `store` writes them into
the request once read. Such a request shares no cached prefix (its own steps compute
every position).
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
  """The `PromptPositions` (`width` entries) of a step's chunks, laid out after
  `num_decodes` decode tokens; None when no chunk's request asks. `ValueError` for
  more positions than `width` (the scheduler's chunks never exceed its budget)."""
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
  """Writes a read step's `PromptLogprobs` (`result`, host arrays) into its chunks'
  requests (rows `num_decodes` on); a row whose request's epoch moved on is dropped."""
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
