"""Host-side driver of a model over a pool, for tests, benchmarks and demos.

  * `PagedRunner` — opens sequences (optionally from another sequence's prefix
    segments, i.e. a cached prefix), prefills in chunks, decodes with k steps per
    call, forks, forces the next token of a branch, preempts/resumes by recompute,
    releases; keeps every sequence's token history and which tokens the model
    sampled.
  * `generate_paged` — greedy generation of a batch through the pool. A
    `hook(runner, step)` runs before every decode call, where features under test
    (compaction, swap, packing, eviction) can act on `runner.state`.

The serving loop does not use these (it runs `paged_kv.scheduler.Scheduler` over
`paged_kv.scheduler.executor.ModelExecutor`); the dense references they are checked
against are in `paged_kv.model.reference`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import PoolExhausted
from paged_kv.core.sequences import fork as fork_sequences
from paged_kv.core.sequences import open_sequence, release
from paged_kv.core.state import PoolState, init_pool
from paged_kv.model import llama
from paged_kv.model.llama import check_pool_matches_model
from paged_kv.model.ragged import bucket
from paged_kv.model.steps import NO_STOP_TOKEN, bind
from paged_kv.core.segment_format import Segments, empty_segments, take_tokens
from paged_kv.pool.block_pool import raise_for_status


def prefix_segments(state: PoolState, seq_id: int, num_tokens: int) -> Segments:
  """`Segments` of a live sequence's first `num_tokens` tokens, the last one cut at
  the token boundary (how a radix node split mid-block shares a prefix uncopied).
  Raises `InvalidArgument` for `num_tokens` outside `[0, seq_len]`."""
  t = state.table
  ns = int(t.num_segments[seq_id])
  row = np.stack([np.asarray(a[seq_id]) for a in (t.block, t.start, t.length)], axis=1)
  return take_tokens(row[:ns], num_tokens)


@dataclasses.dataclass
class SequenceRecord:
  """Host view of one sequence.

  Attributes:
    tokens: every token: prompt, then generated. After a prefill or decode the
      last one is pending: sampled (or forced) but not yet in the cache.
    sampled: `sampled[i]` is True when `tokens[i]` was chosen by the model (greedy)
      through the paged stack, False for prompt and forced tokens.
    remaining: tokens the sequence may still generate.
    parent: (seq_id, tokens shared) when opened from or forked off another sequence.
  """

  tokens: list[int]
  sampled: list[bool]
  remaining: int
  parent: tuple[int, int] | None = None


class PagedRunner:
  """Drives the tiny model over a pool from the host (tests, benchmarks, demos).

  Example:
    runner = PagedRunner(model, pool_config)
    a = runner.open(prompt_a, max_new_tokens=8)
    b = runner.open(prompt_b, max_new_tokens=8, prefix=(a, 5))  # shares a's first 5 tokens
    runner.prefill([a]); runner.prefill([b])
    runner.decode([a, b], num_tokens=8, steps_per_call=4)
    runner.records[a].tokens

  `runner.state` is the `PoolState`; anything may replace it between calls (a
  compaction, a swap) as long as every live sequence keeps its logical K/V.

  Every call has one shape: batches are padded to `max_seqs` rows and prefill
  chunks to `prefill_chunk` tokens, so each step function compiles once per
  runner configuration (and once per `steps_per_call` for `decode_multi`).
  The steps are bound once (`steps`, `paged_kv.model.steps.bind`): a call costs
  the host microseconds whatever the model's depth.
  """

  def __init__(self, model: llama.TinyLlama, pool_config: PoolConfig,
               state: PoolState | None = None, *, prefill_chunk: int = 64,
               stop_token: int = NO_STOP_TOKEN, impl: str | None = None,
               interpret: bool | None = None):
    check_pool_matches_model(pool_config, model.config)
    self.config = pool_config
    self.state = init_pool(pool_config) if state is None else state
    self.prefill_chunk = prefill_chunk
    self.stop_token = stop_token
    self.kernel_args = dict(impl=impl, interpret=interpret)
    self.steps = bind(model, pool_config, **self.kernel_args)
    self.records: dict[int, SequenceRecord] = {}
    self._cached: dict[int, int] = {}  # tokens of each live sequence in the cache
    self._pending: dict[int, bool] = {}  # its last token is sampled/forced, not yet cached
    self._live: set[int] = set()
    self.preempted: set[int] = set()  # released rows that `resume` may reopen
    self._preempted_pending: dict[int, bool] = {}

  # -- queries ------------------------------------------------------------------------
  @property
  def graphdef(self):
    """The model's graph definition (`nnx.split(model)[0]`)."""
    return self.steps.graphdef

  @property
  def params(self):
    """The model's parameters (rebuilt from the bound arrays)."""
    return self.steps.params

  @property
  def live(self) -> list[int]:
    """Live sequence rows, ascending."""
    return sorted(self._live)

  def num_cached(self, seq_id: int) -> int:
    """Tokens of a live sequence whose K/V are in the pool."""
    return self._cached[seq_id]

  def segments(self, seq_id: int) -> Segments:
    """`Segments` (`i32[n, 3]`) of a live sequence's cached tokens."""
    return prefix_segments(self.state, seq_id, self._cached[seq_id])

  def _free_row(self) -> int:
    for i in range(self.config.max_seqs):
      if i not in self._live and i not in self.preempted:
        return i
    raise PoolExhausted("no free sequence row", reason="no_free_row")

  # -- sequences ----------------------------------------------------------------------
  def open(self, prompt: Sequence[int], *, max_new_tokens: int,
           prefix: tuple[int, int] | None = None) -> int:
    """Opens a sequence for `prompt`; returns its row. Call `prefill` next.

    Args:
      prompt: the prompt tokens.
      max_new_tokens: generation budget.
      prefix: `(src_seq, n)`: the first `n` tokens of `prompt` equal the first `n`
        of live sequence `src_seq`, already in the cache; the new sequence opens on
        those segments (shared, increfed) and prefills only the rest.
    """
    prompt = [int(x) for x in prompt]
    seq = self._free_row()
    if prefix is None:
      segs = empty_segments()
    else:
      src, n = prefix
      if self.records[src].tokens[:n] != prompt[:n] or n > self._cached[src]:
        raise ValueError(f"prefix {prefix}: not a cached prefix of sequence {src}")
      segs = prefix_segments(self.state, src, n)
    self._open_row(seq, segs)
    self._pending[seq] = False
    self.records[seq] = SequenceRecord(tokens=prompt, sampled=[False] * len(prompt),
                                       remaining=max_new_tokens, parent=prefix)
    return seq

  def _open_row(self, seq: int, segs: Segments) -> None:
    p = len(segs)
    width = bucket(p)
    pad = lambda a: np.pad(a, (0, width - p))[None].astype(np.int32)
    self.state, status = open_sequence(
        self.state, np.array([seq], np.int32), pad(segs[:, 0]), pad(segs[:, 1]), pad(segs[:, 2]),
        np.array([p], np.int32), config=self.config, atomic=True)
    raise_for_status(status, "open_sequence")
    self._live.add(seq)
    self._cached[seq] = int(segs[:, 2].sum())

  def _prefill_target(self, seq: int) -> int:
    """Tokens of `seq` that belong in the cache (all but a pending one)."""
    return len(self.records[seq].tokens) - int(self._pending[seq])

  def prefill(self, seq_ids: Sequence[int]) -> None:
    """Prefills every uncached token of the given sequences (but a pending one), in chunks.

    A sequence without a pending token then gets one: the greedy sample after
    its last token (if it has budget left).
    """
    seq_ids = list(seq_ids)
    while True:
      todo = [s for s in seq_ids if self._cached[s] < self._prefill_target(s)]
      if not todo:
        return
      chunks = {s: self.records[s].tokens[self._cached[s]:min(self._cached[s] + self.prefill_chunk,
                                                              self._prefill_target(s))]
                for s in todo}
      t, b = self.prefill_chunk, self.config.max_seqs
      ids = np.full((b,), -1, np.int32)
      toks = np.zeros((b, t), np.int32)
      num = np.zeros((b,), np.int32)
      for i, s in enumerate(todo):
        ids[i], num[i] = s, len(chunks[s])
        toks[i, :num[i]] = chunks[s]
      self.state, (nxt, _, status) = self.steps.prefill(self.state, ids, toks, num)
      status, nxt = np.asarray(status), np.asarray(nxt)
      raise_for_status(status[:len(todo)], "prefill")
      for i, s in enumerate(todo):
        rec = self.records[s]
        self._cached[s] += int(num[i])
        if not self._pending[s] and self._cached[s] == len(rec.tokens) and rec.remaining > 0:
          rec.tokens.append(int(nxt[i]))
          rec.sampled.append(True)
          rec.remaining -= 1
          self._pending[s] = True

  def decode(self, seq_ids: Sequence[int] | None = None, *, num_tokens: int,
             steps_per_call: int = 1,
             hook: Callable[["PagedRunner", int], None] | None = None) -> None:
    """Generates up to `num_tokens` more tokens per sequence, `steps_per_call` per jit call.

    `steps_per_call == 1` uses `decode_step`, larger values `decode_multi`. The
    batch is every live sequence with budget left (or `seq_ids`), recomputed
    before each call, so `hook(runner, tokens_done)` (called before every call,
    the first with 0) may fork, force tokens, release or move blocks.
    """
    done = 0
    while done < num_tokens:
      if hook is not None:
        hook(self, done)
      pool = self.live if seq_ids is None else [s for s in seq_ids if s in self._live]
      batch = [s for s in pool if self._pending[s] and self.records[s].remaining > 0]
      if not batch:
        return
      k = min(steps_per_call, num_tokens - done)
      self._decode_call(batch, k)
      done += k

  def _decode_call(self, batch: list[int], k: int) -> None:
    b = self.config.max_seqs
    ids = np.full((b,), -1, np.int32)
    last = np.zeros((b,), np.int32)
    budget = np.zeros((b,), np.int32)
    for i, s in enumerate(batch):
      rec = self.records[s]
      ids[i], last[i], budget[i] = s, rec.tokens[-1], rec.remaining
    if k == 1 and self.stop_token == NO_STOP_TOKEN:
      self.state, (nxt, _, status) = self.steps.decode_step(self.state, ids, last)
      new_tokens, status = np.asarray(nxt)[None], np.asarray(status)[None]
    else:
      self.state, (new_tokens, status, _, _) = self.steps.decode_multi(
          self.state, ids, last, np.minimum(budget, k), num_steps=k, stop_token=self.stop_token)
      new_tokens, status = np.asarray(new_tokens), np.asarray(status)
    for i, s in enumerate(batch):
      rec = self.records[s]
      for step in range(k):
        tok = int(new_tokens[step, i])
        if tok < 0:
          break
        self._cached[s] += 1
        rec.tokens.append(tok)
        rec.sampled.append(True)
        rec.remaining -= 1
        if tok == self.stop_token:
          rec.remaining = 0
          break
    # Records are up to date first: a failure (e.g. pool exhausted) leaves the
    # runner consistent with the pool, then raises.
    for step in range(k):
      raise_for_status(status[step, :len(batch)], f"decode (step {step} of {k})")

  def fork(self, src: int, *, max_new_tokens: int | None = None) -> int:
    """A new sequence sharing every cached segment of `src` (and its pending token)."""
    dst = self._free_row()
    self.state, status = fork_sequences(self.state, np.array([src], np.int32),
                                       np.array([dst], np.int32), config=self.config,
                                       atomic=True)
    raise_for_status(status, "fork")
    rec = self.records[src]
    self._live.add(dst)
    self._cached[dst] = self._cached[src]
    self._pending[dst] = self._pending[src]
    self.records[dst] = SequenceRecord(
        tokens=list(rec.tokens), sampled=list(rec.sampled),
        remaining=rec.remaining if max_new_tokens is None else max_new_tokens,
        parent=(src, self._cached[src]))
    return dst

  def force_next(self, seq_id: int, token: int) -> None:
    """Replaces the pending (sampled, not yet cached) token of a sequence."""
    rec = self.records[seq_id]
    if not self._pending[seq_id]:
      raise ValueError(f"sequence {seq_id} has no pending token")
    rec.tokens[-1] = int(token)
    rec.sampled[-1] = False

  def preempt(self, seq_id: int) -> None:
    """Preemption by recompute: frees the sequence's K/V, keeps its record.

    `resume(seq_id)` later recomputes the cache from the token history.
    """
    pending = self._pending[seq_id]
    self.release([seq_id])
    self.preempted.add(seq_id)
    self._preempted_pending[seq_id] = pending

  def resume(self, seq_id: int) -> None:
    """Reopens a preempted sequence in its old row and re-prefills its history.

    The pending token is kept (not re-sampled), so generation continues where
    it stopped.
    """
    if seq_id not in self.preempted:
      raise ValueError(f"sequence {seq_id} is not preempted")
    if seq_id in self._live:
      raise ValueError(f"row {seq_id} is in use; resume before reusing it")
    self._open_row(seq_id, empty_segments())
    self._pending[seq_id] = self._preempted_pending.pop(seq_id)
    self.preempted.discard(seq_id)
    self.prefill([seq_id])

  def release(self, seq_ids: Sequence[int]) -> None:
    """Ends sequences. Their records stay in `records` until the row is reused."""
    ids = np.asarray(list(seq_ids), np.int32)
    b = bucket(ids.size)
    self.state, status = release(self.state, np.pad(ids, (0, b - ids.size),
                                                             constant_values=-1),
                                          config=self.config, atomic=True)
    raise_for_status(np.asarray(status)[:ids.size], "release")
    for s in ids.tolist():
      self._live.discard(s)
      del self._cached[s]
      del self._pending[s]


# One-call generation ---------------------------------------------------------------------


def generate_paged(model: llama.TinyLlama, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, *, pool_config: PoolConfig,
                   prefixes: Sequence[tuple[int, int] | None] | None = None,
                   steps_per_call: int = 1, prefill_chunk: int = 64,
                   hook: Callable[[PagedRunner, int], None] | None = None) -> PagedRunner:
  """Greedy generation of a batch through the pool; returns the runner.

  Args:
    model: the decoder.
    prompts: one token list per request; request i gets sequence row i.
    max_new_tokens: tokens to generate per request (the first comes from prefill).
    pool_config: pool sizes (see `pool_config_for`).
    prefixes: per request `None` or `(j, n)`: request i's first `n` prompt tokens
      are request j's (j < i) and are opened from j's cached segments.
    steps_per_call: decode steps per jit call (1: `decode_step`, k: `decode_multi`).
    prefill_chunk: prompt tokens per prefill call per sequence.
    hook: `hook(runner, tokens_done)` before every decode call (the first with 0).

  Returns:
    The `PagedRunner`; `runner.records[i].tokens` is request i's prompt + output.
  """
  runner = PagedRunner(model, pool_config, prefill_chunk=prefill_chunk)
  prefixes = list(prefixes) if prefixes is not None else [None] * len(prompts)
  # Prefill in waves: a request whose prefix comes from another waits for it.
  wave: list[int] = []
  for i, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
    if prefix is not None and prefix[0] in wave:
      runner.prefill(wave)
      wave = []
    seq = runner.open(prompt, max_new_tokens=max_new_tokens, prefix=prefix)
    if seq != i:
      raise ValueError(f"request {i} got row {seq}: start from an empty pool")
    wave.append(seq)
  runner.prefill(wave)
  runner.decode(num_tokens=max_new_tokens - 1, steps_per_call=steps_per_call, hook=hook)
  return runner
