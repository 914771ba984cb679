"""Tests of the scripts of examples/ and benchmarks/: subprocess smoke runs, and unit tests
of a script's logic.

`load_script(path)` loads a script as a module for a test of its own functions (the
study's admission, say) without putting its folder on `sys.path`: the library, the tools
and every other test never import a script (`tests/test_imports.py`).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(path: str) -> ModuleType:
  """The script at `path` (from the repository's root, e.g.
  "benchmarks/fragmentation_study.py") as a module, loaded once per process (its absl
  flags defined)."""
  key = "_paged_kv_script_" + path.removesuffix(".py").replace("/", "_")
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, _ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
  return sys.modules[key]
