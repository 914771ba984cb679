"""The compile tier's session: JAX on the CPU backend (the CUDA plugin is loaded
for its compiler only: `get_topology_desc` needs no GPU, while initialising the
cuda backend would look for a driver), and a table of compile times at the end.

Run with the tier's venv: `make compile-tier`, or
`.venv-cuda/bin/python -m pytest -q tests_compile` (tools/compile_tier/setup.sh
makes it). Under the main .venv, without the plugin, every test fails with a
message saying so: the tier never skips.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the plugin's "no CUDA driver" notes


def pytest_terminal_summary(terminalreporter):
  from tests_compile import tier  # pylint: disable=import-outside-toplevel

  if not tier.TIMES:
    return
  rows = sorted(tier.TIMES, key=lambda r: -(r[1] + r[2]))
  total = sum(r[1] + r[2] for r in rows)
  terminalreporter.section(f"compile tier: {len(rows)} programs, {total:.0f} s trace+lower+compile")
  terminalreporter.write_line(f"{'lower s':>8} {'compile s':>9}  test")
  for name, low, comp in rows:
    terminalreporter.write_line(f"{low:8.1f} {comp:9.1f}  {name}")


def pytest_configure(config):
  # Upstream's notice on every Triton-lowered pallas_call (DESIGN.md: Mosaic GPU
  # is the Hopper path); the tier compiles those kernels on purpose.
  config.addinivalue_line(
      "filterwarnings", "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
