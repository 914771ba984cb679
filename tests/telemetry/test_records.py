"""Benchmark records (`benchmarks.records`): provenance, JSON, report cells."""

from __future__ import annotations

import json
import math
import pathlib
import tempfile

import numpy as np
from absl.testing import absltest

from benchmarks import records


class CellsTest(absltest.TestCase):

  def test_median_range(self):
    self.assertEqual(records.median_range([3.0, 1.0, 2.0]), (2.0, 1.0, 3.0))
    self.assertEqual(records.median_range([1, 2, 3, 4]), (2.5, 1.0, 4.0))
    with self.assertRaises(ValueError):
      records.median_range([])

  def test_format_median_range(self):
    self.assertEqual(records.format_median_range([2.5, 1.25, 3.0], suffix="x"),
                     "2.50x [1.25-3.00]")
    self.assertEqual(records.format_median_range([10.0, 12.0, 11.0, 13.0], fmt="{:.1f}"),
                     "11.5 [10.0-13.0]")

  def test_format_median_range_says_when_runs_are_too_few(self):
    self.assertEqual(records.format_median_range([2.0, 4.0], suffix="x"),
                     "3.00x [2.00-4.00] (n=2 < 3)")
    self.assertNotIn("n=", records.format_median_range([1.0, 2.0, 3.0]))

  def test_goal_met_uses_the_unrounded_number(self):
    # The audit's case: a worst mean of 1.0032% prints as "1.00%" but misses a 1% goal.
    self.assertFalse(records.goal_met(0.010032, 0.01, at_most=True))
    self.assertEqual(f"{0.010032:.2%}", "1.00%")
    self.assertFalse(records.goal_met(0.010002, 0.01, at_most=True))
    self.assertTrue(records.goal_met(0.0099999, 0.01, at_most=True))
    self.assertTrue(records.goal_met(0.01, 0.01, at_most=True))
    self.assertFalse(records.goal_met(9.996, 10.0, at_most=False))  # rounds to "10.0x"
    self.assertTrue(records.goal_met(10.0, 10.0, at_most=False))
    self.assertFalse(records.goal_met(float("nan"), 1.0, at_most=True))
    self.assertFalse(records.goal_met(None, 1.0, at_most=False))


class JsonTest(absltest.TestCase):

  def test_to_jsonable(self):
    got = records.to_jsonable({"a": np.int64(3), "b": np.float32(0.5), "c": np.arange(3),
                               ("k", 1): (1, 2), "nan": float("nan"), "inf": np.inf,
                               "flag": np.bool_(True), "s": {2, 1}})
    self.assertEqual(got, {"a": 3, "b": 0.5, "c": [0, 1, 2], "k/1": [1, 2], "nan": None,
                           "inf": None, "flag": True, "s": [1, 2]})
    json.dumps(got, allow_nan=False)


class RecorderTest(absltest.TestCase):

  def test_no_path_writes_nothing(self):
    self.assertIsNone(records.Recorder(None, "x").write({"a": 1}))

  def test_record_has_its_provenance(self):
    with tempfile.TemporaryDirectory() as tmp:
      rec = records.Recorder(pathlib.Path(tmp) / "sub" / "r.json", "bench_test",
                             flag_values={"steps": 3}, seeds=[0, 1],
                             argv=["benchmarks/bench_test.py", "--steps=3"])
      path = rec.write({"ratio": np.float64(1.5), "bad": math.nan}, notes=["loaded"])
      got = records.read_record(path)
    self.assertEqual(got["bench"], "bench_test")
    self.assertEqual(got["command"], "python benchmarks/bench_test.py --steps=3")
    self.assertEqual(got["flags"], {"steps": 3})
    self.assertEqual(got["seeds"], [0, 1])
    self.assertEqual(got["results"], {"ratio": 1.5, "bad": None})
    self.assertEqual(got["notes"], ["loaded"])
    self.assertRegex(got["date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
    self.assertRegex(got["git"]["commit"] or "", r"^[0-9a-f]{40}$")
    self.assertIn(got["git"]["dirty"], (True, False))
    for key in ("platform", "cpu_count", "load_avg_start", "load_avg_end", "python"):
      self.assertIn(key, got["machine"])
    self.assertTrue(got["jax"]["jax"])  # the version, from the installed distribution
    self.assertGreaterEqual(got["wall_s"], 0)

  def test_commit_is_the_one_at_the_start(self):
    """A run that outlives a commit records the commit its code was loaded from."""
    real = records.git_info
    try:
      records.git_info = lambda: {"commit": "a" * 40, "dirty": False, "dirty_paths": []}
      rec = records.Recorder(None, "x")
      records.git_info = lambda: {"commit": "b" * 40, "dirty": False, "dirty_paths": []}
      self.assertEqual(rec.record({})["git"]["commit"], "a" * 40)
    finally:
      records.git_info = real

  def test_directory_path_gets_a_named_file(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = records.Recorder(tmp + "/", "bench_dir").write([1, 2])
      self.assertEqual(path.parent, pathlib.Path(tmp))
      self.assertTrue(path.name.startswith("bench_dir-") and path.suffix == ".json")
      self.assertLen(records.load_records(tmp), 1)

  def test_read_record_refuses_other_json(self):
    with tempfile.TemporaryDirectory() as tmp:
      p = pathlib.Path(tmp) / "x.json"
      p.write_text(json.dumps({"bench": "x"}))
      with self.assertRaisesRegex(ValueError, "not a benchmark record"):
        records.read_record(p)

  def test_script_flags_reads_only_the_given_module(self):

    class Flag:

      def __init__(self, name, value):
        self.name, self.value = name, value

    class Flags:

      def get_flags_for_module(self, module):
        return [Flag("b", (1, 2)), Flag("a", "x")] if module == "main.py" else []

    self.assertEqual(records.script_flags(Flags(), "main.py"), {"a": "x", "b": [1, 2]})
    self.assertEqual(records.script_flags(Flags(), "other.py"), {})


if __name__ == "__main__":
  absltest.main()
