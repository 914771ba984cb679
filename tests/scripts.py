"""Running the repository's scripts (examples/, benchmarks/) from tests, as a user does.

`start_script` / `run_script` run one in a subprocess from the repository's root;
`load_script(path)` loads one as a module for a test of its own functions without
putting its folder on `sys.path` (the library, the tools and every other test never
import a script: `tests/test_imports.py`). `compile_cache_in_tmp` (autouse where a
module imports it) points the scripts' persistent compilation cache at the test's
temporary directory, so no test writes to the user's cache.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def compile_cache_in_tmp(tmp_path, monkeypatch):
  """The scripts' default compilation cache directory (`start_script` passes os.environ on)."""
  monkeypatch.setenv("PAGED_KV_COMPILE_CACHE", str(tmp_path / "jax_cache"))


def start_script(script: str | pathlib.Path, *args: str, timeout: int = 300):
  """Runs `script` (a path from the repository's root, or absolute) as a user does."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def run_script(script: str, *args: str, timeout: int = 300) -> str:
  """`start_script`'s stdout, after asserting it exited 0."""
  proc = start_script(script, *args, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def load_script(path: str) -> ModuleType:
  """The script at `path` (from the repository's root, e.g.
  "benchmarks/fragmentation_study.py") as a module, loaded once per process (its absl
  flags defined)."""
  key = "_paged_kv_script_" + path.removesuffix(".py").replace("/", "_")
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
  return sys.modules[key]
