"""`StepMetadata.page_table`: segment tables as classic page tables, so another paged
kernel (here JAX's built-in GPU paged attention, in Pallas interpret mode) can serve the
rows whose segments are whole blocks, and gives the same output as ours."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.model import StepMetadata, StepPlan, paged_attention
from tests.testutil import KVModel

CFG = paged_kv.PoolConfig(num_blocks=32, block_size=16, num_layers=1, num_kv_heads=2,
                          head_dim=16, max_seqs=4, max_segments=8)
Q_HEADS = 8


@jax.jit
def _step(state, plan, q, k, v):
  state, (slot_idx, status) = paged_kv.reserve_tokens(
      state, plan.seq_ids, plan.num_new, config=CFG, max_new_tokens=plan.max_query_len)
  meta = StepMetadata.from_reservation(plan, state.table, slot_idx, status)
  pages, out = paged_attention(q, k, v, state.pages, 0, meta, impl="xla")
  return dataclasses.replace(state, pages=pages), meta, out


class PageTableTest(absltest.TestCase):

  def test_whole_block_rows_match_jax_builtin_paged_attention(self):
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as upstream
    except Exception as e:  # pylint: disable=broad-except
      self.skipTest(f"JAX's GPU paged attention does not import here: {e}")
    pool = paged_kv.BlockPool(CFG)
    model = KVModel(pool)
    a, b = model.open(), model.open()
    model.append([a, b], [40, 20])
    # A prefix of 24 tokens of `a` (its second block half used): not a page table.
    prefix = pool.segments(a)[:2].copy()
    prefix[1, 2] = 8  # (block, start 0, 8 of its 16 tokens)
    c = model.open(prefix, prefix_of=a, prefix_len=24)
    # One decode token each (token ids 1, 2, 3); row 3 is padding.
    plan = StepPlan.build([(a, [1]), (b, [2]), (c, [3])], num_rows=4, max_query_len=1)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((plan.num_tokens, Q_HEADS, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((plan.num_tokens, 2, 16)), jnp.float32)
    pool.state, meta, ours = _step(pool.state, plan, q, kv, kv)
    tables, lens, whole = meta.page_table(CFG.block_size)
    np.testing.assert_array_equal(whole, [True, True, False, False])  # c split mid-block
    np.testing.assert_array_equal(lens, [41, 21, 0, 0])
    np.testing.assert_array_equal(tables[0, :3], pool.segments(a)[:, 0])
    pages = pool.state.pages
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      theirs = upstream.paged_attention(q[:4] / math.sqrt(16), pages.k[0], pages.v[0], tables,
                                        lens, k_splits=1, pages_per_compute_block=4,
                                        interpret=True)
    np.testing.assert_allclose(np.asarray(theirs)[:2], np.asarray(ours)[:2], rtol=2e-5,
                               atol=2e-5)

  def test_on_the_host_too(self):
    meta = StepMetadata(
        seq_ids=np.array([0, 1, -1], np.int32), positions=np.zeros(3, np.int32),
        slot_mapping=np.zeros(3, np.int32), cu_q_lens=np.arange(4, dtype=np.int32),
        seg_block=np.array([[3, 4, 0], [5, 6, 0], [0, 0, 0]], np.int32),
        seg_start=np.array([[0, 0, 0], [0, 4, 0], [0, 0, 0]], np.int32),
        seg_length=np.array([[16, 3, 0], [16, 2, 0], [0, 0, 0]], np.int32),
        num_segments=np.array([2, 2, 0], np.int32), seq_lens=np.array([19, 18, 0], np.int32),
        num_decodes=np.int32(2), num_prefills=np.int32(0))
    tables, lens, whole = meta.page_table(16)
    np.testing.assert_array_equal(whole, [True, False, False])  # row 1's tail is slotted
    np.testing.assert_array_equal(tables, [[3, 4, 0], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(lens, [19, 0, 0])


if __name__ == "__main__":
  absltest.main()
