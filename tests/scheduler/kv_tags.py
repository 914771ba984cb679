"""Tagged K/V for scheduler tests: an executor that writes a known value per token.

`TaggingExecutor` takes the host's reservation like `DryExecutor`, then writes for
token `t` at position `p` of a request of tenant `n` the K/V `tags(n, t, p)`:
exact small integers in float32, so any read through segments can be checked bit
for bit. A cached prefix reused by another request of the same tenant holds the
same values (same tokens at the same positions); one reused across tenants, or a
slot another tenant left behind, shows the wrong tenant. It samples the next token
deterministically from the last one, inside the tenant's token range (or, with
`vocab`, among `vocab` ids every tenant shares, so a stop token fires in any
namespace), and checks, when the pool scrubs, that every slot it is handed reads
zero before it writes.

`check_tags(sched, tenant_of)` reads every live sequence's segments and every
cache node's segments from the pages and compares them with the tags;
`check_clear_slots_zero(pool)` checks that every slot no one was handed (bit
clear, or a free block) holds zeros, which scrubbing guarantees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import jax
import numpy as np

import paged_kv
from paged_kv.core import kv, sequences
from paged_kv.core.errors import Status
from paged_kv.model import metadata
from paged_kv.scheduler.executor import reserved_growth

TAG_DIM = 4  # head_dim of the pools these helpers serve
TOKENS_PER_TENANT = 1000


def tags(tenant: int, tokens: np.ndarray, positions: np.ndarray, layer: int = 0) -> np.ndarray:
  """`f32[T, TAG_DIM]`: the K of each token (V is its negative). Never zero."""
  tokens = np.asarray(tokens, np.int64)
  positions = np.asarray(positions, np.int64)
  mix = (tokens * 7 + positions * 13 + tenant * 31 + layer * 101) % 4093
  return np.stack([tokens + 1, positions + 1, np.full_like(tokens, tenant + 1), mix + 1],
                  axis=-1).astype(np.float32)


def next_token(tenant: int, token: int, position: int, vocab: int | None = None) -> int:
  """The token the executor samples after `token` at `position`: in the tenant's range,
  or with `vocab` in `[0, vocab)` (the same ids for every tenant)."""
  mix = int(token) * 31 + int(position) * 17 + 7
  if vocab:
    return mix % vocab
  return tenant * TOKENS_PER_TENANT + mix % TOKENS_PER_TENANT


class TaggingExecutor:
  """`DryExecutor` plus K/V writes of `tags`; set `.sched` once the scheduler exists.

  `vocab`: sample among `vocab` ids shared by all tenants (`next_token`), e.g. so
  that a `SchedulerConfig.stop_token` below it fires; None: the tenant's range.
  """

  def __init__(self, config: paged_kv.PoolConfig, tenant_of: Callable[[Hashable], int],
               vocab: int | None = None):
    if config.head_dim != TAG_DIM:
      raise ValueError(f"TaggingExecutor needs head_dim={TAG_DIM}")
    self.config = config
    self.tenant_of = tenant_of
    self.vocab = vocab
    self.sched = None
    self.steps = 0
    self.tokens_written = 0
    self.multi_steps = 0  # `decode_steps` calls
    self._grow = reserved_growth(config)

  def step(self, state, plan):
    """Writes the tags into the host's reservation (`plan.reserved`, the in-place
    growth applied first), as the `Executor` contract says."""
    c = self.config
    seq_ids = np.asarray(plan.seq_ids)
    num_new = np.asarray(plan.num_new)
    tokens = np.asarray(plan.tokens)
    reserved = plan.reserved
    state = self._grow(state, plan)
    mapping, status = np.asarray(reserved.slot_mapping), np.asarray(reserved.status)
    # Each row's first new position: its length less what this step reserved.
    base = np.asarray(state.table.seq_len)[np.clip(seq_ids, 0, c.max_seqs - 1)]
    base = base - np.where(status == Status.OK, num_new, 0)
    if c.scrub_freed_blocks:
      # Every slot handed out reads zero before its new owner writes it.
      used = mapping[mapping >= 0]
      k_flat = np.asarray(state.pages.k).reshape(c.num_layers, c.num_kv_heads, -1, c.head_dim)
      leaked = k_flat[:, :, used]
      if np.any(leaked != 0):
        bad = used[np.any(leaked != 0, axis=(0, 1, 3))]
        raise AssertionError(f"slots {bad.tolist()} were handed out holding K/V "
                             f"{k_flat[0, 0, bad].tolist()}")
    by_seq = {r.seq_id: r for r in self.sched.running}
    cu = np.concatenate([[0], np.cumsum(num_new)])
    k = np.zeros((c.num_layers,) + mapping.shape + (c.num_kv_heads, c.head_dim), np.float32)
    nxt = np.zeros(seq_ids.shape, np.int32)
    for b, sid in enumerate(seq_ids.tolist()):
      n = int(num_new[b])
      if sid < 0 or n == 0:
        continue
      toks = tokens[cu[b]:cu[b + 1]]
      pos = int(base[b]) + np.arange(n)
      tenant = self.tenant_of(by_seq[sid].namespace)
      nxt[b] = next_token(tenant, toks[-1], pos[-1], self.vocab)
      if status[b] != Status.OK:
        continue
      assert (mapping[cu[b]:cu[b + 1]] >= 0).all()
      for layer in range(c.num_layers):
        k[layer, cu[b]:cu[b + 1]] = tags(tenant, toks, pos, layer)[:, None, :]
      self.tokens_written += n
    pages = state.pages
    for layer in range(c.num_layers):
      pages = kv.jit_write_kv(pages, np.int32(layer), mapping, k[layer], -k[layer])
    self.steps += 1
    return dataclasses.replace(state, pages=pages), nxt, status

  def decode_steps(self, state, plan, remaining, *, num_steps: int):
    """`num_steps` one-token steps (the `Executor.decode_steps` contract): step j
    reserves on the device for the rows with steps left whose reservations all
    succeeded, each writing the tags of its input token (the plan's at j = 0, then
    the one it sampled) and sampling the next. Returns `(state, tokens i32[k, B],
    status i32[k, B])`."""
    self.multi_steps += 1
    seq_ids = np.asarray(plan.seq_ids)
    remaining = np.asarray(remaining)
    b = seq_ids.shape[0]
    tokens = np.asarray(plan.tokens)[:b].astype(np.int32)  # a decode plan: row i's is i
    out = np.zeros((num_steps, b), np.int32)
    statuses = np.zeros((num_steps, b), np.int32)
    stopped = np.zeros((b,), bool)
    for j in range(num_steps):
      live = (seq_ids >= 0) & (j < remaining) & ~stopped
      ragged = np.zeros((b,), np.int32)
      ragged[:int(live.sum())] = tokens[live]  # the live rows' tokens, in row order
      step_plan = dataclasses.replace(plan, seq_ids=np.where(live, seq_ids, -1).astype(np.int32),
                                      num_new=live.astype(np.int32), tokens=ragged)
      state, (slot_idx, status) = sequences.reserve_tokens(
          state, step_plan.seq_ids, step_plan.num_new, config=self.config, max_new_tokens=1)
      step_plan = dataclasses.replace(step_plan, reserved=metadata.reserved_slots(
          step_plan, np.asarray(slot_idx), np.asarray(status)))
      state, nxt, status = self.step(state, step_plan)
      status = np.where(live, np.asarray(status), Status.OK)
      statuses[j] = status
      out[j] = np.where(live, nxt, 0)
      stopped |= live & (status != Status.OK)
      tokens = np.where(live & (status == Status.OK), nxt, tokens).astype(np.int32)
    return state, out, statuses


def _segment_slots(segs: np.ndarray, block_size: int) -> np.ndarray:
  if not len(segs):
    return np.zeros((0,), np.int64)
  return np.concatenate([np.arange(b * block_size + s, b * block_size + s + l)
                         for b, s, l in np.asarray(segs, np.int64)])


def check_tags(sched, tenant_of: Callable[[Hashable], int]) -> int:
  """Every running sequence and every cache node reads back its tags, bit-exact.

  Returns the number of tokens checked. Raises AssertionError naming the first
  mismatch (and the tenant whose values were found there).
  """
  pool = sched.pool
  c = pool.config
  bs = c.block_size
  k_flat = np.asarray(pool.state.pages.k).reshape(c.num_layers, c.num_kv_heads, -1, c.head_dim)
  v_flat = np.asarray(pool.state.pages.v).reshape(k_flat.shape)
  table = jax.tree.map(np.asarray, pool.state.table)
  checked = 0

  def compare(what: str, tenant: int, toks: np.ndarray, positions: np.ndarray,
              slots: np.ndarray) -> None:
    for layer in range(c.num_layers):
      want = tags(tenant, toks, positions, layer)
      got_k = k_flat[layer, :, slots]  # [T, H, D]
      got_v = v_flat[layer, :, slots]
      ok = np.all(got_k == want[:, None, :], axis=(1, 2)) & np.all(
          got_v == -want[:, None, :], axis=(1, 2))
      if not ok.all():
        i = int(np.argmin(ok))
        raise AssertionError(
            f"{what}: token {i} (id {int(toks[i])}, position {int(positions[i])}, tenant "
            f"{tenant}) at slot {int(slots[i])} layer {layer} holds K {got_k[i, 0].tolist()} "
            f"(tenant {int(got_k[i, 0, 2]) - 1}), expected {want[i].tolist()}")

  for req in sched.running:
    sid = req.seq_id
    assert table.active[sid], f"request {req.request_id}: row {sid} not active"
    ns = int(table.num_segments[sid])
    segs = np.stack([table.block[sid, :ns], table.start[sid, :ns], table.length[sid, :ns]], 1)
    slots = _segment_slots(segs, bs)
    length = int(table.seq_len[sid])
    assert slots.shape[0] == length, (req.request_id, slots.shape, length)
    assert length == req.num_cached, (req.request_id, length, req.num_cached)
    # The overlapped loop's k-step dispatch caches tokens the host reads a step later:
    # those positions are checked once their ids are known.
    known = min(length, int(req.prompt.size) + len(req.output))
    compare(f"request {req.request_id!r} (row {sid})", tenant_of(req.namespace),
            req.tokens[:known], np.arange(known), slots[:known])
    checked += known
  cache = sched.cached_pool.cache
  if cache is not None:
    for node in cache.tree.nodes():
      path = cache.tree.path_tokens(node.node_id)
      first = path.shape[0] - node.num_tokens
      slots = _segment_slots(node.value, bs)
      assert slots.shape[0] == node.num_tokens
      compare(f"cache node {node.node_id} ({node.namespace!r})", tenant_of(node.namespace),
              path[first:], first + np.arange(node.num_tokens), slots)
      checked += node.num_tokens
  return checked


def check_clear_slots_zero(pool: paged_kv.BlockPool) -> None:
  """Scrubbing: every slot not handed out (bit clear; all of a free block) holds zeros."""
  c = pool.config
  meta = jax.tree.map(np.asarray, pool.state.meta)
  bits = np.asarray(sequences.slot_bits(pool.state.meta.slots, c.block_size))  # [N, bs]
  bits = bits & (meta.ref_count > 0)[:, None]
  for name, pages in (("k", pool.state.pages.k), ("v", pool.state.pages.v)):
    p = np.asarray(pages)  # [L, H, N, bs, D]
    dirty = np.any(p != 0, axis=(0, 1, 4)) & ~bits
    if dirty.any():
      blk, slot = (int(x[0]) for x in np.nonzero(dirty))
      raise AssertionError(f"{name}: slot {slot} of block {blk} (ref_count "
                           f"{int(meta.ref_count[blk])}) is not handed out but holds "
                           f"{p[0, 0, blk, slot].tolist()}")
