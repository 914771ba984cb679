"""tools/gpu_check_record.py: a gpu_check result filed as a benchmark record."""

import importlib.util
import json
import pathlib
import subprocess
import tempfile
import unittest

from benchmarks import records

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("gpu_check_record",
                                               _ROOT / "tools" / "gpu_check_record.py")
gpu_check_record = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check_record)

_RESULT = {"date": "2026-12-04T16:44:30Z", "command": "tools/gpu_check.py --budget_s=300",
           "jax": "0.11.2", "device_kind": "NVIDIA H200", "backend": "gpu",
           "nvidia_smi": "NVIDIA H200, 143771 MiB", "mode": "full run",
           "summary": {"rows": 1, "passed": 1, "failed": 0, "skipped": 0, "timeouts": 0,
                       "goals_missed": [], "wall_s": 1.0},
           "rows": [{"id": "copy/x", "gbps": 1.0, "us_per_call": 2.0, "copy_pct": None,
                     "x_builtin": None, "goal": ""}]}


class GpuCheckRecordTest(unittest.TestCase):

  def test_a_filed_result_reads_as_a_record(self):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
      src = pathlib.Path(tmp) / "gpu_check.json"
      src.write_text(json.dumps(_RESULT))
      self.assertEqual(gpu_check_record.main([str(src), "--commit", head[:7], "--cpus", "16",
                                              "--record", tmp + "/rec"]), 0)
      (rec,) = records.load_records(tmp + "/rec")
    self.assertEqual(rec["bench"], "gpu_check")
    self.assertEqual(rec["git"]["commit"], head)
    self.assertEqual(rec["results"]["rows"], _RESULT["rows"])
    self.assertEqual(rec["machine"]["cpu_count"], 16)

  def test_not_a_result_or_not_a_commit_is_refused(self):
    with tempfile.TemporaryDirectory() as tmp:
      src = pathlib.Path(tmp) / "other.json"
      src.write_text(json.dumps({"date": "x"}))
      self.assertEqual(gpu_check_record.main([str(src), "--commit", "HEAD", "--record", tmp]), 2)
      src.write_text(json.dumps(_RESULT))
      self.assertEqual(gpu_check_record.main([str(src), "--commit", "no-such-ref",
                                              "--record", tmp]), 2)
      self.assertEqual(sorted(p.name for p in pathlib.Path(tmp).iterdir()), ["other.json"])


if __name__ == "__main__":
  unittest.main()
