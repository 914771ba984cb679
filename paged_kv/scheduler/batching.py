"""The rows of a scheduler step, decode tokens and prompt chunks, and their `StepPlan`.

Every running sequence whose prompt is done decodes one token; prompts still being
computed get chunks of at most `prefill_chunk` tokens, FCFS, under the step's
`prefill_token_budget`. Decode rows come first, then the chunks (tpu-inference's
convention). Pure functions of the requests and the config.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from paged_kv.model import ragged
from paged_kv.model.plan import StepPlan
from paged_kv.model.sampling import SamplingBatch
from paged_kv.scheduler import prompt_positions
from paged_kv.scheduler.request import Request
from paged_kv.scheduler.running_rows import RunningRows
from paged_kv.scheduler.scheduler_config import SchedulerConfig

Chunks = list[tuple[Request, int]]


@dataclasses.dataclass
class StepRows:
  """One step's rows, found in one pass over the running requests (`step_rows`).

  `decodes` (running order) then `chunks` `(request, tokens)`; for the decodes,
  `seq_ids`, their input tokens as the host knows them (`pending`), the row of the
  newest unread step holding each input token (`carry`, -1: the host knows it) and
  their `RunningRows` slots; `fresh_blocks`: the blocks the rows may take.
  """

  decodes: list[Request]
  chunks: Chunks
  seq_ids: list[int] | np.ndarray
  pending: list[int] | np.ndarray
  carry: list[int] | np.ndarray
  fresh_blocks: int
  slots: np.ndarray | None = None


def table_rows(table: RunningRows, running: list[Request], *, prefill_chunk: int,
               prefill_token_budget: int, block_size: int) -> StepRows:
  """`step_rows` from the running requests' hot arrays (`RunningRows`) in numpy passes:
  the same rows and stop reasons (Python only for chunks, stops and forced outputs)."""
  t = table
  order = t.sync(running)
  nc, target = t.num_cached[order], t.prefill_target[order]
  prefill = nc < target
  chunks: Chunks = []
  fresh = 0
  bs = block_size
  if prefill.any():
    budget = prefill_token_budget
    for i in np.flatnonzero(prefill).tolist():
      if budget <= 0:
        break
      a = int(nc[i])
      n = min(int(target[i]) - a, prefill_chunk, budget)
      chunks.append((running[i], n))
      budget -= n
      fresh += -(-(a + n) // bs) - -(-a // bs)
  live = ~prefill & ~t.stopped[order]
  flying = t.in_flight[order]
  n_out = t.output_lengths(order)
  max_new = t.max_new[order]
  idle = live & (flying == 0) & (n_out > 0)
  if idle.any():  # a read pending token: is the request done (`is_finished`)?
    at = np.flatnonzero(idle)
    long = n_out[at] >= max_new[at]
    last = t.last_tokens(order[at])
    stop = ~long & t.stop_hits(order[at], last)
    for i, why in ((at[long], "length"), (at[stop], "stop_token")):
      for r in [running[j] for j in i.tolist()]:
        r.stop_reason = why
    idle[at[long | stop]] = False
  else:
    last = np.zeros((0,), np.int64)
  dec = idle | (live & (flying > 0) & (n_out + flying < max_new))
  d = np.flatnonzero(dec)
  slots = order[d]
  pending = np.zeros(d.shape, np.int64)
  if last.size:
    pending[idle[d]] = last[idle[at]]
  carry = np.where(idle[d], -1, t.carry_row[slots])
  forced = np.flatnonzero(t.forced[slots] & ~idle[d])
  for i in forced.tolist():  # its input token is known before it is read
    r = t.req[slots[i]]
    pending[i] = int(r.forced_output[len(r.output) + r.in_flight - 1])
    carry[i] = -1
  fresh += int(np.count_nonzero(nc[d] % bs == 0))
  return StepRows(t.req[slots].tolist(), chunks, t.seq_id[slots], pending, carry, fresh,
                  slots)


def step_rows(running: list[Request], *, prefill_chunk: int, prefill_token_budget: int,
              block_size: int) -> StepRows:
  """The step's decode rows and prompt chunks (`decode_batch`, `prefill_chunks`), with
  what the plan needs of each decode row, in one pass (O(batch) Python every step)."""
  budget, bs = prefill_token_budget, block_size
  decodes, chunks, ids, pending, carry = [], [], [], [], []
  fresh = 0
  for r in running:
    num_cached, target = r.num_cached, r.prefill_target
    if num_cached < target:
      if budget > 0:
        n = min(target - num_cached, prefill_chunk, budget)
        chunks.append((r, n))
        budget -= n
        fresh += -(-(num_cached + n) // bs) - -(-num_cached // bs)
      continue
    if r.stop_reason:
      continue
    o = r.output
    flying = r.in_flight
    if not flying:
      if not o:
        continue
      if len(o) >= r.max_new_tokens:
        r.stop_reason = "length"
        continue
      token = o[-1]
      if r.stop_ids and token in r.stop_ids:
        r.stop_reason = "stop_token"
        continue
      src = -1
    elif len(o) + flying >= r.max_new_tokens:
      continue  # its last token is on the device: it finishes once read
    else:
      forced = r.forced_output
      if forced is None:
        token, src = 0, r.carry_row
      else:
        token, src = int(forced[len(o) + flying - 1]), -1
    decodes.append(r)
    ids.append(r.seq_id)
    pending.append(token)
    carry.append(src)
    if num_cached % bs == 0:
      fresh += 1
  return StepRows(decodes, chunks, ids, pending, carry, fresh)


def prefill_chunks(running: list[Request], config: SchedulerConfig) -> Chunks:
  """This step's prompt chunks `(request, tokens)`: FCFS under the token budget."""
  return step_rows(running, prefill_chunk=config.prefill_chunk,
                   prefill_token_budget=config.prefill_token_budget, block_size=1).chunks


def decode_batch(running: list[Request]) -> list[Request]:
  """The running requests with a token to decode (prompt done, tokens left, not
  finished: `is_finished` inlined, naming the stop reasons it finds)."""
  return step_rows(running, prefill_chunk=0, prefill_token_budget=0, block_size=1).decodes


def blocks_needed(decodes: list[Request], chunks: Chunks, block_size: int) -> int:
  """Fresh blocks the rows may take: decodes whose tail block is full, and the blocks
  the chunks spill into (a shared tail may need one more, found by the reservation)."""
  bs = block_size
  cdiv = lambda a: -(-a // bs)
  return (sum(1 for r in decodes if r.num_cached % bs == 0)
          + sum(cdiv(r.num_cached + n) - cdiv(r.num_cached) for r, n in chunks))


MAX_MIXED_WIDTHS = 6
"""Token widths of the mixed (prefill + decode) step programs, at most."""


def token_widths(config: SchedulerConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`(decode-only, mixed)` token widths of the step programs: `max_batch`; then the
  most a step holds and its halves down to `min_mixed_width` (`docs/serving_loop.md`)."""
  return _widths(config.max_batch, config.prefill_token_budget, config.min_mixed_width)


@functools.lru_cache(maxsize=64)
def _widths(max_batch: int, budget: int,
            min_width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`token_widths` of a config's fields (every step asks: computed once)."""
  top = max_batch + budget
  floor = min(top, max(16, max_batch, min_width))
  mixed = {top}
  for i in range(1, MAX_MIXED_WIDTHS):
    width = -(-top // (16 << i)) * 16  # top / 2^i, rounded up to a multiple of 16
    if width < floor:
      break
    if width < top:
      mixed.add(width)
  return (max_batch,), tuple(sorted(mixed))


def width_for(total: int, widths: tuple[int, ...]) -> int:
  """The smallest of `widths` (ascending) holding `total` tokens."""
  for w in widths:
    if w >= total:
      return w
  raise ValueError(f"{total} tokens exceed the widest step ({widths[-1]})")


def blocks_needed_for(decodes: list[Request], steps: list[int], block_size: int) -> int:
  """Fresh blocks `steps[i]` more decode tokens of each of `decodes` may take."""
  bs = block_size
  return sum(-(-(r.num_cached + n) // bs) - -(-r.num_cached // bs)
             for r, n in zip(decodes, steps))


def build_plan(decodes: list[Request], chunks: Chunks, config: SchedulerConfig, *,
               sampling: bool, num_tokens: int | None = None) -> StepPlan:
  """`StepPlan.build` of the step's rows (decodes, then chunks): `plan_rows` of them."""
  rows = StepRows(decodes, chunks, [r.seq_id for r in decodes],
                  [pending_token(r) for r in decodes], [], 0)
  return plan_rows(rows, config, sampling=sampling, num_tokens=num_tokens)


def plan_rows(rows: StepRows, config: SchedulerConfig, *, sampling: bool,
              num_tokens: int | None = None) -> StepPlan:
  """`StepPlan.build` of the step's rows (decodes, then chunks), from arrays: the same
  plan without `build`'s per-row checks and copies. `sampling`: attach the rows'
  `SamplingBatch` (and the chunks' `PromptPositions` when one asks); `num_tokens`
  defaults to `width_for` the total among `token_widths`."""
  decodes, chunks = rows.decodes, rows.chunks
  nd, num_rows = len(decodes), config.max_batch
  ids = np.full((num_rows,), -1, np.int32)
  num_new = np.zeros((num_rows,), np.int32)
  ids[:nd] = rows.seq_ids
  num_new[:nd] = 1
  ids[nd:nd + len(chunks)] = [r.seq_id for r, _ in chunks]
  num_new[nd:nd + len(chunks)] = [n for _, n in chunks]
  total = nd + sum(n for _, n in chunks)
  if num_tokens is None:
    decode, mixed = token_widths(config)
    num_tokens = width_for(total, mixed if chunks else decode)
  width = num_tokens
  tokens = np.zeros((width,), np.int32)  # the width StepPlan.build pads to
  tokens[:nd] = rows.pending
  pos = nd
  for r, n in chunks:
    a = r.num_cached
    tokens[pos:pos + n] = (r.prompt[a:a + n] if a + n <= r.prompt.size
                           else r.tokens[a:a + n])
    pos += n
  batch = sampling_batch(decodes, chunks, config.max_batch) if sampling else None
  prompt = (prompt_positions.positions(chunks, nd, config.prefill_token_budget)
            if sampling and chunks else None)
  return StepPlan(seq_ids=ids, num_new=num_new, tokens=tokens,
                  max_query_len=config.prefill_chunk if chunks else 1,
                  sampling=batch, num_logprobs=config.max_logprobs, prompt=prompt)


def pending_token(r: Request) -> int:
  """A decode row's input token as the host knows it: its last output (a forced one
  is known before it is read); 0 stands in for a token still on the device."""
  if not r.in_flight:
    return r.output[-1]
  if r.forced_output is not None:
    return int(r.forced_output[len(r.output) + r.in_flight - 1])
  return 0


def sampling_batch(decodes: list[Request], chunks: Chunks, num_rows: int) -> SamplingBatch:
  """The rows' sampling parameters (decodes, then chunks; padding rows greedy)."""
  batch = SamplingBatch.greedy(num_rows)
  rows = decodes + [r for r, _ in chunks]
  for i, r in enumerate(rows):
    sp = r.sampling
    if sp is not None:
      batch.set_row(i, sp, seed=r.sample_seed, index=len(r.output) + r.in_flight,
                    stop_ids=r.stop_ids, prompt_len=r.prompt.size)
  return batch
