"""The block-size rule: `paged_kv.core.block_size` and `PoolConfig.for_workload`."""

import math
import pathlib

import hypothesis
from hypothesis import strategies as st
import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core import block_size
from paged_kv.core.errors import InvalidArgument
from paged_kv.sim import traces

_TRACES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "traces"

LENGTHS = [1, 16, 17, 100, 100, 5000]


def _gpu_record(rates: dict[int, float], shape="b64x8k", failed=()) -> dict:
  rows = []
  for b, gbps in rates.items():
    rid = f"layer/{shape}/default" if b == 16 else f"layer/{shape}-bs{b}/default"
    rows.append(dict(id=rid, gbps=gbps, status="FAILED" if b in failed else "ok"))
  rows.append(dict(id=f"copy/{shape}", gbps=9999.0, status="ok"))
  return {"results": {"rows": rows}}


class DistributionTest(parameterized.TestCase):

  def test_lengths_and_histogram_agree(self):
    a = block_size.length_distribution(LENGTHS)
    b = block_size.length_distribution(histogram={1: 1, 16: 1, 17: 1, 100: 2, 5000: 1, 7: 0})
    keep = b[1] > 0
    np.testing.assert_array_equal(a[0], b[0][keep])
    np.testing.assert_array_equal(a[1], b[1][keep])
    np.testing.assert_array_equal(block_size.length_distribution(np.array(LENGTHS))[1],
                                  [1, 1, 1, 2, 1])

  @parameterized.named_parameters(
      ("neither", dict()), ("both", dict(lengths=[1], histogram={1: 1})),
      ("empty", dict(lengths=[])), ("zero", dict(lengths=[3, 0])),
      ("negative", dict(lengths=[-2])), ("floats", dict(lengths=[1.5, 2.0])),
      ("two_d", dict(lengths=[[1, 2]])), ("string", dict(lengths="123")),
      ("mapping_as_lengths", dict(lengths={1: 2})),
      ("histogram_not_mapping", dict(histogram=[(1, 2)])),
      ("histogram_bad_length", dict(histogram={0: 1})),
      ("histogram_float_length", dict(histogram={1.0: 1})),
      ("histogram_negative_count", dict(histogram={4: -1})),
      ("histogram_bool_count", dict(histogram={4: True})),
      ("histogram_counts_nothing", dict(histogram={4: 0})))
  def test_bad_input_raises(self, kwargs):
    with self.assertRaises(InvalidArgument):
      block_size.length_distribution(**kwargs)


class EfficiencyTest(parameterized.TestCase):

  def test_exact_values(self):
    v, c = block_size.length_distribution([1, 16, 17])
    self.assertEqual(block_size.block_efficiency(v, c, 16), 34 / 64)
    self.assertEqual(block_size.block_efficiency(v, c, 64), 34 / 192)
    self.assertEqual(block_size.block_efficiency(v, c, 64, slotted_share=1.0), 1.0)
    # Half the sequences slotted: the slots are the mean of the two costs.
    self.assertEqual(block_size.block_efficiency(v, c, 64, slotted_share=0.5),
                     34 / (0.5 * 192 + 0.5 * 34))
    # Packing that wins back a quarter of the empty slots of every tail.
    self.assertEqual(block_size.block_efficiency(v, c, 64, slotted_share=1.0,
                                                 slot_recovery=0.25),
                     34 / (192 - 0.25 * (192 - 34)))
    self.assertEqual(block_size.block_efficiency(v, c, 64, slotted_share=1.0,
                                                 slot_recovery=0.0), 34 / 192)

  @parameterized.parameters((0,), (3,), (256,), (True,), (16.0,))
  def test_bad_block_size(self, b):
    v, c = block_size.length_distribution(LENGTHS)
    with self.assertRaises(InvalidArgument):
      block_size.block_efficiency(v, c, b)

  @parameterized.parameters((-0.1,), (1.5,), (True,), ("half",), (math.nan,))
  def test_bad_share_or_recovery(self, value):
    v, c = block_size.length_distribution(LENGTHS)
    with self.assertRaises(InvalidArgument):
      block_size.block_efficiency(v, c, 16, slotted_share=value)
    with self.assertRaises(InvalidArgument):
      block_size.block_efficiency(v, c, 16, slotted_share=1.0, slot_recovery=value)

  @hypothesis.settings(max_examples=60, deadline=None)
  @hypothesis.given(st.lists(st.integers(1, 200_000), min_size=1, max_size=40),
                    st.floats(0.0, 1.0), st.floats(0.0, 1.0))
  def test_never_better_at_a_bigger_block(self, lengths, share, recovery):
    v, c = block_size.length_distribution(lengths)
    eff = [block_size.block_efficiency(v, c, b, slotted_share=share, slot_recovery=recovery)
           for b in (8, 16, 32, 64)]
    for small, big in zip(eff, eff[1:]):
      self.assertGreaterEqual(small, big - 1e-15)
    self.assertTrue(all(0 < e <= 1 for e in eff), eff)


class ChooseTest(parameterized.TestCase):

  def test_unmeasured_picks_the_smallest(self):
    choice = block_size.choose_block_size(LENGTHS)
    self.assertEqual(choice.block_size, 16)
    self.assertFalse(choice.measured)
    self.assertEqual(choice.bandwidth, {16: 1.0, 32: 1.0, 64: 1.0})
    self.assertEqual(choice.candidates, (16, 32, 64))
    self.assertEqual(choice.break_even[16], 1.0)
    self.assertGreater(choice.break_even[64], choice.break_even[32])

  def test_rates_are_relative_to_the_smallest(self):
    a = block_size.choose_block_size(LENGTHS, bandwidth={16: 2.0, 32: 2.0, 64: 4.0})
    b = block_size.choose_block_size(LENGTHS, bandwidth={16: 1, 32: 1, 64: 2})
    self.assertEqual(a.bandwidth, b.bandwidth)
    self.assertEqual(a.block_size, b.block_size)
    self.assertTrue(a.measured)

  def test_long_contexts_pick_big_blocks_short_ones_do_not(self):
    rates = {16: 1.0, 32: 1.02, 64: 1.04}  # bigger pages read a little faster
    long = block_size.choose_block_size(histogram={131072: 3, 8000: 60})
    self.assertEqual(long.block_size, 16)  # unmeasured
    self.assertEqual(block_size.choose_block_size(histogram={131072: 3, 8000: 60},
                                                  bandwidth=rates).block_size, 64)
    short = block_size.choose_block_size(histogram={20: 100, 40: 50}, bandwidth=rates)
    self.assertEqual(short.block_size, 16)
    # Slotting the short ones' tails makes the big block cost nothing more.
    slotted = block_size.choose_block_size(histogram={20: 100, 40: 50}, bandwidth=rates,
                                           slotted_share=1.0)
    self.assertEqual(slotted.block_size, 64)
    # Packing that wins back only a third of the empty slots does not pay for it.
    third = block_size.choose_block_size(histogram={20: 100, 40: 50}, bandwidth=rates,
                                         slotted_share=1.0, slot_recovery=1 / 3)
    self.assertEqual((third.block_size, third.slot_recovery), (16, 1 / 3))

  @hypothesis.settings(max_examples=60, deadline=None)
  @hypothesis.given(st.lists(st.integers(1, 100_000), min_size=1, max_size=30),
                    st.sampled_from([32, 64]), st.floats(0.0, 1.0))
  def test_break_even_is_the_threshold(self, lengths, big, share):
    """Just above its break-even rate (others at block 16's rate) a candidate is picked;
    just below, it is not."""
    base = block_size.choose_block_size(lengths, slotted_share=share)
    be = base.break_even[big]
    for factor, picked in ((1 + 1e-9, True), (1 - 1e-9, False)):
      rates = {16: 1.0, 32: 1.0, 64: 1.0, big: be * factor}
      got = block_size.choose_block_size(lengths, bandwidth=rates, slotted_share=share)
      self.assertEqual(got.block_size == big, picked, (be, got))

  @parameterized.named_parameters(
      ("missing_rate", dict(bandwidth={16: 1.0, 32: 1.0})),
      ("zero_rate", dict(bandwidth={16: 1.0, 32: 0.0, 64: 1.0})),
      ("nan_rate", dict(bandwidth={16: 1.0, 32: math.nan, 64: 1.0})),
      ("bool_rate", dict(bandwidth={16: 1.0, 32: True, 64: 1.0})),
      ("not_mapping", dict(bandwidth=[1.0, 1.0, 1.0])),
      ("duplicate_candidates", dict(candidates=(16, 16))),
      ("no_candidates", dict(candidates=())),
      ("odd_candidate", dict(candidates=(16, 48))),
      ("string_candidates", dict(candidates="16")),
      ("bad_share", dict(slotted_share=2.0)),
      ("bad_recovery", dict(slotted_share=1.0, slot_recovery=-1.0)))
  def test_bad_arguments_raise(self, kwargs):
    with self.assertRaises(InvalidArgument):
      block_size.choose_block_size(LENGTHS, **kwargs)


class GpuCheckTest(absltest.TestCase):

  def test_reads_the_block_size_rows(self):
    rec = _gpu_record({16: 3400.0, 32: 3450.0, 64: 3500.0})
    self.assertEqual(block_size.bandwidth_from_gpu_check(rec),
                     {16: 3400.0, 32: 3450.0, 64: 3500.0})
    self.assertEqual(block_size.bandwidth_from_gpu_check(rec["results"]),
                     {16: 3400.0, 32: 3450.0, 64: 3500.0})  # the script's own json
    rec = _gpu_record({16: 2800.0, 64: 2900.0}, shape="b1x128k")
    self.assertEqual(block_size.bandwidth_from_gpu_check(rec, "b1x128k"), {16: 2800.0, 64: 2900.0})

  def test_failed_rows_are_left_out(self):
    rec = _gpu_record({16: 3400.0, 32: 3450.0, 64: 3500.0}, failed=(64,))
    rates = block_size.bandwidth_from_gpu_check(rec)
    self.assertEqual(sorted(rates), [16, 32])
    with self.assertRaises(InvalidArgument):  # the rule needs every candidate's rate
      block_size.choose_block_size(LENGTHS, bandwidth=rates)

  def test_no_rows_raise(self):
    with self.assertRaises(InvalidArgument):
      block_size.bandwidth_from_gpu_check(_gpu_record({16: 1.0}), "b1x128k")
    with self.assertRaises(InvalidArgument):
      block_size.bandwidth_from_gpu_check({"rows": "none"})


class ForWorkloadTest(parameterized.TestCase):

  def test_pool_tokens_fixed_whatever_the_pick(self):
    small = paged_kv.PoolConfig.for_workload(LENGTHS, pool_tokens=4096, num_layers=2)
    self.assertEqual((small.block_size, small.num_blocks, small.num_layers), (16, 256, 2))
    big = paged_kv.PoolConfig.for_workload(histogram={8192: 4}, pool_tokens=4096,
                                           bandwidth={16: 1.0, 32: 1.0, 64: 1.1})
    self.assertEqual((big.block_size, big.num_blocks), (64, 64))
    self.assertEqual(big.num_slots, small.num_slots)

  @parameterized.named_parameters(
      ("block_size_given", dict(pool_tokens=4096, block_size=16)),
      ("num_blocks_given", dict(pool_tokens=4096, num_blocks=8)),
      ("zero_tokens", dict(pool_tokens=0)), ("float_tokens", dict(pool_tokens=4096.0)),
      ("below_one_block", dict(pool_tokens=32)),
      ("bad_field", dict(pool_tokens=4096, head_dim=0)))
  def test_bad_arguments_raise(self, kwargs):
    with self.assertRaises(InvalidArgument):
      paged_kv.PoolConfig.for_workload(LENGTHS, **kwargs)


class TraceTest(absltest.TestCase):

  def test_public_traces_break_even(self):
    """On the public traces (first 2,000 requests): the longer the trace's sequences,
    the smaller the read-rate gain block 64 needs; every gain needed is positive."""
    names = ("conversation_trace.jsonl", "AzureLLMInferenceTrace_conv.csv")
    if not all((_TRACES / n).exists() for n in names):
      self.skipTest(f"the public traces are not in {_TRACES} (a clone has no ../shared)")
    means, break_even = [], []
    for name in names:
      reqs = traces.load_trace(str(_TRACES / name), 2000)
      lengths = [r.input_length + r.output_length for r in reqs]
      choice = block_size.choose_block_size(lengths)
      means.append(np.mean(lengths))
      break_even.append(choice.break_even[64])
    self.assertGreater(means[0], means[1])  # Mooncake's sequences are the longer
    self.assertLess(1.0, break_even[0])
    self.assertLess(break_even[0], break_even[1])


if __name__ == "__main__":
  absltest.main()
