"""docs/benchmarks.md against its records (`tools/bench_report.py`, issue R).

Every measured table of the doc sits between `<!-- bench:NAME -->` markers and must be
exactly what `tools/bench_report.py` renders from the committed records under
`docs/records/`. The tests here fail when a table is edited by hand, when a record
changes without the doc, when a block has no renderer or a renderer no block, and when
a stale figure the audit removed comes back.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_tool():
  spec = importlib.util.spec_from_file_location("bench_report", _ROOT / "tools" / "bench_report.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


bench_report = _load_tool()


class DocMatchesRecordsTest(absltest.TestCase):

  def test_doc_tables_are_what_the_records_give(self):
    diff = bench_report.check_doc()
    self.assertEqual(diff, "", "docs/benchmarks.md differs from its records; run "
                     ".venv/bin/python tools/bench_report.py --write\n" + diff[:6000])

  def test_every_block_has_a_renderer_and_every_renderer_a_block(self):
    names = bench_report.blocks(bench_report.DOC.read_text())
    self.assertEqual(len(names), len(set(names)), names)
    self.assertEqual(sorted(names), sorted(bench_report.RENDERERS))

  def test_every_record_is_read_by_some_table(self):
    used = {d.name for d in bench_report.RECORDS.iterdir() if d.is_dir()}
    text = "\n".join(fn(bench_report.RECORDS) for fn in bench_report.RENDERERS.values())
    for sub in sorted(used):
      for path in sorted((bench_report.RECORDS / sub).glob("*.json")):
        rel = f"docs/records/{sub}/{path.name}"
        self.assertIn(rel, text, f"{rel} is committed but no table cites it")

  def test_records_carry_their_provenance(self):
    for path in sorted(bench_report.RECORDS.glob("*/*.json")):
      rec = json.loads(path.read_text())
      for key in ("command", "flags", "git", "date", "machine", "jax", "results"):
        self.assertIn(key, rec, path)
      self.assertRegex(rec["git"]["commit"] or "", r"^[0-9a-f]{40}$", path)
      self.assertTrue(rec["jax"]["jax"], path)
      self.assertIn("load_avg_start", rec["machine"], path)

  def test_stale_figures_stay_out(self):
    """Figures the audit found stale or misleading (issue R) are not stated again."""
    text = bench_report.DOC.read_text()
    for stale in ("0.0545", "135,913,672", "11-13x", "+35%", "2.7-4.2x", "worst 1.00%",
                  "17-22 min"):
      self.assertNotIn(stale, text)


class CheckFailsTest(absltest.TestCase):
  """The check has teeth: an edited table or an edited record is reported."""

  def setUp(self):
    super().setUp()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_report_"))
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    self.doc = tmp / "benchmarks.md"
    shutil.copy(bench_report.DOC, self.doc)
    self.records = tmp / "records"
    shutil.copytree(bench_report.RECORDS, self.records)

  def test_hand_edit_inside_a_block_fails(self):
    text = self.doc.read_text()
    start = text.index("<!-- bench:replay_sim -->")
    i = text.index("| lru |", start)
    self.doc.write_text(text[:i] + text[i:].replace("| lru |", "| LRU |", 1))
    diff = bench_report.check_doc(self.doc, self.records)
    self.assertIn("-| LRU |", diff)
    self.assertIn("+| lru |", diff)
    self.assertEqual(bench_report.main(["--check", f"--doc={self.doc}",
                                        f"--records={self.records}"]), 1)

  def test_changed_record_fails_until_written(self):
    path = self.records / "replay_sim" / "mooncake_lru.json"
    rec = json.loads(path.read_text())
    rec["results"]["rows"][0]["hit_rate"] = 0.5
    path.write_text(json.dumps(rec))
    self.assertIn("0.5000", bench_report.check_doc(self.doc, self.records))
    self.assertEqual(bench_report.main(["--write", f"--doc={self.doc}",
                                        f"--records={self.records}"]), 0)
    self.assertEqual(bench_report.check_doc(self.doc, self.records), "")

  def test_block_without_renderer_is_an_error(self):
    self.doc.write_text(self.doc.read_text() + "\n<!-- bench:nope -->\n<!-- /bench:nope -->\n")
    with self.assertRaisesRegex(KeyError, "nope"):
      bench_report.check_doc(self.doc, self.records)

  def test_command_line_check_passes_on_the_committed_doc(self):
    proc = subprocess.run([sys.executable, str(_ROOT / "tools" / "bench_report.py"), "--check"],
                          cwd=_ROOT, capture_output=True, text=True, timeout=120)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])


class CellsTest(absltest.TestCase):

  def test_verdict_is_on_the_unrounded_number(self):
    self.assertEqual(bench_report.verdict(0.010032, 0.01, at_most=True), "missed")
    self.assertEqual(bench_report.verdict(0.0099, 0.01, at_most=True), "**met**")
    self.assertEqual(bench_report.verdict(0.8999, 0.9, at_most=False), "missed")

  def test_mrange(self):
    self.assertEqual(bench_report.mrange([1.0, 3.0, 2.0]), "2.00x [1.00-3.00]")
    self.assertEqual(bench_report.mrange([1.0, 3.0]), "2.00x [1.00-3.00] (n=2 < 3)")

  def test_render_with_a_fake_renderer(self):
    text = "a\n<!-- bench:t -->\nold\n<!-- /bench:t -->\nb\n"
    got = bench_report.render_doc(text, pathlib.Path("."), {"t": lambda root: "new\n"})
    self.assertEqual(got, "a\n<!-- bench:t -->\nnew\n<!-- /bench:t -->\nb\n")


if __name__ == "__main__":
  absltest.main()
