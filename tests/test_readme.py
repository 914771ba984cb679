"""The README's tour runs as written.

Every fenced ```python block of README.md is executed, in order, in one fresh
interpreter (blocks share a namespace, as a reader pasting them into one session
would). A block fenced as ```python no-run is skipped: the examples that need a
checkpoint on disk or a running server (tests/model/test_hf_checkpoint.py,
tests/entrypoints/test_llm.py and tests/entrypoints/test_openai_server.py make the same calls
on tiny checkpoints they write).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest

# The README's code, run as written.
pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)


def readme_blocks(text: str) -> list[str]:
  """The runnable python blocks of a markdown text, in order."""
  return [m.group(1) for m in _FENCE.finditer(text)]


class ReadmeTest(absltest.TestCase):

  def test_fence_parser_finds_blocks(self):
    md = "intro\n```python\nx = 1\n```\ntext\n```\nnot python\n```\n```python\ny = x\n```\n"
    self.assertEqual(readme_blocks(md), ["x = 1\n", "y = x\n"])

  def test_tour_runs_as_written(self):
    blocks = readme_blocks((_ROOT / "README.md").read_text())
    self.assertGreaterEqual(len(blocks), 3, "the README tour lost its code blocks")
    script = "\n".join(
        f"print('--- block {i}', flush=True)\n{textwrap.dedent(b)}" for i, b in enumerate(blocks))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(_ROOT))
    proc = subprocess.run([sys.executable, "-c", script], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-4000:])


if __name__ == "__main__":
  absltest.main()
