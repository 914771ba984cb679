"""`ForwardPass`: a scheduler step's one forward pass, and its tokens back on the host.

The step's rows (`batching`) go to the executor in one mixed batch, after the blocks
they may take were freed (eviction, then `Preemption.relieve`). The host decides the
reservation on the pool's mirror and commits it (`BlockPool.reserve_step`); the
executor reads it (`plan.reserved`). The k-step decode reserves in its program: the
mirror predicts it and compares the device's statuses later
(`BlockPool.predict_decode_steps`). All but the sampled tokens is known at dispatch.
A dispatched step is a `Flight` until its tokens are read: at once, or after the
next dispatch when overlapped (`docs/serving_loop.md`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.model.metadata import reserved_slots
from paged_kv.model.plan import CarriedTokens
from paged_kv.pool.block_pool import StepPrediction
from paged_kv.scheduler import batching, prompt_positions
from paged_kv.scheduler.executor import Executor, attached_state
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.preemption import Preemption
from paged_kv.scheduler.request import Request, RequestQueues, is_finished
from paged_kv.scheduler.running_rows import RunningRows
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord


@dataclasses.dataclass
class Flight:
  """A dispatched step whose sampled tokens the host has not read yet.

  Rows `decodes` then `chunks`, per row `ok` (reserved) and `epochs` (a later one
  drops its tokens), per chunk `first` (it sampled its first token); `tokens`, with
  `runs` for k steps; `last`: each row's last token (the next step's carried input);
  `slots` ... `slot_ok`: the decode rows' `RunningRows` slots, binds, epochs, `ok`.
  """

  decodes: list[Request]
  chunks: batching.Chunks
  ok: list[bool]
  epochs: list[int]
  first: list[bool]
  tokens: Any
  runs: np.ndarray | None
  extra: list
  last: Any
  slots: np.ndarray | None = None
  gens: np.ndarray | None = None
  slot_epochs: np.ndarray | None = None
  slot_ok: np.ndarray | None = None


@jax.jit
def _last_tokens(tokens: jax.Array, runs: jax.Array) -> jax.Array:
  """`i32[B]` the token each row sampled at its last step (`tokens i32[k, B]`)."""
  idx = jnp.clip(runs - 1, 0, tokens.shape[0] - 1)
  return jnp.take_along_axis(tokens, idx[None, :], axis=0)[0]


@jax.jit
def _resolve_carried(carried: CarriedTokens, tokens: jax.Array) -> jax.Array:
  return carried.resolve(tokens)


class ForwardPass:
  """Builds, runs and records a step's forward pass (see the module docstring)."""

  def __init__(self, pool, config: SchedulerConfig, stats: SchedulerStats,
               evictor: Evictor, preemption: Preemption,
               queues: RequestQueues, record: StepRecord, clock):
    self.pool = pool
    self.config = config
    self.stats = stats
    self.evictor = evictor
    self.preemption = preemption
    self.queues = queues
    self.record = record
    self.clock = clock
    self.flights: collections.deque[Flight] = collections.deque()
    self._prev = None  # a device i32[max_batch] of the executor's: carried-token placeholder

  # ------------------------------------------------------------------ the step
  def run(self, executor: Executor) -> None:
    """One forward pass (or k decode steps); synchronous: its tokens are read before
    it returns; overlapped: the tokens of the step before it are."""
    dispatched = self.dispatch(executor)
    keep = 1 if (dispatched and self.config.overlap) else 0
    while len(self.flights) > keep:
      self.resolve(self.flights.popleft())

  def drain(self) -> None:
    """Reads every dispatched step's tokens (waits for the device)."""
    while self.flights:
      self.resolve(self.flights.popleft())

  def salvage(self) -> list[Request]:
    """After an exception: reads what the dispatched steps produced; returns the
    requests whose unread tokens could not be read (lost: they must recompute)."""
    lost: list[Request] = []
    while self.flights:
      flight = self.flights.popleft()
      try:
        self.resolve(flight)
      except Exception:  # pylint: disable=broad-except
        lost.extend(r for r in (*flight.decodes, *(r for r, _ in flight.chunks))
                    if r.in_flight)
    return lost

  def dispatch(self, executor: Executor) -> bool:
    """Plans the step's rows and dispatches them; False when there was nothing to run."""
    rows = self._rows()
    decodes, chunks = rows.decodes, rows.chunks
    if not decodes and not chunks:
      return False
    config = self.config
    if self._multi_step(executor, decodes, chunks):
      steps = [min(config.decode_steps, r.max_new_tokens - len(r.output) - r.in_flight)
               for r in decodes]
      if self.evictor.ensure_free(batching.blocks_needed_for(decodes, steps,
                                                             self.pool.config.block_size)):
        self._dispatch_multi(executor, rows, steps)
        return True
    need = rows.fresh_blocks
    if not self.evictor.ensure_free(need):
      self._relieve(need - self.pool.num_free_blocks)
      rows = self._rows()
      if not rows.decodes and not rows.chunks:
        return False
    self._dispatch_one(executor, rows)
    return True

  def _rows(self) -> batching.StepRows:
    """This step's rows (`batching.table_rows` of the running requests)."""
    config = self.config
    return batching.table_rows(self.queues.rows, self.queues.running,
                               prefill_chunk=config.prefill_chunk,
                               prefill_token_budget=config.prefill_token_budget,
                               block_size=self.pool.config.block_size)

  def _dispatch_one(self, executor: Executor, rows: batching.StepRows) -> None:
    """One forward pass of the step's decodes and chunks."""
    decodes, chunks = rows.decodes, rows.chunks
    plan = batching.plan_rows(rows, self.config, sampling=getattr(executor, "samples", False))
    plan = self._with_carried(executor, plan, rows)
    pred = self.pool.reserve_step(plan.seq_ids, plan.num_new,
                                  max_new_tokens=plan.max_query_len, grow_in_step=True)
    plan = dataclasses.replace(plan, reserved=reserved_slots(plan, pred.slot_idx, pred.status,
                                                             pred.grow, pred.clock))
    nxt, extra = self._call(executor, pred, lambda s: executor.step(s, plan),
                            len(decodes) + len(chunks))
    status = pred.status
    nd = len(decodes)
    good = status[:nd + len(chunks)] == Status.OK
    ok = good.tolist()
    first, failed = [], 0
    t, slots = self.queues.rows, rows.slots
    if nd:
      if not good[:nd].all():
        for i in np.flatnonzero(~good[:nd]).tolist():
          req = decodes[i]
          self._record_failure(req, int(status[i]), req.num_cached + 1)
          failed += 1
      adv = slots[good[:nd]]
      t.num_cached[adv] += 1
      t.in_flight[adv] += 1
      t.carry_row[adv] = np.flatnonzero(good[:nd])
    self.stats.decode_tokens += nd - failed
    for i, (req, n) in enumerate(chunks, start=nd):
      if not ok[i]:
        self._record_failure(req, int(status[i]), req.num_cached + n)
        failed += 1
        first.append(False)
        continue
      req.num_cached += n
      self.stats.prefill_tokens += n
      done = req.num_cached == req.prefill_target and not req.output and not req.in_flight
      first.append(done)
      if done:  # its first token is sampled in this step
        req.in_flight = 1
        req.carry_row = i
    slot_epochs = t.epoch[slots]
    self._launch(executor, Flight(decodes=decodes, chunks=chunks, ok=ok, first=first,
                                  epochs=slot_epochs.tolist() + [r.epoch for r, _ in chunks],
                                  tokens=nxt, runs=None, extra=extra, last=nxt,
                                  slots=slots, gens=t.gen[slots], slot_epochs=slot_epochs,
                                  slot_ok=good[:nd]), failed)

  # ------------------------------------------------------------------ k decode steps
  def _multi_step(self, executor: Executor, decodes: list[Request],
                  chunks: batching.Chunks) -> bool:
    """Whether this step may run `decode_steps` decode steps in one dispatch: no
    prompt chunk, nothing waiting, an executor that can, a row with 2+ tokens to go."""
    q = self.queues
    if (self.config.decode_steps <= 1 or chunks or q.waiting or q.swapped
        or not hasattr(executor, "decode_steps")):
      return False
    if getattr(executor, "uses_tokens", True) and any(
        r.forced_output is not None for r in decodes):
      return False  # the device would feed its own samples, not the forced tokens
    return any(r.max_new_tokens - len(r.output) - r.in_flight > 1 for r in decodes)

  def _dispatch_multi(self, executor: Executor, rows: batching.StepRows,
                      steps: list[int]) -> None:
    """`steps[i]` decode steps of `rows.decodes[i]` (at most `decode_steps`) in one
    dispatch (the step has no chunks)."""
    k = self.config.decode_steps
    decodes = rows.decodes
    plan = batching.plan_rows(rows, self.config, num_tokens=self.config.max_batch,
                              sampling=getattr(executor, "samples", False))
    plan = self._with_carried(executor, plan, rows)
    seq_ids = np.asarray(plan.seq_ids)
    remaining = np.zeros(seq_ids.shape, np.int32)
    remaining[:len(decodes)] = steps
    pred = self.pool.predict_decode_steps(seq_ids, remaining, k)
    tokens, extra = self._call(
        executor, pred, lambda s: executor.decode_steps(s, plan, remaining, num_steps=k),
        len(decodes))
    status = pred.status  # [k, B]
    ran = np.zeros(seq_ids.shape, np.int32)
    stopped = np.zeros(seq_ids.shape, bool)
    failed = 0
    for j in range(k):
      live = (seq_ids >= 0) & (j < remaining) & ~stopped
      good = live & (status[j] == Status.OK)
      ran += good
      for i in np.flatnonzero(live & ~good).tolist():
        req = decodes[i]
        self._record_failure(req, int(status[j, i]), req.num_cached + int(ran[i]) + 1)
        failed += 1
      stopped |= live & ~good
    runs = ran.tolist()
    for i, req in enumerate(decodes):
      req.num_cached += runs[i]
      req.in_flight += runs[i]
      req.carry_row = i
    self.stats.decode_tokens += sum(runs)
    last = _last_tokens(tokens, ran) if getattr(executor, "uses_tokens", True) else None
    self._launch(executor, Flight(decodes=decodes, chunks=[], ok=[n > 0 for n in runs],
                                  first=[], epochs=[r.epoch for r in decodes], tokens=tokens,
                                  runs=ran, extra=extra, last=last), failed)

  # ------------------------------------------------------------------ dispatch helpers
  def _with_carried(self, executor: Executor, plan, rows: batching.StepRows):
    """`plan` with its decode rows' unread input tokens taken from the newest flight
    (`rows.carry`); every plan for an executor that carries tokens carries them, so
    both loops run the same programs."""
    carries = getattr(executor, "carries_tokens", False)
    if (not (self.config.overlap or carries)) or not getattr(executor, "uses_tokens", True):
      return plan
    src = np.full(np.shape(plan.tokens), -1, np.int32)
    src[:len(rows.carry)] = rows.carry
    prev = self.flights[-1].last if self.flights else self._placeholder(plan)
    carried = CarriedTokens(prev=prev, src=src)
    if carries:
      return dataclasses.replace(plan, carried=carried)
    self.pool.runtime.dispatch("data")
    return dataclasses.replace(plan, tokens=_resolve_carried(carried, plan.tokens))

  def _placeholder(self, plan):
    """A device `i32[B]` standing in for the carried tokens when no step is unread."""
    if self._prev is None:
      sharding = self.pool.unflushed_state.table.seq_len.sharding
      self._prev = jax.device_put(np.zeros(np.shape(plan.seq_ids), np.int32), sharding)
    return self._prev

  def _call(self, executor: Executor, pred: StepPrediction, call, num_rows: int):
    """Runs the executor on the reserved (or predicted) state and adopts what it
    returned: `(tokens, extra)`; the pool never loses its state, whatever is raised."""
    try:
      state, tokens, dev_status, *extra = call(pred.state)
    except BaseException as exc:
      # Raised after the donation: the executor's new state (else the old one stands).
      self.pool.abandon_step(attached_state(exc))
      raise
    try:
      if not isinstance(dev_status, (jax.Array, np.ndarray)):
        dev_status = np.asarray(dev_status)
      if isinstance(tokens, (list, tuple)):
        tokens = np.asarray(tokens)
      if np.shape(tokens)[-1] < num_rows or dev_status.shape[-1] < num_rows:
        raise InvalidArgument(f"executor returned {np.shape(tokens)[-1]} tokens / "
                              f"{dev_status.shape[-1]} statuses for {num_rows} rows")
      self.pool.adopt_step(state, pred, device_status=dev_status)
    except BaseException:
      if not pred.adopted:  # the pool never took the step's state: hand it over
        self.pool.abandon_step(state)
      raise
    return tokens, extra

  def _launch(self, executor: Executor, flight: Flight, failed: int) -> None:
    """Queues a dispatched step for reading, its tokens' copy to the host started."""
    if not getattr(executor, "uses_tokens", True):
      flight.last = None
    elif flight.last is not None:
      self._prev = flight.last
    copy = getattr(flight.tokens, "copy_to_host_async", None)
    if copy is not None:
      copy()
    self.flights.append(flight)
    if failed:
      # A row whose reservation failed keeps its pending token where it was: read
      # everything (the synchronous loop's state), then make room for the next step.
      self.drain()
      self.preemption.relieve(failed)

  def _relieve(self, blocks: int) -> None:
    """`Preemption.relieve`; swapping a sequence out needs its tokens read first."""
    if self.flights and self.config.preemption == "swap":
      self.drain()
    self.preemption.relieve(blocks)

  # ------------------------------------------------------------------ reading tokens
  def resolve(self, flight: Flight) -> None:
    """Reads a flight's tokens into its requests: outputs, streams, latencies, stops.
    A row whose request moved on since the dispatch (a later epoch) is dropped, and
    so is every token a row produced after a stop."""
    tokens = flight.tokens
    if not isinstance(tokens, np.ndarray):
      tokens = np.asarray(tokens)  # the one read a model step needs (started at dispatch)
      self.pool.runtime.read("tokens")
    logprobs = self._read_logprobs(flight)
    if len(flight.extra) > 1 and flight.runs is None:  # prompt logprobs (`prompt_positions`)
      self.pool.runtime.read("tokens")
      prompt_positions.store(flight.extra[1], flight.chunks, len(flight.decodes), flight.epochs)
    rec = self.record
    rec.now = self.clock()  # the tokens of this pass exist on the host from now
    decodes, epochs, ok = flight.decodes, flight.epochs, flight.ok
    if flight.runs is None:
      row_tokens = tokens.reshape(-1)[:len(decodes) + len(flight.chunks)].tolist()
      if logprobs is not None or not self._resolve_rows(flight, tokens):
        self._resolve_each(flight, row_tokens, logprobs)
      nd = len(decodes)
      for c, (req, _) in enumerate(flight.chunks):
        i = nd + c
        if not flight.first[c] or epochs[i] != req.epoch:
          continue
        req.in_flight -= 1
        self.emit(req, row_tokens[i])
        if req.stop_ids:
          is_finished(req)
        if logprobs is not None:
          self._append_logprobs(req, logprobs, None, i)
      return
    runs = flight.runs.tolist()
    for i, req in enumerate(decodes):
      if epochs[i] != req.epoch:
        continue
      for j in range(runs[i]):
        req.in_flight -= 1
        if req.stop_reason:
          continue
        self.emit(req, int(tokens[j, i]))
        if req.stop_ids:
          is_finished(req)
        if logprobs is not None:
          self._append_logprobs(req, logprobs, j, i)

  def _resolve_rows(self, flight: Flight, tokens: np.ndarray) -> bool:
    """A one-token flight's decode rows read in numpy passes (`RunningRows`); False,
    nothing done, when a row needs `emit`'s path (forced output, first token, moved)."""
    slots, decodes = flight.slots, flight.decodes
    nd = len(decodes)
    if slots is None:
      return False
    if not nd:
      return True
    t = self.queues.rows
    valid = flight.slot_ok.copy()
    moved = t.gen[slots] != flight.gens  # its request left the slot (finished, ...)
    if moved.any():
      for i in np.flatnonzero(moved & valid).tolist():
        if flight.epochs[i] == decodes[i].epoch:
          return False  # left without dropping its tokens: read them one at a time
      valid &= ~moved
    valid &= t.epoch[slots] == flight.slot_epochs
    emit = valid & ~t.stopped[slots]
    e = slots[emit]
    if t.forced[e].any() or not t.output_lengths(e).all():
      return False
    t.in_flight[slots[valid]] -= 1
    toks = tokens.reshape(-1)[:nd][emit].astype(np.int64)
    new = toks.tolist()
    any(map(list.append, t.out[e].tolist(), new))  # the one write per row
    t.n_out[e] += 1
    rec = self.record
    now = rec.now
    rec.add_rows(t.rid[e], new, now - t.last_token_time[e])
    t.last_token_time[e] = now
    hit = t.stop_hits(e, toks)
    if hit.any():
      for req in t.req[e[hit]].tolist():
        is_finished(req)
    return True

  def _resolve_each(self, flight: Flight, row_tokens: list, logprobs) -> None:
    """The decode rows of a one-token flight, one at a time (see `resolve`)."""
    decodes, epochs, ok = flight.decodes, flight.epochs, flight.ok
    rec = self.record
    now, itl, stream = rec.now, rec.inter_token_latencies, rec.tokens
    for i, req in enumerate(decodes):
      if not ok[i] or epochs[i] != req.epoch:
        continue
      req.in_flight -= 1
      if req.stop_reason:
        continue  # produced past a stop: dropped
      token = row_tokens[i]
      if req.forced_output is not None or req.first_token_step < 0:
        self.emit(req, token)
      else:  # `emit`'s common case, inlined
        req.output.append(token)
        RunningRows.appended(req)
        stream.append((req.request_id, token))
        itl.append(now - req.last_token_time)
        req.last_token_time = now
      if req.stop_ids and req.output[-1] in req.stop_ids:
        is_finished(req)
      if logprobs is not None:
        self._append_logprobs(req, logprobs, None, i)

  def emit(self, req: Request, token: int) -> None:
    """Appends `token` (or the request's forced one) to its output, with its latency."""
    if req.forced_output is not None:
      token = int(req.forced_output[len(req.output)])
    req.output.append(token)
    RunningRows.appended(req)
    rec = self.record
    rec.tokens.append((req.request_id, token))
    now = rec.now
    if req.first_token_step < 0:
      req.first_token_step = rec.step
      req.first_token_time = now
      rec.first_token_latencies.append(now - req.submit_time)
    else:
      rec.inter_token_latencies.append(now - req.last_token_time)
    req.last_token_time = now

  def _record_failure(self, req: Request, status: int, seq_len: int) -> None:
    """Counts a failed reservation; a full segment table ends the request (no retry helps)."""
    self.stats.record_status(np.array([status]), [seq_len])
    if status == Status.TABLE_FULL:
      req.stop_reason = "table_full"

  def _read_logprobs(self, flight: Flight) -> tuple | None:
    """The flight's logprobs on the host when a row asked for them (one more read)."""
    if not flight.extra or not self.config.max_logprobs:
      return None
    if not any(r.sampling is not None and r.sampling.logprobs
               for r in (*flight.decodes, *(r for r, _ in flight.chunks))):
      return None
    out = flight.extra[0]
    self.pool.runtime.read("tokens")
    return (np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs))

  @staticmethod
  def _append_logprobs(req: Request, logprobs: tuple, j: int | None, i: int) -> None:
    """The logprobs of the token `req` just emitted (row `i`, step `j` of k), if it asked."""
    sp = req.sampling
    if sp is None or not sp.logprobs or len(req.logprobs) >= len(req.output):
      return
    chosen, top_ids, top_lps = (a if j is None else a[j] for a in logprobs)
    n = sp.logprobs
    req.logprobs.append((float(chosen[i]), tuple(zip(top_ids[i, :n].tolist(),
                                                     top_lps[i, :n].tolist()))))
