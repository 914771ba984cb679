"""Stateful property test of the block pool against a plain-Python model.

Random sequences of open / open-from-prefix / reserve+write / fork / release /
external pin & unpin (apply_ref_deltas) run on a small pool; after every step
the invariant checker runs and every live sequence's logical K/V must equal the
model's, bit for bit. Examples: 200 by default, `PAGED_KV_HYPOTHESIS_EXAMPLES`
raises it (soak runs).
"""

import os

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
import pytest

import paged_kv
from paged_kv.core.kv import token_slots

# Hypothesis state machines.
pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PAGED_KV_HYPOTHESIS_EXAMPLES", "200"))
CONFIG = paged_kv.PoolConfig(num_blocks=24, block_size=4, num_layers=2, num_kv_heads=1,
                             head_dim=2, max_seqs=6, max_segments=10)


def logical_kv(state: paged_kv.PoolState, seq: int) -> np.ndarray:
  """K values (layer 0, head 0, dim 0) of a sequence, read straight from the pages."""
  t = jax.tree.map(np.asarray, state.table)
  k = np.asarray(state.pages.k)
  out = []
  for s in range(int(t.num_segments[seq])):
    b, st_, ln = int(t.block[seq, s]), int(t.start[seq, s]), int(t.length[seq, s])
    out.extend(k[0, 0, b, st_:st_ + ln, 0].tolist())
  return np.array(out)


class PoolMachine(RuleBasedStateMachine):
  """Model: each live sequence is the list of token values it wrote."""

  def __init__(self):
    super().__init__()
    self.pool = paged_kv.BlockPool(CONFIG)
    self.model: dict[int, list[float]] = {}
    self.pins: list[tuple[int, int, int, list[float]]] = []  # external holders
    self.counter = 1.0

  def _new_values(self, n):
    vals = [self.counter + i for i in range(n)]
    self.counter += n
    return vals

  @precondition(lambda self: len(self.model) < CONFIG.max_seqs)
  @rule()
  def open_fresh(self):
    seq = self.pool.open_sequence()
    assert seq not in self.model
    self.model[seq] = []

  @precondition(lambda self: len(self.model) < CONFIG.max_seqs and any(self.model.values()))
  @rule(data=st.data())
  def open_from_prefix(self, data):
    src = data.draw(st.sampled_from(sorted(s for s, v in self.model.items() if v)))
    segs = self.pool.segments(src)
    p = data.draw(st.integers(1, len(segs)))
    seq = self.pool.open_sequence(segs[:p])
    self.model[seq] = self.model[src][:int(segs[:p, 2].sum())]

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def reserve_and_write(self, data):
    seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4,
                              unique=True))
    counts = data.draw(st.lists(st.integers(0, 9), min_size=len(seqs), max_size=len(seqs)))
    free_before = self.pool.num_free_blocks
    try:
      slots = self.pool.reserve_tokens(seqs, counts)
    except paged_kv.PoolExhausted:
      assert self.pool.num_free_blocks == free_before  # nothing applied
      return
    t = slots.shape[1]
    vals = np.zeros(slots.shape, np.float32)
    for i, (s, c) in enumerate(zip(seqs, counts)):
      new = self._new_values(c)
      vals[i, :c] = new
      self.model[s].extend(new)
    kv = jnp.broadcast_to(jnp.asarray(vals)[:, :, None, None], (len(seqs), t, 1, 2))
    for layer in range(CONFIG.num_layers):
      self.pool.write_kv(layer, slots, kv, -kv, seq_ids=seqs)

  @precondition(lambda self: self.model and len(self.model) < CONFIG.max_seqs)
  @rule(data=st.data())
  def fork(self, data):
    src = data.draw(st.sampled_from(sorted(self.model)))
    dst = self.pool.fork(src)
    self.model[dst] = list(self.model[src])

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def release(self, data):
    seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3,
                              unique=True))
    self.pool.release(seqs)
    for s in seqs:
      del self.model[s]

  @precondition(lambda self: any(self.model.values()))
  @rule(data=st.data())
  def pin_segment(self, data):
    """An outside holder (like a cache node) takes a reference on a live segment."""
    src = data.draw(st.sampled_from(sorted(s for s, v in self.model.items() if v)))
    blk, start, length = self.pool.segments(src).T
    i = data.draw(st.integers(0, len(blk) - 1))
    offset = int(length[:i].sum())
    self.pool.apply_ref_deltas([blk[i]], [1])
    self.pins.append((int(blk[i]), int(start[i]), int(length[i]),
                      self.model[src][offset:offset + int(length[i])]))

  @precondition(lambda self: self.pins)
  @rule(data=st.data())
  def unpin_segment(self, data):
    i = data.draw(st.integers(0, len(self.pins) - 1))
    b = self.pins.pop(i)[0]
    self.pool.apply_ref_deltas([b], [-1])

  @rule(data=st.data())
  def bad_call_changes_nothing(self, data):
    before = jax.tree.map(np.asarray, self.pool.state)
    inactive = sorted(set(range(CONFIG.max_seqs)) - set(self.model))
    choice = data.draw(st.integers(0, 3))
    try:
      if choice == 0 and inactive:
        self.pool.release([inactive[0]])
      elif choice == 1:
        self.pool.apply_ref_deltas([0, 1], [-1000, 0])
      elif choice == 2 and self.model:
        self.pool.reserve_tokens([min(self.model)], [CONFIG.num_slots + 1])
      else:
        self.pool.reserve_tokens([CONFIG.max_seqs], [1])
    except paged_kv.PagedKVError:
      pass
    else:
      raise AssertionError("a bad call was accepted")
    after = jax.tree.map(np.asarray, self.pool.state)
    jax.tree.map(np.testing.assert_array_equal, before, after)

  @invariant()
  def consistent(self):
    self.pool.check_invariants(extra_segments=[p[:3] for p in self.pins])
    assert sorted(self.pool.active_sequences().tolist()) == sorted(self.model)
    k = np.asarray(self.pool.state.pages.k)
    for seq, vals in self.model.items():
      np.testing.assert_array_equal(logical_kv(self.pool.state, seq), np.array(vals))
    for b, s, ln, vals in self.pins:
      np.testing.assert_array_equal(k[0, 0, b, s:s + ln, 0], np.array(vals))


PoolMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestPoolStateful = PoolMachine.TestCase
