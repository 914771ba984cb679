"""`paged_attention` on a mixed batch (prefill chunks + decodes) against a dense jnp reference.

The pool's pages start as NaN, so a read of any slot outside a row's segments
poisons the output; rows have cached prefixes, one shares another's prefix cut
inside a block (a segment with `start > 0` on a shared block). The reference keeps
every row's logical K/V itself and runs a float64 causal softmax.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.core import sequences
from paged_kv.core.errors import InvalidArgument
from paged_kv.model import StepMetadata, StepPlan, default_impl, paged_attention

CFG = paged_kv.PoolConfig(num_blocks=24, block_size=4, num_layers=2, num_kv_heads=2,
                          head_dim=8, max_seqs=6, max_segments=8)
NUM_Q_HEADS = 4
LAYER = 1


def _rand(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


class _Pool:
  """A pool plus every row's logical K/V of `LAYER` (numpy), kept in step."""

  def __init__(self, rng):
    self.rng = rng
    state = paged_kv.init_pool(CFG)
    nan = lambda: jnp.full(state.pages.k.shape, jnp.nan, jnp.float32)
    self.state = dataclasses.replace(state, pages=paged_kv.KVPages(k=nan(), v=nan()))
    self.kv = {}

  def open(self, seq, src=None, num_shared=0):
    if src is None:
      blk = st = ln = np.zeros((1, 1), np.int32)
      p = 0
    else:
      t = self.state.table
      take, left = [], num_shared
      for s in range(int(t.num_segments[src])):
        n = min(int(t.length[src, s]), left)
        if n:
          take.append((int(t.block[src, s]), int(t.start[src, s]), n))
        left -= n
      blk, st, ln = (np.array([[x[i] for x in take]], np.int32) for i in range(3))
      p = len(take)
    self.state, status = sequences.open_sequence(self.state, np.array([seq], np.int32), blk, st,
                                                ln, np.array([p], np.int32), config=CFG)
    assert int(status[0]) == 0
    k, v = (self.kv[src][0][:num_shared], self.kv[src][1][:num_shared]) if src is not None else (
        np.zeros((0, CFG.num_kv_heads, CFG.head_dim), np.float32),) * 2
    self.kv[seq] = (k, v)

  def append(self, seq, n):
    """Caches `n` random tokens of K/V (every layer) for `seq`."""
    self.state, (slots, status) = sequences.reserve_tokens(
        self.state, np.array([seq], np.int32), np.array([n], np.int32), config=CFG,
        max_new_tokens=16)
    assert int(status[0]) == 0
    pages = self.state.pages
    for layer in range(CFG.num_layers):
      k = _rand(self.rng, 1, 16, CFG.num_kv_heads, CFG.head_dim)
      v = _rand(self.rng, 1, 16, CFG.num_kv_heads, CFG.head_dim)
      pages = paged_kv.write_kv(pages, layer, slots, jnp.asarray(k), jnp.asarray(v))
      if layer == LAYER:
        old_k, old_v = self.kv[seq]
        self.kv[seq] = (np.concatenate([old_k, k[0, :n]]), np.concatenate([old_v, v[0, :n]]))
    self.state = dataclasses.replace(self.state, pages=pages)


def _mixed_step(rng, *, decode_only=False):
  """A pool with history and a step plan over it; returns (pool, plan, meta, q, k, v)."""
  pool = _Pool(rng)
  pool.open(0)
  pool.append(0, 9)
  pool.open(1)
  pool.append(1, 6)
  pool.open(2, src=0, num_shared=6)  # shares row 0's first 6 tokens, cut inside a block
  pool.open(3)
  pool.append(3, 3)
  pool.open(4)
  if decode_only:
    rows = [(0, [1]), (2, [1]), (3, [1])]
    plan = StepPlan.build(rows, num_rows=5, max_query_len=1)
  else:
    # Decodes of rows 0 and 3; chunks on top of a cached prefix (1), on a shared
    # prefix (2), and from nothing (4).
    rows = [(0, [1]), (3, [1]), (1, [1] * 5), (2, [1] * 3), (4, [1] * 7)]
    plan = StepPlan.build(rows, num_rows=6, max_query_len=8)
  state, (slot_idx, status) = sequences.reserve_tokens(
      pool.state, plan.seq_ids, plan.num_new, config=CFG, max_new_tokens=plan.max_query_len)
  np.testing.assert_array_equal(status, 0)
  pool.state = state
  meta = StepMetadata.from_plan(plan, state.table, np.asarray(slot_idx))
  t = plan.num_tokens
  q = _rand(rng, t, NUM_Q_HEADS, CFG.head_dim)
  k = _rand(rng, t, CFG.num_kv_heads, CFG.head_dim)
  v = _rand(rng, t, CFG.num_kv_heads, CFG.head_dim)
  return pool, plan, meta, q, k, v


def _reference(pool, plan, q, k, v):
  """Float64 causal attention of every token over its row's logical K/V (+ the new ones)."""
  out = np.zeros(q.shape, np.float64)
  cu = np.concatenate([[0], np.cumsum(plan.num_new)])
  group = NUM_Q_HEADS // CFG.num_kv_heads
  for b, seq in enumerate(np.asarray(plan.seq_ids)):
    if seq < 0:
      continue
    lo, hi = cu[b], cu[b + 1]
    keys = np.concatenate([pool.kv[seq][0], k[lo:hi]]).astype(np.float64)
    vals = np.concatenate([pool.kv[seq][1], v[lo:hi]]).astype(np.float64)
    cached = len(pool.kv[seq][0])
    for i, tok in enumerate(range(lo, hi)):
      visible = cached + i + 1
      for h in range(NUM_Q_HEADS):
        kh = h // group
        logits = keys[:visible, kh] @ q[tok, h].astype(np.float64) / np.sqrt(CFG.head_dim)
        p = np.exp(logits - logits.max())
        out[tok, h] = (p / p.sum()) @ vals[:visible, kh]
  return out


class PagedAttentionTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("xla", "xla"), ("pallas", "pallas"))
  def test_mixed_batch_matches_dense_reference(self, impl):
    pool, plan, meta, q, k, v = _mixed_step(np.random.default_rng(0))
    fn = self.variant(lambda q, k, v, pages, meta: paged_attention(q, k, v, pages, LAYER, meta,
                                                                   impl=impl))
    pages, out = fn(q, k, v, pool.state.pages, meta)
    want = _reference(pool, plan, q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    # The new K/V were written where the metadata says, in LAYER only.
    slots = np.asarray(meta.slot_mapping)
    live = slots >= 0
    bs = CFG.block_size
    got_k = np.asarray(pages.k)[LAYER, :, slots[live] // bs, slots[live] % bs]
    np.testing.assert_array_equal(got_k, k[live])
    other = np.asarray(pages.k)[0, :, slots[live] // bs, slots[live] % bs]
    self.assertTrue(np.isnan(other).all())

  @parameterized.named_parameters(("xla", "xla"), ("pallas", "pallas"))
  def test_mixed_batch_in_one_launch_matches_dense_reference(self, impl):
    """`mixed_launches=1`: every row, decodes included (one-token rows), through
    the prefill kernel; the same numbers and writes as two launches."""
    pool, plan, meta, q, k, v = _mixed_step(np.random.default_rng(0))
    fn = jax.jit(lambda q, k, v, pages, meta, n: paged_attention(
        q, k, v, pages, LAYER, meta, impl=impl, mixed_launches=n), static_argnums=5)
    pages, out = fn(q, k, v, pool.state.pages, meta, 1)
    np.testing.assert_allclose(np.asarray(out), _reference(pool, plan, q, k, v),
                               rtol=2e-5, atol=2e-5)
    pages2, _ = fn(q, k, v, pool.state.pages, meta, 2)
    np.testing.assert_array_equal(np.asarray(pages.k), np.asarray(pages2.k))
    for n, kernels in ((1, {"prefill_attention"}),
                       (2, {"decode_attention", "prefill_attention"})):
      jaxpr = str(jax.make_jaxpr(functools.partial(fn, n=n))(q, k, v, pool.state.pages, meta))
      self.assertEqual(kernels & set(re.findall(r"name=(\w+)", jaxpr)), kernels)
      self.assertEqual(n == 2, "name=decode_attention" in jaxpr)
    with self.assertRaises(InvalidArgument):
      paged_attention(q, k, v, pool.state.pages, LAYER, meta, impl=impl, mixed_launches=3)

  def test_prefill_impl_overrides_the_prefill_kernel_only(self):
    """`prefill_impl` picks the prefill kernel's impl apart from `impl`: the
    same numbers; an unknown name raises."""
    pool, plan, meta, q, k, v = _mixed_step(np.random.default_rng(2))
    _, out = paged_attention(q, k, v, pool.state.pages, LAYER, meta, impl="xla",
                             prefill_impl="pallas")
    np.testing.assert_allclose(np.asarray(out), _reference(pool, plan, q, k, v),
                               rtol=2e-5, atol=2e-5)
    jaxpr = str(jax.make_jaxpr(lambda q: paged_attention(
        q, k, v, pool.state.pages, LAYER, meta, impl="xla", prefill_impl="pallas")[1])(q))
    self.assertIn("pallas_call", jaxpr)  # the prefill kernel (decode stays xla)
    with self.assertRaises(InvalidArgument):
      paged_attention(q, k, v, pool.state.pages, LAYER, meta, prefill_impl="triton")

  @chex.variants(with_jit=True, without_jit=True)
  def test_decode_only_step_matches_dense_reference(self):
    pool, plan, meta, q, k, v = _mixed_step(np.random.default_rng(1), decode_only=True)
    self.assertEqual(meta.max_query_len, 1)
    fn = self.variant(lambda q, k, v, pages, meta: paged_attention(q, k, v, pages, LAYER, meta))
    _, out = fn(q, k, v, pool.state.pages, meta)
    np.testing.assert_allclose(np.asarray(out), _reference(pool, plan, q, k, v), rtol=2e-5,
                               atol=2e-5)

  def test_bad_inputs_raise_typed_errors(self):
    pool, _, meta, q, k, v = _mixed_step(np.random.default_rng(2))
    pages = pool.state.pages
    with self.assertRaisesRegex(InvalidArgument, "k and v"):
      paged_attention(q, k[:, :1], v[:, :1], pages, LAYER, meta)
    with self.assertRaisesRegex(InvalidArgument, "q must be"):
      paged_attention(q[:3], k, v, pages, LAYER, meta)
    with self.assertRaisesRegex(InvalidArgument, "layer"):
      paged_attention(q, k, v, pages, CFG.num_layers, meta)
    with self.assertRaisesRegex(InvalidArgument, "impl"):
      paged_attention(q, k, v, pages, LAYER, meta, impl="cuda")

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("xla", "xla"), ("pallas", "pallas"))
  def test_traced_layer_and_scan_over_layers(self, impl):
    """A traced layer (the stacked pages and the index go to the kernels) and a
    `lax.scan` over layers give the same output as the static layer."""
    pool, plan, meta, q, k, v = _mixed_step(np.random.default_rng(3))
    kw = dict(impl=impl, num_splits=2)
    want_pages, want = paged_attention(q, k, v, pool.state.pages, LAYER, meta, **kw)
    traced = self.variant(lambda layer, q, k, v, pages, meta: paged_attention(
        q, k, v, pages, layer, meta, **kw))
    pages, out = traced(jnp.int32(LAYER), q, k, v, pool.state.pages, meta)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pages.k), np.asarray(want_pages.k))

    def scan(q, k, v, pages, meta):
      def body(pages, layer):
        return paged_attention(q, k, v, pages, layer, meta, **kw)
      return jax.lax.scan(body, pages, jnp.arange(CFG.num_layers, dtype=jnp.int32))

    pages, outs = self.variant(scan)(q, k, v, pool.state.pages, meta)
    np.testing.assert_allclose(np.asarray(outs[LAYER]), np.asarray(want), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(outs[LAYER]), _reference(pool, plan, q, k, v),
                               rtol=2e-5, atol=2e-5)

  def test_default_impl_per_backend(self):
    self.assertEqual(default_impl("cpu"), "xla")
    self.assertEqual(default_impl("gpu"), "mosaic")  # without a shape: the first choice
    with self.assertRaisesRegex(InvalidArgument, "tpu"):
      default_impl("tpu")
    self.assertEqual(default_impl(), default_impl(jax.default_backend()))
    with self.assertRaisesRegex(InvalidArgument, "preference"):
      default_impl("gpu", preference=("triton",))

  def test_default_impl_per_shape_falls_back_with_one_warning(self):
    """On a GPU, the first of Mosaic, Triton, xla that builds; each fallback
    warns once with the reason; a valid model shape never raises."""
    from paged_kv.model import attention
    attention._warned.clear()
    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                 dtype=jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      self.assertEqual(default_impl("cuda", **shape), "mosaic")
      self.assertEqual(default_impl("cuda", **dict(shape, q_dtype=jnp.float32)), "pallas")
      phi3 = dict(shape, num_kv_heads=32, head_dim=96)
      self.assertEqual(default_impl("cuda", **phi3), "xla")
      self.assertEqual(default_impl("cuda", **phi3), "xla")
      self.assertEqual(default_impl("cuda", **phi3, preference=("pallas", "xla")), "xla")
      # Gemma's head_dim 256: Mosaic (two warpgroups; no spill in the compile tier).
      self.assertEqual(default_impl("cuda", **dict(shape, head_dim=256)), "mosaic")
      # head_dim 192: Mosaic builds but spills registers (compile tier), Triton needs a
      # power of two: xla.
      self.assertEqual(default_impl("cuda", **dict(shape, head_dim=192)), "xla")
    msgs = [str(w.message) for w in caught]
    self.assertEqual(len(msgs), 4, msgs)  # the repeated call does not warn again
    self.assertIn("spills registers", msgs[3])
    self.assertIn("head_dim 192", msgs[3])
    self.assertIn("needs q in the pages' dtype", msgs[0])
    self.assertIn("impl='pallas'", msgs[0])
    self.assertIn("multiple of 64", msgs[1])
    self.assertIn("power-of-two head_dim", msgs[1])
    self.assertIn("impl='xla'", msgs[1])

  def test_default_impl_head_dim_64_and_fp8_pages(self):
    """Llama-3.2-1B's head_dim 64 gets Mosaic (128-key stages); fp8 pages, which
    Mosaic builds for but which are untimed on a GPU, keep Triton, with a
    warning that says why."""
    from paged_kv.model import attention
    attention._warned.clear()
    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=64, block_size=16,
                 dtype=jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      self.assertEqual(default_impl("cuda", **shape), "mosaic")
      fp8 = dict(shape, head_dim=128, dtype=jnp.float8_e4m3fn, q_dtype=jnp.bfloat16)
      self.assertEqual(default_impl("cuda", **fp8), "pallas")
    msgs = [str(w.message) for w in caught]
    self.assertEqual(len(msgs), 1, msgs)
    self.assertIn("untimed", msgs[0])


# Only the variant without jit (op by op) is slow; chex generates it from a
# method above, so it is marked by its generated name.
pytest.mark.slow(PagedAttentionTest.test_mixed_batch_matches_dense_reference_pallas__without_jit)


if __name__ == "__main__":
  absltest.main()
