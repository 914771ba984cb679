"""Streaming a scheduler's output: new tokens per request as the steps emit them.

`generate(sched, requests)` submits the requests, steps the scheduler and yields,
after every step, one `RequestOutput` per request of `requests` that got tokens or
finished in it, from the step's `StepReport.tokens`. The consumer may call
`sched.abort(request_id)` between outputs: that request's last output comes next.

Example:
  for out in generate(sched, [Request("a", prompt, max_new_tokens=64)]):
    print(out.request_id, out.new_tokens, out.stop_reason)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Iterator

from paged_kv.core.errors import InvalidArgument
from paged_kv.scheduler.scheduler import Request, Scheduler, StepReport

__all__ = ["RequestOutput", "generate"]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One request's progress in one step: `new_tokens` it emitted (maybe none on its
  last output, e.g. after an abort), `num_tokens` so far, whether `finished`, its
  `stop_reason` ("" before), and the `step` (-1 for an output after an abort)."""

  request_id: Hashable
  new_tokens: tuple[int, ...]
  num_tokens: int
  finished: bool
  stop_reason: str
  step: int


def generate(sched: Scheduler, requests: Iterable[Request], *,
             max_steps: int | None = None) -> Iterator[RequestOutput]:
  """Submits `requests` and yields their outputs step by step until all finished.

  Yields, after every step (at most `max_steps`), a `RequestOutput` per request of
  `requests` that emitted tokens or finished in it. The scheduler's own `on_step`
  keeps being called. Raises `InvalidArgument` for ids repeated within `requests`
  (before any step), and whatever `submit` or `step` raises (a refused request stops
  the generator with those before it submitted).
  """
  requests = list(requests)
  ids = [r.request_id for r in requests]
  if len(set(ids)) != len(ids):
    raise InvalidArgument("generate: request ids must be distinct")
  for r in requests:
    sched.submit(r)
  pending = {r.request_id: r for r in requests}
  reports: list[StepReport] = []
  previous = sched.on_step

  def on_step(report: StepReport) -> None:
    reports.append(report)
    if previous is not None:
      previous(report)

  sched.on_step = on_step
  steps = 0
  try:
    while pending:
      # Requests that ended between steps (an abort): their last output first.
      for rid in [rid for rid, r in pending.items() if r.done]:
        r = pending.pop(rid)
        yield RequestOutput(rid, (), len(r.output), True, r.stop_reason, -1)
      if not pending or (max_steps is not None and steps >= max_steps):
        return
      reports.clear()
      sched.step()
      steps += 1
      for report in reports:
        yield from _outputs(report, pending)
  finally:
    sched.on_step = previous


def _outputs(report: StepReport, pending: dict[Hashable, Request]) -> Iterator[RequestOutput]:
  new: dict[Hashable, list[int]] = {}
  for rid, token in report.tokens:
    if rid in pending:
      new.setdefault(rid, []).append(int(token))
  ended = {r.request_id for r in report.finished if pending.get(r.request_id) is r}
  for rid in ended:
    new.setdefault(rid, [])
  for rid, tokens in new.items():
    r = pending[rid]
    done = rid in ended
    if done:
      del pending[rid]
    yield RequestOutput(rid, tuple(tokens), len(r.output), done,
                        r.stop_reason if done else "", report.step)
