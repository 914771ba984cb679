"""Stop strings (`SamplingParams.stop`): the output's text, watched on the host.

A stop string is text, not tokens: it can span tokens, start inside one, or appear
only once a multi-byte character completes. `StopStringMatcher` follows one output
through the tokenizer's incremental decoder and reports the first stop string to
complete (the earliest end; at the same end, the longer). The text it hands out
never contains one (vLLM's default): it holds back a tail that could start one.
`output` keeps the token that completed it (with `decode_steps = k`, up to k - 1 more).

`StopStringWatch` is the scheduler's side: `Finishing.finish` calls `scan()` first,
so a request ends in the step its text completed a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from paged_kv.scheduler.request import Request

__all__ = ["StopStringMatcher", "StopStringWatch", "find_stop", "text_until_stop"]

STOP_REASON = "stop_string"


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
  """`(index, stop)` of the stop string in `text[start:]` whose end comes first (at the
  same end, the longer one), or None."""
  best = None
  for s in stops:
    i = text.find(s, start)
    if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
      best = (i, s)
  return best


def text_until_stop(tokenizer: Any, output: Sequence[int], stops: Sequence[str]) -> str:
  """The text of `output` up to (not including) its first stop string; all of it if none."""
  text = tokenizer.decode(output)
  hit = find_stop(text, stops)
  return text if hit is None else text[:hit[0]]


class StopStringMatcher:
  """One output's text, piece by piece, ending before the first stop string: `add`
  returns the text a token makes safe to show, `flush` the held-back tail of an
  output that did not stop; `stopped` / `stop` say which stop string completed."""

  def __init__(self, tokenizer: Any, stops: Sequence[str]):
    self._stream = tokenizer.stream()
    self._stops = tuple(stops)
    self._longest = max((len(s) for s in self._stops), default=0)
    self._text = ""  # the decoded text (up to the stop, once stopped)
    self._shown = 0  # characters handed out
    self.stopped = False
    self.stop: str | None = None

  @property
  def text(self) -> str:
    """The text handed out so far."""
    return self._text[:self._shown]

  def _held(self) -> int:
    """Characters at the end of the text that could start a stop string."""
    for k in range(min(self._longest - 1, len(self._text) - self._shown), 0, -1):
      tail = self._text[-k:]
      if any(s.startswith(tail) for s in self._stops):
        return k
    return 0

  def add(self, token_id: int) -> str:
    """Feeds one generated id; returns the text it makes safe to show."""
    if self.stopped:
      return ""
    start = max(0, len(self._text) - self._longest + 1)  # a new stop ends in the new text
    self._text += self._stream.add(token_id)
    hit = find_stop(self._text, self._stops, start)
    if hit is not None:
      self.stopped, self.stop = True, hit[1]
      self._text = self._text[:hit[0]]
      end = len(self._text)
    else:
      end = len(self._text) - self._held()
    new, self._shown = self._text[self._shown:end], max(self._shown, end)
    return new

  def flush(self) -> str:
    """The held-back tail (and an incomplete character), at the end of the output."""
    if self.stopped:
      return ""
    self._text += self._stream.flush()
    new, self._shown = self._text[self._shown:], len(self._text)
    return new


class StopStringWatch:
  """Ends running requests whose text completed a stop string (see the module docstring)."""

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self._watched: dict[int, tuple["Request", StopStringMatcher, list[int]]] = {}

  def register(self, request: "Request") -> None:
    """Watches `request` if its sampling has stop strings (`Scheduler.submit`)."""
    sp = request.sampling
    if sp is not None and sp.stop:
      self._watched[id(request)] = (request, StopStringMatcher(self.tokenizer, sp.stop), [0])

  def scan(self) -> None:
    """Feeds each watched request's new tokens; one whose text completed a stop string
    gets `stop_reason "stop_string"`. Finished requests are dropped."""
    for key, (req, matcher, fed) in list(self._watched.items()):
      out = req.output
      while fed[0] < len(out) and not matcher.stopped:
        matcher.add(out[fed[0]])
        fed[0] += 1
      if matcher.stopped and not req.stop_reason:
        req.stop_reason = STOP_REASON
      if matcher.stopped or req.stop_reason or req.done:
        del self._watched[key]

  def __len__(self) -> int:
    return len(self._watched)
