"""`ForwardPass`: a scheduler step's ONE forward pass, and its tokens back on the host.

The step's rows (`batching`: decode tokens first, then prompt chunks) go to the
executor in one mixed batch. Before the call, the blocks the rows may take are
made free (eviction, then preemption: `Preemption.relieve`). The reservation the
step makes on the device is decided on the host mirror first (the same algorithm
on the same state, `BlockPool.predict_step`), so the host needs nothing back but
the sampled tokens (and logprobs when a row asked); the device's status is
compared with the prediction once the device is done. A row whose reservation
failed is counted (a full segment table ends its request) and its blocks are
relieved for the next step.
"""

from __future__ import annotations

import jax
import numpy as np

from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.serving import batching
from paged_kv.serving.executor import Executor, attached_state
from paged_kv.serving.eviction import Evictor
from paged_kv.serving.preemption import Preemption
from paged_kv.serving.request import Request, RequestQueues
from paged_kv.serving.scheduler_config import SchedulerConfig
from paged_kv.serving.step_report import SchedulerStats, StepRecord
from paged_kv.telemetry import metrics


class ForwardPass:
  """Builds, runs and records a step's forward pass (see the module docstring)."""

  def __init__(self, pool, config: SchedulerConfig, stats: SchedulerStats,
               counters: metrics.PoolCounters, evictor: Evictor, preemption: Preemption,
               queues: RequestQueues, record: StepRecord, clock):
    self.pool = pool
    self.config = config
    self.stats = stats
    self.counters = counters
    self.evictor = evictor
    self.preemption = preemption
    self.queues = queues
    self.record = record
    self.clock = clock

  def run(self, executor: Executor) -> None:
    """ONE forward pass: a decode token of every running sequence whose prompt is
    done, and the next prompt chunks under the budget, in one mixed batch."""
    running, config = self.queues.running, self.config
    decodes, chunks = batching.decode_batch(running), batching.prefill_chunks(running, config)
    if not decodes and not chunks:
      return
    need = batching.blocks_needed(decodes, chunks, self.pool.config.block_size)
    if not self.evictor.ensure_free(need):
      self.preemption.relieve(need - self.pool.num_free_blocks)
      decodes, chunks = batching.decode_batch(running), batching.prefill_chunks(running, config)
      if not decodes and not chunks:
        return
    plan = batching.build_plan(decodes, chunks, config,
                               sampling=getattr(executor, "samples", False))
    num_rows = len(decodes) + len(chunks)
    # The reservation the step makes on the device, decided on the host mirror first
    # (the same algorithm on the same state): the host needs nothing back but tokens.
    pred = self.pool.predict_step(plan.seq_ids, plan.num_new,
                                  max_new_tokens=plan.max_query_len)
    try:
      state, nxt, dev_status, *extra = executor.step(pred.state, plan)
    except BaseException as exc:
      # Raised after the donation: the executor's new state (else the old one stands).
      self.pool.abandon_step(attached_state(exc))
      raise
    try:
      if isinstance(nxt, jax.Array):  # sampled tokens: the one read a model step needs
        nxt = np.asarray(nxt)
        self.pool.runtime.read("tokens")
      nxt = np.asarray(nxt).reshape(-1)
      dev_status = (dev_status.reshape(-1) if isinstance(dev_status, jax.Array)
                    else np.asarray(dev_status).reshape(-1))
      if nxt.shape[0] < num_rows or dev_status.shape[0] < num_rows:
        raise InvalidArgument(f"executor returned {nxt.shape[0]} tokens / "
                              f"{dev_status.shape[0]} statuses for {num_rows} rows")
      self.pool.adopt_step(state, pred, device_status=dev_status)
      logprobs = self._read_logprobs(extra, decodes, chunks)
    except BaseException:
      if not pred.adopted:  # the pool never took the step's state: hand it over
        self.pool.abandon_step(state)
      raise
    self._record(pred.status, nxt, decodes, chunks, logprobs)

  def _record(self, status: np.ndarray, nxt: np.ndarray, decodes: list[Request],
              chunks: batching.Chunks, logprobs: tuple | None) -> None:
    """The step's results into its requests: cached tokens, outputs, latencies."""
    rec = self.record
    rec.now = self.clock()  # the tokens of this pass exist from now
    failed = 0
    bad = (status[:len(decodes)] != Status.OK).tolist()
    tokens = nxt[:len(decodes)].tolist()
    now, itl, stream = rec.now, rec.inter_token_latencies, rec.tokens
    for i, (req, is_bad, token) in enumerate(zip(decodes, bad, tokens)):
      if is_bad:
        self._record_failure(req, int(status[i]), req.num_cached + 1)
        failed += 1
        continue
      req.num_cached += 1
      if req.forced_output is not None or req.first_token_step < 0:
        self.emit(req, token)
      else:  # `emit`'s common case, inlined (O(batch) Python every step)
        req.output.append(token)
        stream.append((req.request_id, token))
        itl.append(now - req.last_token_time)
        req.last_token_time = now
    self.stats.decode_tokens += len(decodes) - failed
    for i, (req, n) in enumerate(chunks, start=len(decodes)):
      if status[i] != Status.OK:
        self._record_failure(req, int(status[i]), req.num_cached + n)
        failed += 1
        continue
      req.num_cached += n
      self.stats.prefill_tokens += n
      if req.num_cached == req.prefill_target and not req.output:
        self.emit(req, int(nxt[i]))
    if logprobs is not None:
      self._record_logprobs(logprobs, decodes, chunks)
    if failed:
      self.preemption.relieve(failed)

  def emit(self, req: Request, token: int) -> None:
    """Appends `token` (or the request's forced one) to its output, with its latency."""
    if req.forced_output is not None:
      token = int(req.forced_output[len(req.output)])
    req.output.append(token)
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
    self.counters.record_status(np.array([status]), [seq_len])
    if status == Status.TABLE_FULL:
      req.stop_reason = "table_full"

  def _read_logprobs(self, extra: list, decodes: list[Request],
                     chunks: batching.Chunks) -> tuple | None:
    """The step's `SampleOutput` on the host when a row asked for logprobs (one more
    read of this step's results, counted with the tokens), else None."""
    if not extra or not self.config.max_logprobs:
      return None
    if not any(r.sampling is not None and r.sampling.logprobs
               for r in (*decodes, *(r for r, _ in chunks))):
      return None
    out = extra[0]
    self.pool.runtime.read("tokens")
    return (np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs))

  @staticmethod
  def _record_logprobs(logprobs: tuple, decodes: list[Request], chunks: batching.Chunks) -> None:
    """Appends each emitted token's logprobs to its request (those that asked)."""
    chosen, top_ids, top_lps = logprobs
    rows = [(i, r) for i, r in enumerate(decodes)] + [
        (i, r) for i, (r, _) in enumerate(chunks, start=len(decodes))]
    for i, r in rows:
      sp = r.sampling
      if sp is None or not sp.logprobs or len(r.logprobs) >= len(r.output):
        continue  # nothing asked, or no token emitted for it in this step
      n = sp.logprobs
      r.logprobs.append((float(chosen[i]), tuple(zip(top_ids[i, :n].tolist(),
                                                     top_lps[i, :n].tolist()))))
