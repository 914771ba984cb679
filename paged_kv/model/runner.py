"""The tiny Llama on a `paged_kv` pool: jitted prefill and decode steps, and host loops.

Device side (pure, jitted, pool state donated; `fn(params, state, ...) -> (state, out)`):

  * `prefill`      — one ragged chunk of prompt tokens per sequence: `reserve_tokens`,
                     then per layer `write_kv` and `pallas_kernels.prefill_attention`
                     (impl="xla": causal over the cached prefix plus the chunk),
                     then a greedy sample from the last token of each row.
  * `decode_step`  — one token per sequence: `reserve_tokens`, per layer `write_kv`
                     and `pallas_kernels.paged_attention` (impl="xla"), greedy sample.
  * `decode_multi` — `lax.scan` over `num_steps` decode steps in one jit: reserve,
                     write, attend and sample on device, no host round trip; rows stop
                     when their token budget is spent, on a stop token, or when a
                     reservation fails (the failure is in the returned status).

`params` / `graphdef` are `nnx.split(model)`; the graph definition (which holds the
`LlamaConfig`) is a static argument.

Host side (for tests, benchmarks and demos):

  * `PagedRunner` — opens sequences (optionally from another sequence's prefix
    segments, i.e. a cached prefix), prefills in chunks, decodes with k steps per
    call, forks, forces the next token of a branch, releases; keeps every
    sequence's token history and which tokens the model sampled.
  * `generate_paged` / `generate_dense` — greedy generation through the pool, and
    through the dense no-cache reference; `dense_mismatches` checks a paged
    history token for token against the reference. A `hook(runner, step)` runs
    before every decode call, where future features (compaction, swap, packing,
    eviction) can act on `runner.state`.

The step functions are generic model-serving code over the core API (only the
model call is specific); they live in `examples/` until the scheduler settles
whether they move into `paged_kv/`.

The kernels' `impl` is a static argument of every step (`"xla"` by default, the
CPU path; `"pallas"` runs the Pallas kernels, `interpret` on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import paged_kv
from paged_kv.core.errors import Status
from paged_kv.pool import raise_for_status
from paged_kv.core.state import KVPages, PoolState
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.prefill_attention import prefill_attention

from paged_kv.model import llama as tiny_llama

NO_STOP_TOKEN = -1


def pool_config_for(model_config: tiny_llama.LlamaConfig, **pool_kwargs) -> paged_kv.PoolConfig:
  """A `PoolConfig` whose layers, kv heads, head_dim and dtype match the model."""
  return paged_kv.PoolConfig(num_layers=model_config.num_layers,
                             num_kv_heads=model_config.num_kv_heads,
                             head_dim=model_config.head_dim, dtype=model_config.dtype,
                             **pool_kwargs)


def check_pool_matches_model(pool_config: paged_kv.PoolConfig,
                             model_config: tiny_llama.LlamaConfig) -> None:
  """Raises ValueError unless the pool holds this model's layers, kv heads and head_dim."""
  if (pool_config.num_layers, pool_config.num_kv_heads, pool_config.head_dim) != (
      model_config.num_layers, model_config.num_kv_heads, model_config.head_dim):
    raise ValueError(f"pool config {pool_config} does not match model config {model_config}")


# Ragged layout of prefill_attention -----------------------------------------------


def to_ragged(x: jax.Array, num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Padded `[B, T, ...]` rows to the ragged layout of `prefill_attention`.

  Returns `(flat [B*T, ...], cu_q_lens i32[B+1])`: row b's first `num_new[b]`
  entries at `cu_q_lens[b]:cu_q_lens[b+1]`, then zeros.
  """
  b, t = x.shape[:2]
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(num_new).astype(jnp.int32)])
  r = jnp.arange(b * t, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, b - 1)
  src = row * t + (r - cu[row])
  flat = x.reshape((b * t,) + x.shape[2:])[jnp.clip(src, 0, b * t - 1)]
  inside = (r < cu[b]).reshape((-1,) + (1,) * (x.ndim - 2))
  return jnp.where(inside, flat, jnp.zeros((), x.dtype)), cu


def from_ragged(flat: jax.Array, cu_q_lens: jax.Array, t: int) -> jax.Array:
  """Inverse of `to_ragged`: `[B*T, ...]` ragged to `[B, T, ...]` (padding = 0)."""
  b = cu_q_lens.shape[0] - 1
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  src = cu_q_lens[:-1, None] + i
  inside = src < cu_q_lens[1:, None]
  out = flat[jnp.clip(src, 0, flat.shape[0] - 1)]
  return jnp.where(inside.reshape(inside.shape + (1,) * (flat.ndim - 1)), out,
                   jnp.zeros((), flat.dtype))


def _row_of(seq_ids: jax.Array, config: paged_kv.PoolConfig) -> jax.Array:
  return jnp.clip(seq_ids, 0, config.max_seqs - 1)


# Device steps -------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "impl", "interpret"),
                   donate_argnames=("state",))
def prefill(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
            num_new: jax.Array, *, graphdef: nnx.GraphDef, config: paged_kv.PoolConfig,
            impl: str = "xla", interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """Prefills one ragged chunk per sequence and samples greedily after it.

  Args:
    params: model parameters (`nnx.split(model)[1]`).
    state: the pool (donated).
    seq_ids: `i32[B]` active rows (`-1` = padding).
    tokens: `i32[B, T]` the next `num_new[b]` prompt tokens of each row, padded.
    num_new: `i32[B]` tokens of the chunk per row (`0 <= . <= T`).
    graphdef: static model graph (`nnx.split(model)[0]`).
    config: static pool config (layers, heads, head_dim, dtype matching the model).
    impl: static kernel implementation ("xla" or "pallas").
    interpret: static; run Pallas kernels in interpret mode (CPU).

  Returns:
    `(state, (next_tokens i32[B], last_logits f32[B, vocab], status i32[B]))`:
    the greedy token after each row's chunk (`-1` for padding, empty chunks and
    failed rows), the logits it came from, and `reserve_tokens`' status.
  """
  model = nnx.merge(graphdef, params)
  b, t = tokens.shape
  row = _row_of(seq_ids, config)
  pos0 = state.table.seq_len[row]
  state, (slot_idx, status) = paged_kv.reserve_tokens(state, seq_ids, num_new, config=config,
                                                      max_new_tokens=t)
  ok = (status == Status.OK) & (seq_ids >= 0)
  positions = pos0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  q_lens = jnp.where(ok, num_new, 0)  # failed and padding rows: no queries
  table = state.table
  num_segments = jnp.where(ok, table.num_segments[row], 0)

  def attend(layer, q, k, v, pages: KVPages):
    pages = paged_kv.write_kv(pages, layer, slot_idx, k.astype(pages.k.dtype),
                              v.astype(pages.v.dtype))
    q_flat, cu_q_lens = to_ragged(q, q_lens)
    o = prefill_attention(q_flat, pages.k[layer], pages.v[layer], cu_q_lens, table.block[row],
                          table.start[row], table.length[row], num_segments, impl=impl,
                          interpret=interpret)
    return from_ragged(o, cu_q_lens, t), pages

  logits, pages = model(tokens, positions, attend, state.pages)
  last = jnp.clip(num_new - 1, 0, t - 1)
  last_logits = logits[jnp.arange(b), last]
  next_tokens = jnp.where(ok & (num_new > 0), jnp.argmax(last_logits, axis=-1), -1)
  state = dataclasses.replace(state, pages=pages)
  return state, (next_tokens.astype(jnp.int32), last_logits, status)


def _decode_body(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array, *,
                 graphdef: nnx.GraphDef, config: paged_kv.PoolConfig, impl: str = "xla",
                 interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One decode step, traced (shared by `decode_step` and `decode_multi`)."""
  model = nnx.merge(graphdef, params)
  row = _row_of(seq_ids, config)
  pos = state.table.seq_len[row]
  real = seq_ids >= 0
  state, (slot_idx, status) = paged_kv.reserve_tokens(
      state, seq_ids, real.astype(jnp.int32), config=config, max_new_tokens=1)
  ok = (status == Status.OK) & real
  table = state.table
  seg_block, seg_start, seg_length = table.block[row], table.start[row], table.length[row]
  num_segments = jnp.where(ok, table.num_segments[row], 0)

  def attend(layer, q, k, v, pages: KVPages):
    pages = paged_kv.write_kv(pages, layer, slot_idx, k.astype(pages.k.dtype),
                              v.astype(pages.v.dtype))
    o = paged_attention(q[:, 0], pages.k[layer], pages.v[layer], seg_block, seg_start,
                        seg_length, num_segments, impl=impl, interpret=interpret)
    return o[:, None], pages

  logits, pages = model(tokens[:, None], pos[:, None], attend, state.pages)
  logits = logits[:, 0]
  next_tokens = jnp.where(ok, jnp.argmax(logits, axis=-1), -1).astype(jnp.int32)
  return dataclasses.replace(state, pages=pages), (next_tokens, logits, status)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "impl", "interpret"),
                   donate_argnames=("state",))
def decode_step(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array, *,
                graphdef: nnx.GraphDef, config: paged_kv.PoolConfig, impl: str = "xla",
                interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One greedy decode step for a batch: reserve, write K/V, attend, sample.

  Args:
    params: model parameters.
    state: the pool (donated).
    seq_ids: `i32[B]` active rows (`-1` = padding).
    tokens: `i32[B]` each row's last sampled token (not yet in the cache).
    graphdef: static model graph.
    config: static pool config.
    impl, interpret: static kernel choice, as in `prefill`.

  Returns:
    `(state, (next_tokens i32[B], logits f32[B, vocab], status i32[B]))`;
    `next_tokens` is `-1` for padding and for rows whose reservation failed.
  """
  return _decode_body(params, state, seq_ids, tokens, graphdef=graphdef, config=config,
                      impl=impl, interpret=interpret)


@functools.partial(jax.jit, donate_argnames=("state",),
                   static_argnames=("graphdef", "config", "num_steps", "stop_token", "impl",
                                    "interpret"))
def decode_multi(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
                 remaining: jax.Array, *, graphdef: nnx.GraphDef, config: paged_kv.PoolConfig,
                 num_steps: int, stop_token: int = NO_STOP_TOKEN, impl: str = "xla",
                 interpret: bool = False) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """`num_steps` greedy decode steps in one jit (`lax.scan`), no host round trip.

  A row takes part in a step while it has budget left (`remaining > 0`); it stops
  after sampling `stop_token` (if not `-1`) or when its reservation fails, whose
  status is reported at that step.

  Args:
    params: model parameters.
    state: the pool (donated).
    seq_ids: `i32[B]` active rows (`-1` = padding).
    tokens: `i32[B]` each row's last sampled token (not yet in the cache).
    remaining: `i32[B]` tokens each row may still generate.
    graphdef: static model graph.
    config: static pool config.
    impl, interpret: static kernel choice, as in `prefill`.
    num_steps: static number of steps k.
    stop_token: static end-of-sequence token, `-1` for none.

  Returns:
    `(state, (new_tokens i32[k, B], status i32[k, B], last_tokens i32[B],
    remaining i32[B]))`: the token sampled by each row at each step (`-1` where
    the row did not run or failed), the reservation status of each step, each
    row's last sampled token and its remaining budget (0 after a stop or failure).
  """

  def body(carry, _):
    state, tokens, remaining = carry
    live = (seq_ids >= 0) & (remaining > 0)
    state, (sampled, _, status) = _decode_body(params, state, jnp.where(live, seq_ids, -1),
                                               tokens, graphdef=graphdef, config=config,
                                               impl=impl, interpret=interpret)
    ok = live & (status == Status.OK)
    stopped = sampled == stop_token if stop_token != NO_STOP_TOKEN else jnp.zeros_like(ok)
    remaining = jnp.where(ok & ~stopped, remaining - 1, jnp.where(live, 0, remaining))
    tokens = jnp.where(ok, sampled, tokens)
    return (state, tokens, remaining), (jnp.where(ok, sampled, -1), status)

  (state, tokens, remaining), (new_tokens, status) = jax.lax.scan(
      body, (state, tokens, jnp.asarray(remaining, jnp.int32)), None, length=num_steps)
  return state, (new_tokens, status, tokens, remaining)


# Host helpers --------------------------------------------------------------------------


def _bucket(x: int) -> int:
  """Smallest power of two >= max(x, 1) (bounds the number of compilations)."""
  return 1 << max(int(x) - 1, 0).bit_length()


def prefix_segments(state: PoolState, seq_id: int,
                    num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(block, start, length)` of the first `num_tokens` tokens of a live sequence.

  The last segment is cut at the token boundary (a segment table can start a
  sequence from any token of a block), which is how a radix-tree node split
  mid-block shares a prefix without copying.
  """
  t = state.table
  ns = int(t.num_segments[seq_id])
  blk, st, ln = (np.asarray(a[seq_id, :ns]) for a in (t.block, t.start, t.length))
  if not 0 <= num_tokens <= int(ln.sum()):
    raise ValueError(f"sequence {seq_id} has {int(ln.sum())} tokens, asked for {num_tokens}")
  out_b, out_s, out_l, left = [], [], [], num_tokens
  for b, s, l in zip(blk, st, ln):
    if left == 0:
      break
    take = min(int(l), left)
    out_b.append(int(b))
    out_s.append(int(s))
    out_l.append(take)
    left -= take
  as_i32 = lambda x: np.asarray(x, np.int32)
  return as_i32(out_b), as_i32(out_s), as_i32(out_l)


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
  """

  def __init__(self, model: tiny_llama.TinyLlama, pool_config: paged_kv.PoolConfig,
               state: PoolState | None = None, *, prefill_chunk: int = 64,
               stop_token: int = NO_STOP_TOKEN, impl: str = "xla", interpret: bool = False):
    check_pool_matches_model(pool_config, model.config)
    self.graphdef, self.params = nnx.split(model)
    self.config = pool_config
    self.state = paged_kv.init_pool(pool_config) if state is None else state
    self.prefill_chunk = prefill_chunk
    self.stop_token = stop_token
    self.kernel_args = dict(impl=impl, interpret=interpret)
    self.records: dict[int, SequenceRecord] = {}
    self._cached: dict[int, int] = {}  # tokens of each live sequence in the cache
    self._pending: dict[int, bool] = {}  # its last token is sampled/forced, not yet cached
    self._live: set[int] = set()
    self.preempted: set[int] = set()  # released rows that `resume` may reopen
    self._preempted_pending: dict[int, bool] = {}

  # -- queries ------------------------------------------------------------------------
  @property
  def live(self) -> list[int]:
    """Live sequence rows, ascending."""
    return sorted(self._live)

  def num_cached(self, seq_id: int) -> int:
    """Tokens of a live sequence whose K/V are in the pool."""
    return self._cached[seq_id]

  def segments(self, seq_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(block, start, length)` of a live sequence's cached tokens."""
    return prefix_segments(self.state, seq_id, self._cached[seq_id])

  def _free_row(self) -> int:
    for i in range(self.config.max_seqs):
      if i not in self._live and i not in self.preempted:
        return i
    raise paged_kv.PoolExhausted("no free sequence row", reason="no_free_row")

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
      segs = tuple(np.zeros((0,), np.int32) for _ in range(3))
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

  def _open_row(self, seq: int, segs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    p = len(segs[0])
    width = _bucket(p)
    pad = lambda a: np.pad(a, (0, width - p))[None].astype(np.int32)
    self.state, status = paged_kv.open_sequence(
        self.state, np.array([seq], np.int32), pad(segs[0]), pad(segs[1]), pad(segs[2]),
        np.array([p], np.int32), config=self.config, atomic=True)
    raise_for_status(status, "open_sequence")
    self._live.add(seq)
    self._cached[seq] = int(sum(segs[2]))

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
      self.state, (nxt, _, status) = prefill(self.params, self.state, ids, toks, num,
                                             graphdef=self.graphdef, config=self.config,
                                             **self.kernel_args)
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
      self.state, (nxt, _, status) = decode_step(self.params, self.state, ids, last,
                                                 graphdef=self.graphdef, config=self.config,
                                                 **self.kernel_args)
      new_tokens, status = np.asarray(nxt)[None], np.asarray(status)[None]
    else:
      self.state, (new_tokens, status, _, _) = decode_multi(
          self.params, self.state, ids, last, np.minimum(budget, k), graphdef=self.graphdef,
          config=self.config, num_steps=k, stop_token=self.stop_token, **self.kernel_args)
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
    self.state, status = paged_kv.fork(self.state, np.array([src], np.int32),
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
    self._open_row(seq_id, tuple(np.zeros((0,), np.int32) for _ in range(3)))
    self._pending[seq_id] = self._preempted_pending.pop(seq_id)
    self.preempted.discard(seq_id)
    self.prefill([seq_id])

  def release(self, seq_ids: Sequence[int]) -> None:
    """Ends sequences. Their records stay in `records` until the row is reused."""
    ids = np.asarray(list(seq_ids), np.int32)
    b = _bucket(ids.size)
    self.state, status = paged_kv.release(self.state, np.pad(ids, (0, b - ids.size),
                                                             constant_values=-1),
                                          config=self.config, atomic=True)
    raise_for_status(np.asarray(status)[:ids.size], "release")
    for s in ids.tolist():
      self._live.discard(s)
      del self._cached[s]
      del self._pending[s]


# One-call generation ---------------------------------------------------------------------


def generate_paged(model: tiny_llama.TinyLlama, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, *, pool_config: paged_kv.PoolConfig,
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


def generate_dense(model: tiny_llama.TinyLlama, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int) -> list[list[int]]:
  """Greedy generation through the dense reference (recomputes every sequence each step).

  Returns each prompt followed by its `max_new_tokens` greedy tokens.
  """
  seqs = [list(map(int, p)) for p in prompts]
  width = _bucket(max(len(s) for s in seqs) + max_new_tokens)
  for _ in range(max_new_tokens):
    toks = np.zeros((len(seqs), width), np.int32)
    lens = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
      toks[i, :len(s)] = s
    logits = np.asarray(tiny_llama.dense_forward(model, toks, lens))
    for i, s in enumerate(seqs):
      s.append(int(np.argmax(logits[i, len(s) - 1])))
  return seqs


def dense_mismatches(model: tiny_llama.TinyLlama,
                     records: Sequence[SequenceRecord]) -> list[tuple[int, int, int, int]]:
  """Positions where a paged sample differs from the dense greedy choice.

  Teacher-forces each record's token history through the dense reference and
  compares every model-sampled token with the reference's argmax after the
  tokens before it (forced tokens and prompts are inputs only). Equal to greedy
  dense generation token for token when the list is empty.

  Returns:
    `(record index, position, paged token, dense token)` per mismatch.
  """
  width = _bucket(max(len(r.tokens) for r in records))
  toks = np.zeros((len(records), width), np.int32)
  lens = np.array([len(r.tokens) for r in records], np.int32)
  for i, r in enumerate(records):
    toks[i, :len(r.tokens)] = r.tokens
  logits = np.asarray(tiny_llama.dense_forward(model, toks, lens))
  out = []
  for i, r in enumerate(records):
    for p in range(1, len(r.tokens)):
      if r.sampled[p]:
        want = int(np.argmax(logits[i, p - 1]))
        if want != r.tokens[p]:
          out.append((i, p, r.tokens[p], want))
  return out


class ModelExecutor:
  """The tiny model as a `paged_kv.serving.scheduler.Executor` (greedy sampling).

  Example:
    sched = Scheduler(pool, ModelExecutor(model, pool.config), SchedulerConfig(...))
  """

  def __init__(self, model: tiny_llama.TinyLlama, pool_config: paged_kv.PoolConfig, *,
               impl: str = "xla", interpret: bool = False):
    check_pool_matches_model(pool_config, model.config)
    self.graphdef, self.params = nnx.split(model)
    self.config = pool_config
    self.kernel_args = dict(impl=impl, interpret=interpret)

  def prefill(self, state: PoolState, seq_ids: np.ndarray, tokens: np.ndarray,
              num_new: np.ndarray) -> tuple[PoolState, np.ndarray, np.ndarray]:
    state, (nxt, _, status) = prefill(self.params, state, seq_ids, tokens, num_new,
                                      graphdef=self.graphdef, config=self.config,
                                      **self.kernel_args)
    return state, np.asarray(nxt), np.asarray(status)

  def decode(self, state: PoolState, seq_ids: np.ndarray,
             last_tokens: np.ndarray) -> tuple[PoolState, np.ndarray, np.ndarray]:
    state, (nxt, _, status) = decode_step(self.params, state, seq_ids, last_tokens,
                                          graphdef=self.graphdef, config=self.config,
                                          **self.kernel_args)
    return state, np.asarray(nxt), np.asarray(status)
