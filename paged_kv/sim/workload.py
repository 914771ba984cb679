"""Synthetic and trace-driven request workloads for benchmarks, tools and tests.

Two kinds:
  * a fixed list of prompts and output lengths (`Workload`): `random_workload`,
    `trace_workload`, `shadow_workload`; `serving_bench.run_closed_loop` serves one;
  * the chat shape (`ChatShape`, `ChatWorkload`): a shared system prompt plus a random
    suffix of the request's own, a random output length, seeded. `ChatWorkload.requests`
    gives a list; `ChatWorkload.top_up` keeps a scheduler at a batch (a finished request
    is replaced before the next step).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
import dataclasses

import numpy as np

from paged_kv.scheduler.request import Request
from paged_kv.sim import traces

FIRST_TOKEN_ID = 3
"""Random prompts draw ids from [3, vocab): 0-2 are often special tokens."""


@dataclasses.dataclass(frozen=True)
class Workload:
  """Prompts (`i32[n]` each) and how many tokens each request generates."""

  prompts: tuple[np.ndarray, ...]
  output_lens: tuple[int, ...]
  source: str

  def __len__(self) -> int:
    return len(self.prompts)

  @property
  def max_seq_len(self) -> int:
    return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

  @property
  def mean_context(self) -> float:
    """Mean context of a decode step: prompt + half the output, averaged over requests."""
    return float(np.mean([len(p) + o / 2 for p, o in zip(self.prompts, self.output_lens)]))

  @property
  def output_tokens(self) -> int:
    return int(sum(self.output_lens))


def random_workload(num_requests: int, prompt_len: int, output_len: int, vocab_size: int,
                    seed: int) -> Workload:
  """`num_requests` prompts of `prompt_len` uniform ids in [3, vocab), `output_len` each."""
  rng = np.random.default_rng(seed)
  prompts = tuple(rng.integers(FIRST_TOKEN_ID, vocab_size, prompt_len).astype(np.int32)
                  for _ in range(num_requests))
  return Workload(prompts, (output_len,) * num_requests,
                  f"random: {prompt_len} prompt, {output_len} output tokens")


def trace_workload(path: str, num_requests: int, vocab_size: int, *, skip: int = 0,
                   scale: int = 1, max_prompt_len: int, max_output_len: int) -> Workload:
  """Requests `[skip, skip + num_requests)` of a Mooncake or Azure trace (`traces`).

  Lengths are divided by `scale` and capped; token ids are folded into [3, vocab)
  (shared prefixes stay shared). Arrival times are not used.
  """
  rows = traces.load_trace(path, skip + num_requests)[skip:]
  if len(rows) < num_requests:
    raise ValueError(f"{path} has {skip + len(rows)} requests; {skip + num_requests} needed")
  tokens = traces.TokenSource(rows)
  prompts, outs = [], []
  for r in rows:
    ids = traces.scaled_prompt(r, tokens, scale)[:max_prompt_len].astype(np.int64)
    prompts.append((FIRST_TOKEN_ID + ids % (vocab_size - FIRST_TOKEN_ID)).astype(np.int32))
    outs.append(int(min(max(1, -(-r.output_length // scale)), max_output_len)))
  return Workload(tuple(prompts), tuple(outs),
                  f"trace {traces.describe_trace(path)}, requests {skip}-{skip + num_requests}"
                  f", lengths / {scale}, prompt <= {max_prompt_len}, output <= "
                  f"{max_output_len}")


def shadow_workload(workload: Workload, vocab_size: int, seed: int) -> Workload:
  """Same lengths, fresh random prompts: served untimed, it compiles the steps
  `workload` will run without giving its prompts prefix-cache hits."""
  rng = np.random.default_rng(seed)
  prompts = tuple(rng.integers(FIRST_TOKEN_ID, vocab_size, len(p)).astype(np.int32)
                  for p in workload.prompts)
  return Workload(prompts, workload.output_lens, f"shadow of {workload.source}")


# The chat shape -----------------------------------------------------------------------


def _check_range(name: str, value, *, low: int) -> None:
  if (not isinstance(value, tuple) or len(value) != 2
      or not all(isinstance(v, (int, np.integer)) for v in value)
      or not low <= value[0] < value[1]):
    raise ValueError(f"{name} must be a (lo, hi) tuple of ints with {low} <= lo < hi; "
                     f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class ChatShape:
  """A chat request's distribution. Every range is `[lo, hi)`, drawn uniformly.

  Attributes:
    system_len: tokens of the system prompt all requests share.
    own_lens: tokens of a request's own suffix.
    output_lens: tokens a request generates (`max_new_tokens`).
    vocab: ids of the system prompt (and of the suffix unless `own_vocab`).
    own_vocab: ids of the suffix; None: `vocab`.
    shared_lens: None: a request starts with the whole system prompt; else with its
      first `n` tokens, `n` drawn from this range (partial prefix hits).
    forced_len: > 0: each request gets `forced_output` of this many ids drawn from
      `forced_vocab` (for executors that emit forced tokens, e.g. `DryExecutor`); at
      least the longest output.
    forced_vocab: ids of the forced outputs.
  """

  system_len: int
  own_lens: tuple[int, int]
  output_lens: tuple[int, int]
  vocab: tuple[int, int] = (0, 50_000)
  own_vocab: tuple[int, int] | None = None
  shared_lens: tuple[int, int] | None = None
  forced_len: int = 0
  forced_vocab: tuple[int, int] = (100, 200)

  def __post_init__(self):
    if not isinstance(self.system_len, int) or self.system_len < 0:
      raise ValueError(f"system_len must be an int >= 0; got {self.system_len!r}")
    if not isinstance(self.forced_len, int) or self.forced_len < 0:
      raise ValueError(f"forced_len must be an int >= 0; got {self.forced_len!r}")
    _check_range("own_lens", self.own_lens, low=0)
    _check_range("output_lens", self.output_lens, low=1)
    _check_range("vocab", self.vocab, low=0)
    _check_range("forced_vocab", self.forced_vocab, low=0)
    if 0 < self.forced_len < self.output_lens[1] - 1:
      raise ValueError(f"forced_len {self.forced_len} is shorter than the longest output "
                       f"({self.output_lens[1] - 1} tokens)")
    if self.own_vocab is not None:
      _check_range("own_vocab", self.own_vocab, low=0)
    if self.shared_lens is not None:
      _check_range("shared_lens", self.shared_lens, low=0)
      if self.shared_lens[1] > self.system_len + 1:
        raise ValueError(f"shared_lens {self.shared_lens} exceeds the system prompt "
                         f"({self.system_len} tokens)")

  @classmethod
  def host_benchmark(cls, block_size: int, vocab: tuple[int, int] = (0, 50_000)
                     ) -> ChatShape:
    """The host benchmarks' chat: a 4-block system prompt, 1 to 3 blocks of the
    request's own, 16-127 output tokens."""
    return cls(system_len=4 * block_size, own_lens=(1, 3 * block_size),
               output_lens=(16, 128), vocab=vocab)


class ChatWorkload:
  """Seeded chat requests of one `ChatShape`; the same seed gives the same requests.

  Each request draws, in order: its share of the system prompt (`shared_lens`), its
  suffix length, the suffix, its output length, its forced output.
  """

  def __init__(self, shape: ChatShape, seed: int):
    if not isinstance(shape, ChatShape):
      raise TypeError(f"shape must be a ChatShape; got {type(shape).__name__}")
    self.shape = shape
    self.rng = np.random.default_rng(seed)
    self.system = self.rng.integers(*shape.vocab, shape.system_len)
    self.num_drawn = 0

  def draw(self) -> tuple[np.ndarray, int, np.ndarray | None]:
    """The next request's `(prompt, max_new_tokens, forced_output or None)`."""
    s, rng = self.shape, self.rng
    system = self.system
    if s.shared_lens is not None:
      system = system[:rng.integers(*s.shared_lens)]
    own = rng.integers(*(s.own_vocab or s.vocab), int(rng.integers(*s.own_lens)))
    output_len = int(rng.integers(*s.output_lens))
    forced = rng.integers(*s.forced_vocab, s.forced_len) if s.forced_len else None
    self.num_drawn += 1
    return np.concatenate([system, own]), output_len, forced

  def request(self, request_id: Hashable, **kwargs) -> Request:
    """The next request as a `Request` (`kwargs`: its other fields, e.g. `namespace`)."""
    prompt, output_len, forced = self.draw()
    return Request(request_id, prompt, output_len, forced_output=forced, **kwargs)

  def requests(self, num: int, *, first_id: int = 0, id_prefix: str | None = None,
               namespaces: Sequence[Hashable] = ()) -> list[Request]:
    """The next `num` requests, ids `first_id + i` (as `f"{id_prefix}{first_id + i}"`
    with a prefix), namespaces taken in turn from `namespaces` (none: the default)."""
    out = []
    for i in range(num):
      kwargs = {"namespace": namespaces[i % len(namespaces)]} if namespaces else {}
      out.append(self.request(f"{id_prefix}{first_id + i}" if id_prefix is not None
                              else first_id + i, **kwargs))
    return out

  def top_up(self, sched, batch: int) -> None:
    """Submits requests until `batch` are running or waiting in `sched` (ids: the count
    drawn so far)."""
    while len(sched.running) + len(sched.waiting) < batch:
      sched.submit(self.request(self.num_drawn))
