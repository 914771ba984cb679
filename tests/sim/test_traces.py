"""Tests of paged_kv.sim.traces: the trace formats, token ids and the exact bound.

Trace files are written by the tests themselves (``trace_files``), never read from
``../shared``.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest

from paged_kv.sim import traces
from paged_kv.sim.traces import TokenSource, TraceRequest
from tests.sim.trace_files import BLOCK, session_trace, tmp_file, write_azure, write_mooncake


def brute_force_bound(requests: list[TraceRequest]) -> int:
  """Hit tokens of an unlimited prefix cache, by comparing every pair of requests."""
  hit = 0
  for i, r in enumerate(requests):
    best = 0
    for p in requests[:i]:
      d = 0
      while d < min(len(r.hash_ids), len(p.hash_ids)) and r.hash_ids[d] == p.hash_ids[d]:
        d += 1
      best = max(best, min(BLOCK * d, r.input_length, p.input_length))
    hit += best
  return hit


class MooncakeTest(absltest.TestCase):

  def test_round_trip(self):
    trace = session_trace(seed=0, num=30, partial=True)
    path = write_mooncake(tmp_file(self, "t.jsonl"), trace)
    loaded = traces.load_trace(path)
    self.assertLen(loaded, 30)
    for a, b in zip(trace, loaded):
      self.assertAlmostEqual(a.arrival_s, b.arrival_s)
      self.assertEqual((a.input_length, a.output_length), (b.input_length, b.output_length))
      np.testing.assert_array_equal(a.hash_ids, b.hash_ids)
      self.assertEqual(b.hash_ids.dtype, np.int64)
    self.assertLen(traces.load_trace(path, max_requests=7), 7)

  def test_reads_the_published_layout(self):
    # Two rows exactly as the Mooncake file has them, plus a blank line.
    text = ('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
            "\n"
            '{"timestamp": 1500, "input_length": 512, "output_length": 7, "hash_ids": [0]}\n')
    path = tmp_file(self, "m.jsonl", text)
    a, b = traces.load_mooncake(path)
    self.assertEqual((a.arrival_s, a.input_length, a.output_length), (0.0, 1000, 5))
    self.assertEqual((b.arrival_s, b.input_length), (1.5, 512))

  def test_wrong_number_of_hash_ids(self):
    text = '{"timestamp": 0, "input_length": 1025, "output_length": 5, "hash_ids": [0, 1]}\n'
    path = tmp_file(self, "bad.jsonl", text)
    with self.assertRaisesRegex(ValueError, "2 hash ids for input_length 1025 .want 3"):
      traces.load_trace(path)


class AzureTest(absltest.TestCase):

  def test_round_trip_relative_times(self):
    rows = [TraceRequest(t, n, m) for t, n, m in [(0.0, 374, 44), (4.3145790, 396, 109),
                                                   (61.25, 5, 1)]]
    path = write_azure(tmp_file(self, "a.csv"), rows)
    with open(path) as f:
      self.assertEqual(f.readline(), "TIMESTAMP,ContextTokens,GeneratedTokens\n")
      self.assertRegex(f.readline(), r"^2023-11-16 18:15:46\.\d{7},374,44$")
    loaded = traces.load_trace(path)
    self.assertEqual([(r.input_length, r.output_length) for r in loaded],
                     [(374, 44), (396, 109), (5, 1)])
    np.testing.assert_allclose([r.arrival_s for r in loaded], [0.0, 4.314579, 61.25], atol=1e-6)
    self.assertTrue(all(r.hash_ids is None for r in loaded))
    self.assertLen(traces.load_trace(path, max_requests=2), 2)

  def test_missing_column(self):
    path = tmp_file(self, "b.csv", "TIMESTAMP,Tokens\n")
    with self.assertRaisesRegex(ValueError, "missing column ContextTokens"):
      traces.load_azure(path)


class LoadTraceTest(absltest.TestCase):

  def test_unknown_extension(self):
    with self.assertRaisesRegex(ValueError, "want .jsonl or .csv"):
      traces.load_trace("trace.parquet")

  def test_missing_file_names_its_origin(self):
    with self.assertRaisesRegex(FileNotFoundError,
                                "nowhere/conversation_trace.jsonl not found.*kvcache-ai/Mooncake"):
      traces.load_trace("/nowhere/conversation_trace.jsonl")
    with self.assertRaisesRegex(FileNotFoundError, "AzurePublicDataset"):
      traces.check_trace_files(["/nowhere/AzureLLMInferenceTrace_code.csv"])
    with self.assertRaisesRegex(FileNotFoundError, "x.csv not found; it is a Mooncake"):
      traces.check_trace_files(["/nowhere/x.csv"])


class TokensTest(absltest.TestCase):

  def test_mooncake_tokens(self):
    tokens = traces.mooncake_tokens(np.array([3, 7], np.int64), 600)
    self.assertEqual(tokens.dtype, np.int32)
    np.testing.assert_array_equal(tokens[:BLOCK], 3 * BLOCK + np.arange(BLOCK))
    np.testing.assert_array_equal(tokens[BLOCK:], 7 * BLOCK + np.arange(600 - BLOCK))
    with self.assertRaisesRegex(ValueError, "too large"):
      traces.mooncake_tokens(np.array([2**31 // BLOCK], np.int64), 10)

  def test_unique_ids_never_match_trace_ids(self):
    trace = [TraceRequest(0.0, 700, 3, np.array([0, 9], np.int64)), TraceRequest(1.0, 50, 3)]
    source = TokenSource(trace)
    hashed = source.prompt(trace[0])
    fresh = source.prompt(trace[1])
    self.assertLen(fresh, 50)
    self.assertGreaterEqual(int(fresh.min()), 10 * BLOCK)
    more = source.unique(5)
    self.assertEqual(int(more[0]), int(fresh[-1]) + 1)
    self.assertEmpty(np.intersect1d(hashed, np.concatenate([fresh, more])))

  def test_scaled_prompt_keeps_prefix_structure(self):
    a = TraceRequest(0.0, 2 * BLOCK, 1, np.array([0, 1], np.int64))
    b = TraceRequest(0.0, 3 * BLOCK - 100, 1, np.array([0, 1, 2], np.int64))
    source = TokenSource([a, b])
    pa, pb = (traces.scaled_prompt(r, source, 16) for r in (a, b))
    self.assertEqual((pa.size, pb.size), (64, 3 * 32 - 6))
    np.testing.assert_array_equal(pa, pb[:64])
    self.assertLen(traces.scaled_prompt(TraceRequest(0.0, 3, 1), source, 16), 1)


class BoundTest(absltest.TestCase):

  def test_exact_bound_equals_brute_force(self):
    for seed in range(3):
      trace = session_trace(seed=seed, num=60, num_sessions=5, partial=True)
      hit, total = traces.exact_hit_bound(trace)
      self.assertEqual(total, sum(r.input_length for r in trace))
      self.assertEqual(hit, brute_force_bound(trace))
      self.assertGreater(hit, 0)

  def test_no_prefix_information_hits_nothing(self):
    trace = [TraceRequest(float(i), 100, 1) for i in range(4)]
    self.assertEqual(traces.exact_hit_bound(trace), (0, 400))


if __name__ == "__main__":
  absltest.main()
