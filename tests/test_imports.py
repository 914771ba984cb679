"""Import boundaries: what each package may load, and that no script is imported.

`pip install paged-kv` (no extras) installs jax, jaxlib and numpy only; flax (extra
`model`), absl-py and tqdm (`scripts`), optax (`train`) and chex (`test`) are extras.
A fresh interpreter imports `paged_kv`, `radix` and `pallas_kernels`, runs a
`BlockPool` reserve/release, and must not have loaded any of them. `radix` loads
neither JAX nor `paged_kv`. No module anywhere imports a script of `examples/` or
`benchmarks/` (the benchmarks' shared modules, `shared_flags` and `records`, are
imported by the scripts and tools) or edits `sys.path` to reach one; the library imports
nothing of `benchmarks/`, `tests/`, `tests_compile/` or `tools/`.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

from absl.testing import absltest
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = ("flax", "optax", "absl", "chex", "tqdm", "matplotlib", "prometheus_client",
            "hypothesis")

_PROGRAM = textwrap.dedent("""
    import json, sys
    import numpy as np
    import paged_kv, radix, pallas_kernels

    config = paged_kv.PoolConfig(num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1,
                                 head_dim=8, max_seqs=2, max_segments=4)
    pool = paged_kv.BlockPool(config)
    seq = pool.open_sequence()
    slots = np.asarray(pool.reserve_tokens([seq], [6]))
    assert (slots[0, :6] >= 0).all() and pool.num_free_blocks == 14, (slots, pool.num_free_blocks)
    pool.release([seq])
    pool.check_invariants()
    assert pool.num_free_blocks == 16
    loaded = sorted({name.split(".")[0] for name in sys.modules})
    print(json.dumps({"loaded": loaded, "file": paged_kv.__file__}))
""")


class ImportTest(absltest.TestCase):

  @pytest.mark.slow
  def test_core_loads_no_optional_dependency(self):
    env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertTrue(pathlib.Path(report["file"]).is_relative_to(_ROOT), report["file"])
    leaked = sorted(set(OPTIONAL) & set(report["loaded"]))
    self.assertEqual(leaked, [], f"importing the core loaded optional packages: {leaked}")
    self.assertIn("jax", report["loaded"])

  def test_model_layer_without_flax_names_the_extra(self):
    """Without flax, the model layer's names raise an import error with the install
    hint (flax blocked in the child by a `None` in `sys.modules`)."""
    program = textwrap.dedent("""
        import sys
        sys.modules["flax"] = None
        import paged_kv.model  # the JAX-only part loads
        from paged_kv.model import StepMetadata
        for name in ("PagedAttention", "TinyLlama", "forward"):
          try:
            getattr(paged_kv.model, name)
          except ModuleNotFoundError as e:
            assert "pip install 'paged-kv[model]'" in str(e) and e.name == "flax", e
          else:
            raise AssertionError(name + " loaded without flax")
        try:
          from paged_kv.scheduler import ModelExecutor
          ModelExecutor(object(), None)
        except ModuleNotFoundError as e:
          assert "paged-kv[model]" in str(e), e
        else:
          raise AssertionError("ModelExecutor built without flax")
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", program], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
    self.assertEqual(proc.stdout.strip().splitlines()[-1], "ok")

  def test_radix_loads_neither_jax_nor_paged_kv(self):
    program = "import json, sys, radix; print(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    proc = subprocess.run([sys.executable, "-c", program], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
    top = {name.split(".")[0] for name in json.loads(proc.stdout)}
    self.assertEqual(sorted(top & {"jax", "jaxlib", "paged_kv", "pallas_kernels"}), [])

  @pytest.mark.slow
  def test_nothing_imports_examples(self):
    # (tests/scripts.load_script loads a script by path for a test of its logic.)
    scripts = {p.stem for p in (_ROOT / "examples").glob("*.py")}
    benchmarks = {p.stem for p in (_ROOT / "benchmarks").glob("*.py")} - {
        "__init__", "shared_flags", "records"}
    library = ("paged_kv", "radix", "pallas_kernels")
    offenders = []
    for folder in (*library, "tests", "tests_compile", "examples", "benchmarks", "tools"):
      for path in sorted((_ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
          elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
          else:
            names = []
          for name in names:
            parts = name.split(".")
            if (parts[0] in scripts | benchmarks | {"examples"}
                or parts[0] == "benchmarks" and parts[1:2] and parts[1] in benchmarks
                or folder in library and parts[0] in (
                    "benchmarks", "tests", "tests_compile", "tools")):
              offenders.append(f"{path.relative_to(_ROOT)}:{node.lineno} imports {name}")
          if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("insert", "append")
              and ast.unparse(node.func.value) == "sys.path"):
            offenders.append(f"{path.relative_to(_ROOT)}:{node.lineno} edits sys.path")
    self.assertEqual(offenders, [])

  def test_version_matches_pyproject(self):
    import paged_kv  # pylint: disable=import-outside-toplevel

    with open(_ROOT / "pyproject.toml", "rb") as f:
      version = tomllib.load(f)["project"]["version"]
    self.assertEqual(getattr(paged_kv, "__version__", None), version)


if __name__ == "__main__":
  absltest.main()
